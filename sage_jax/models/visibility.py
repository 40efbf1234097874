"""Which cache slots a cache-reading forward's queries see, in the one shape every decoding step has.

Every forward of the decoding loops (the target's verify, each draft tree level, the draft's catch-up, a plain
decode step) lets its T queries see the committed prefix [pad, start) of their row, and within the window of U
slots [start, start + U) that the step writes past it only what `window` [B, T, U] allows: a tree's ancestor
relation, or the causal order of a chain. Kept in this form, the XLA path builds the dense [B, T, S] mask
(`dense`) and the Pallas tree-attention kernel reads the prefix by its two per-row numbers instead
(`pallas_kernels/tree_attention`), touching only the visible cache blocks.
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


@flax.struct.dataclass
class Visibility:
    """The committed prefix [pad, start) for every query, and window slot start + u where window[b, t, u].

    Attributes: pad, start: [B]; window: [B, T, U]. `start + U` must not pass the cache's capacity (the loops size
    their caches so), and a window slot below `pad` is the window's own business (a prefill's window hides them).
    """

    pad: Int[Array, " B"]
    start: Int[Array, " B"]
    window: Bool[Array, "B T U"]

    @classmethod
    def chain(cls, start: Int[Array, " B"], pad: Int[Array, " B"], t: int) -> Visibility:
        """T queries at slots start + [0, T), each seeing the prefix and the chain up to itself."""
        causal = jnp.tril(jnp.ones((t, t), bool))
        return cls(pad=pad, start=start, window=jnp.broadcast_to(causal, (start.shape[0], t, t)))

    def first(self, t: int) -> Visibility:
        """The first `t` queries (a forward run at a smaller static width)."""
        return self.replace(window=self.window[:, :t])

    def dense(self, capacity: int) -> Bool[Array, "B T S"]:
        """The [B, T, S] mask over a cache of `capacity` slots (the XLA path's)."""
        j = jnp.arange(capacity)[None, None, :]
        committed = (j >= self.pad[:, None, None]) & (j < self.start[:, None, None])
        off = j - self.start[:, None, None]
        u = self.window.shape[-1]
        in_window = (off >= 0) & (off < u)
        idx = jnp.broadcast_to(jnp.clip(off, 0, u - 1), self.window.shape[:2] + (capacity,))
        return committed | (in_window & jnp.take_along_axis(self.window, idx, -1))
