"""Draft sources behind one small interface: prefill, then score tokens while updating its own KV cache.

Every draft also takes and returns *features*: an EAGLE-style head reads the target's feature of the previous
token and predicts the next one; LM drafts carry features of width 0 (free). Kinds in this module: a separate
smaller LM with the target's tokenizer (the paper's setting) and a training-free self-draft (the target's first
`n_layers` layers + its final norm and head).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from sage_jax.draft import eagle
from sage_jax.draft.vocab import DraftVocab
from sage_jax.models.config import LMConfig
from sage_jax.models.kv_cache import KVCache
from sage_jax.models.lm import LM, serving_layer


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftSpec:
    """Static description of the draft.

    Attributes:
      kind: "model" (a separate LM, passed alongside the target), "self" (the target truncated) or "eagle" (an
        EAGLE-style head, passed as `EagleWeights`).
      n_layers: for "self", how many of the target's layers the draft runs.
    """

    kind: Literal["model", "self", "eagle"] = "model"
    n_layers: int | None = None

    def __post_init__(self):
        if self.kind not in ("model", "self", "eagle"):
            raise ValueError(f"unknown draft kind {self.kind!r}")
        if self.kind == "self" and (self.n_layers is None or self.n_layers < 1):
            raise ValueError("a self-draft needs n_layers >= 1")


@flax.struct.dataclass
class EagleWeights:
    """An EAGLE-style head as a pytree: its params, an optional reduced vocabulary, its layer config (static)."""

    head: dict
    vocab: DraftVocab | None
    cfg: LMConfig = flax.struct.field(pytree_node=False)

    @classmethod
    def load(cls, path: str, target: LM) -> EagleWeights:
        """From a checkpoint written by `sage_jax.draft.eagle.save_head`, for the serving-form `target`."""
        cfg, params, vocab_ids, _ = eagle.load_head(path, dtype=target.cfg.dtype)
        if cfg.d_model != target.cfg.d_model or cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(f"{path}: head for d_model={cfg.d_model}, vocab={cfg.vocab_size}; the target has "
                             f"d_model={target.cfg.d_model}, vocab={target.cfg.vocab_size}")
        vocab = None if vocab_ids is None else DraftVocab.build(vocab_ids, target.embed, target.lm_head)
        params = {**params, "layer": serving_layer(params["layer"])}  # once, not per draft level
        return cls(head=params, vocab=vocab, cfg=cfg)


def build_drafter(spec: DraftSpec, target: LM, draft: LM | EagleWeights | None):
    """The drafter the decoding loop runs (built inside the traced function)."""
    if spec.kind == "eagle":
        if not isinstance(draft, EagleWeights):
            raise ValueError("draft kind 'eagle' needs EagleWeights")
        return EagleDrafter(draft, target)
    return Drafter.build(spec, target, draft)


@dataclasses.dataclass(frozen=True)
class EagleDrafter:
    """An EAGLE-style head that reads the target's features (and the target's embedding, norm and LM head)."""

    weights: EagleWeights
    target: LM

    @property
    def feature_dim(self) -> int:
        return self.target.cfg.d_model

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        return eagle.init_cache(self.weights.cfg, batch, capacity)

    def prefill(self, tokens, positions, mask, target_hidden, cache) -> KVCache:
        """Prompt pairs (f_{t-1}, x_t) at slots [0, P); the first slot has no predecessor (zero feature)."""
        w, t = self.weights, self.target
        _, cache = eagle.eagle_features(w.head, w.cfg, t.embed, tokens, eagle.shift_features(target_hidden),
                                        positions, mask, cache, jnp.zeros(tokens.shape[:1], jnp.int32))
        return cache

    def __call__(self, tokens, features, positions, mask, cache, write_pos):
        w, t = self.weights, self.target
        logits, feats, cache = eagle.eagle_forward(w.head, w.cfg, t.embed, t.final_norm, t.lm_head, tokens,
                                                   features, positions, mask, cache, write_pos, vocab=w.vocab)
        logq = w.vocab.log_probs_full(logits) if w.vocab is not None else jax.nn.log_softmax(logits, axis=-1)
        return logq, feats, cache


@dataclasses.dataclass(frozen=True)
class Drafter:
    """An LM draft as seen by the decoding loop (built inside the traced function from serving-form models)."""

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
