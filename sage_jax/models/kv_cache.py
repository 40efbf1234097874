"""A fixed-capacity key/value cache as a pytree: stacked over layers, written per row at arbitrary offsets."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from configs.sharding import shard


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer, one array per layer.

    Attributes:
      k, v: L arrays [B, S, K, H]; slot j of row b holds the token written there last. Which slots a query may
        see is decided by the attention mask, never by the cache, so stale slots are harmless.

    One array per layer (not one stacked [L, ...] array) because XLA:CPU updates a per-layer array in place but
    copies a slice of a stacked one on every read-modify-write (measured: 1.3 ms vs 31 ms per decode step).
    """

    k: tuple[Float[Array, "B S K H"], ...]
    v: tuple[Float[Array, "B S K H"], ...]

    @classmethod
    def zeros(cls, n_layers: int, batch: int, capacity: int, n_kv_heads: int, head_dim: int,
              dtype=jnp.float32, *, cut_heads: bool = False) -> KVCache:
        """An empty cache, born sharded under a current mesh (`configs.sharding.use`): rows over the batch axes,
        and with `cut_heads` the kv heads over the tensor-parallel axis (a model whose attention is tensor-parallel,
        `LM.groups`), so that no device ever holds, or gathers, the whole cache."""
        shape = (batch, capacity, n_kv_heads, head_dim)
        names = ("batch", "cache_seq", "kv_heads" if cut_heads else None, "head_dim")
        zeros = lambda: shard(jnp.zeros(shape, dtype), names)  # noqa: E731
        return cls(k=tuple(zeros() for _ in range(n_layers)), v=tuple(zeros() for _ in range(n_layers)))

    @property
    def n_layers(self) -> int:
        return len(self.k)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    def commit(self, new: NewKV, rows: Int[Array, "B A"], dst_start: Int[Array, " B"]) -> KVCache:
        """Writes the rows `rows[b, :]` of `new` (keys/values of T fresh tokens, `LM.forward(write=False)`) to
        the contiguous slots `dst_start[b] + [0, A)`: a speculative step's accepted path, root first."""
        idx = rows[None, :, :, None, None]
        k, v = (jnp.take_along_axis(a, idx, axis=2) for a in (new.k, new.v))  # [L, B, A, K, H]
        return KVCache(k=tuple(write_rows(c, k[i].astype(c.dtype), dst_start) for i, c in enumerate(self.k)),
                       v=tuple(write_rows(c, v[i].astype(c.dtype), dst_start) for i, c in enumerate(self.v)))


@flax.struct.dataclass
class NewKV:
    """Keys and values of T new tokens, all layers stacked: k, v [L, B, T, K, H] (`LM.forward(write=False)`).
    Stacked, padding or picking rows is one op rather than one per layer."""

    k: Float[Array, "L B T K H"]
    v: Float[Array, "L B T K H"]


def write_rows(cache: Float[Array, "B S K H"], new: Float[Array, "B T K H"], start: Int[Array, " B"]
               ) -> Float[Array, "B S K H"]:
    """Writes `new[b]` into `cache[b, start[b] : start[b] + T]`."""
    return jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice_in_dim(c, u, s, axis=0))(cache, new, start)
