"""Draft sources behind one small interface: prefill, then score tokens while updating its own KV cache.

Every draft also takes and returns *features*: an EAGLE-style head reads the target's feature of the previous
token and predicts the next one; LM drafts carry features of width 0 (free). Kinds in this module: a separate
smaller LM with the target's tokenizer (the paper's setting) and a training-free self-draft (the target's first
`n_layers` layers + its final norm and head).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from sage_jax.models.kv_cache import KVCache
from sage_jax.models.lm import LM


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftSpec:
    """Static description of the draft.

    Attributes:
      kind: "model" (a separate LM, passed alongside the target) or "self" (the target truncated).
      n_layers: for "self", how many of the target's layers the draft runs.
    """

    kind: Literal["model", "self"] = "model"
    n_layers: int | None = None

    def __post_init__(self):
        if self.kind not in ("model", "self"):
            raise ValueError(f"unknown draft kind {self.kind!r}")
        if self.kind == "self" and (self.n_layers is None or self.n_layers < 1):
            raise ValueError("a self-draft needs n_layers >= 1")


@dataclasses.dataclass(frozen=True)
class Drafter:
    """The draft as seen by the decoding loop (built inside the traced function from serving-form models)."""

    model: LM

    @classmethod
    def build(cls, spec: DraftSpec, target: LM, draft_model: LM | None) -> Drafter:
        if spec.kind == "self":
            if spec.n_layers > target.n_layers:
                raise ValueError(f"self-draft with {spec.n_layers} layers > target's {target.n_layers}")
            return cls(target.truncated(spec.n_layers))
        if draft_model is None:
            raise ValueError("draft kind 'model' needs a draft model")
        if draft_model.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(f"draft vocab {draft_model.cfg.vocab_size} != target vocab {target.cfg.vocab_size}")
        return cls(draft_model)

    feature_dim = 0  # an LM draft reads no target features

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        return self.model.init_cache(batch, capacity)

    def prefill(self, tokens: Int[Array, "B P"], positions: Int[Array, "B P"], mask: Bool[Array, "B P S"],
                target_hidden: Float[Array, "B P D"], cache: KVCache) -> KVCache:
        """Writes the prompt into the draft cache at slots [0, P) (`target_hidden`: for feature drafts)."""
        del target_hidden
        _, cache = self.model.forward(tokens, positions, mask, cache, jnp.zeros(tokens.shape[:1], jnp.int32))
        return cache

    def __call__(self, tokens: Int[Array, "B T"], features: Float[Array, "B T F"], positions: Int[Array, "B T"],
                 mask: Bool[Array, "B T S"], cache: KVCache, write_pos: Int[Array, " B"]
                 ) -> tuple[Float[Array, "B T V"], Float[Array, "B T F"], KVCache]:
        """Draft log-probabilities at every position, the features it predicts (width `feature_dim`; the input
        `features` are the ones of each token's predecessor), and the cache with the tokens written."""
        hidden, cache = self.model.forward(tokens, positions, mask, cache, write_pos)
        return jax.nn.log_softmax(self.model.head(hidden), axis=-1), features, cache
