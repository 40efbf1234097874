"""A fixed-capacity key/value cache as a pytree: stacked over layers, written per row at arbitrary offsets."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer.

    Attributes:
      k, v: [L, B, S, K, H]; slot j of row b holds the token written there last. Which slots a query may see
        is decided by the attention mask, never by the cache, so stale slots are harmless.
    """

    k: Float[Array, "L B S K H"]
    v: Float[Array, "L B S K H"]

    @classmethod
    def zeros(cls, n_layers: int, batch: int, capacity: int, n_kv_heads: int, head_dim: int,
              dtype=jnp.float32) -> KVCache:
        shape = (n_layers, batch, capacity, n_kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def gather(self, src: Int[Array, "B M"], dst_start: Int[Array, " B"]) -> KVCache:
        """Copies slots `src[b, :]` of each row to the contiguous slots `dst_start[b] + [0, M)`.

        This is the commit of a speculative step: the accepted tree nodes' entries move to the accepted path's
        positions. Sources are read before anything is written, so overlapping ranges are safe.
        """

        def per_row(c, s, d):  # c: [L, S, K, H]
            return jax.lax.dynamic_update_slice_in_dim(c, jnp.take(c, s, axis=1), d, axis=1)

        move = jax.vmap(per_row, in_axes=(1, 0, 0), out_axes=1)
        return KVCache(k=move(self.k, src, dst_start), v=move(self.v, src, dst_start))


def write_rows(cache: Float[Array, "B S K H"], new: Float[Array, "B T K H"], start: Int[Array, " B"]
               ) -> Float[Array, "B S K H"]:
    """Writes `new[b]` into `cache[b, start[b] : start[b] + T]`."""
    return jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice_in_dim(c, u, s, axis=0))(cache, new, start)
