"""A reduced draft vocabulary: the Vd most frequent token ids of the training data and the LM-head rows for them.

Drafting cost on CPU is dominated by the 49,152-row LM head; scoring only the frequent rows cuts it by V/Vd.
The subset is gathered ONCE (`DraftVocab.build`); the draft then returns logits over the Vd ids, and `to_full`
maps them back to the full vocabulary (-inf outside the subset), so a policy can always see full-vocab
log-probabilities. Losslessness never depends on it: tokens outside the subset are simply never drafted.
"""

from __future__ import annotations

from collections.abc import Iterable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


def top_ids(sequences: Iterable[Iterable[int]], n: int, vocab_size: int, *, always: Iterable[int] = ()) -> np.ndarray:
    """The `n` most frequent ids in `sequences` (ties: smaller id first), plus `always` (e.g. EOS), sorted."""
    counts = np.zeros((vocab_size,), np.int64)
    for seq in sequences:
        np.add.at(counts, np.asarray(list(seq), np.int64), 1)
    forced = sorted({int(i) for i in always})
    if n > vocab_size or n < len(forced):
        raise ValueError(f"draft vocab size {n} must lie in [{len(forced)}, {vocab_size}]")
    counts[forced] = np.iinfo(np.int64).max  # kept whatever their counts
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id asc
    return np.sort(order[:n]).astype(np.int32)


@flax.struct.dataclass
class DraftVocab:
    """ids [Vd] (sorted full-vocab ids) and head [D, Vd]: the target's LM-head columns for them (gathered once)."""

    ids: Int[Array, " Vd"]
    head: Float[Array, "D Vd"]
    vocab_size: int = flax.struct.field(pytree_node=False)

    @classmethod
    def build(cls, ids, embed: Float[Array, "V D"], lm_head: Float[Array, "D V"] | None) -> DraftVocab:
        """`lm_head` None means tied embeddings (the head is `embed.T`)."""
        ids = jnp.asarray(ids, jnp.int32)
        head = jnp.take(embed, ids, axis=0).T if lm_head is None else jnp.take(lm_head, ids, axis=1)
        return cls(ids=ids, head=head, vocab_size=int(embed.shape[0]))

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def to_full(self, logits: Float[Array, "... Vd"]) -> Float[Array, "... V"]:
        """Subset logits -> full-vocab logits, -inf outside the subset."""
        full = jnp.full((*logits.shape[:-1], self.vocab_size), -jnp.inf, logits.dtype)
        return full.at[..., self.ids].set(logits)

    def log_probs_full(self, logits: Float[Array, "... Vd"]) -> Float[Array, "... V"]:
        """The draft's log-probabilities over the FULL vocabulary (normalised over the subset, -inf outside)."""
        return self.to_full(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
