"""Drafters: what proposes tokens, behind one small interface (prefill, then score tokens while updating its own
KV cache).

Every drafter also takes and returns *features* (width X): an EAGLE-style head reads the target's feature of the
previous token and predicts the next one (X = D); LM drafts carry features of width 0 (free). What the target
provides are its last hidden states, or for an EAGLE-3-style head the inputs of the layers it `taps` ([.., Z]);
`read` turns them into the drafter's X-wide features (its `fuse` projection). Kinds: a separate
smaller LM with the target's tokenizer (the paper's setting), a training-free self-draft (the target's first
`n_layers` layers + its final norm and head), and an EAGLE-style head (`models/eagle_head.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Protocol

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from sage_jax.models import eagle_head
from sage_jax.models.eagle_head import EagleWeights
from sage_jax.models.kv_cache import KVCache
from sage_jax.models.serving_lm import LM
from sage_jax.models.visibility import Visibility


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


class Drafter(Protocol):
    """What the decoding loops call; built inside the traced function from serving-form models (`build_drafter`).

    Attributes: feature_dim, the width X of the features it reads and predicts; taps, the target layers whose
    inputs it reads (`LM.forward(taps=...)`; () = the target's last hidden state).
    """

    feature_dim: int
    taps: tuple[int, ...]

    def read(self, target_features: Float[Array, "B T Z"]) -> Float[Array, "B T X"]:
        """The target's features (last hidden states, or the tapped layer inputs) -> the drafter's width X."""

    def init_cache(self, batch: int, capacity: int) -> KVCache: ...

    def prefill(self, tokens: Int[Array, "B T"], positions: Int[Array, "B T"] | Int[Array, "B T 3"],
                mask: Bool[Array, "B T S"], target_hidden: Float[Array, "B T D"], cache: KVCache, *,
                embeddings: Float[Array, "B T D"] | None = None) -> KVCache:
        """Writes the prompt into the draft cache at slots [0, T) (`target_hidden`: the target's features of it, as
        `read` takes them;
        `embeddings`: the input embeddings of a multimodal prompt, read instead of the tokens')."""

    def __call__(self, tokens: Int[Array, "B T"], features: Float[Array, "B T X"], positions: Int[Array, "B T"],
                 mask: Bool[Array, "B T S"] | Visibility, cache: KVCache, write_pos: Int[Array, " B"]
                 ) -> tuple[Float[Array, "B T V"], Float[Array, "B T X"], KVCache]:
        """Draft log-probabilities over the full vocabulary at every position, the features it predicts (the input
        `features` are those of each token's predecessor), and the cache with the tokens written at
        `write_pos[b] + [0, T)`; `mask` as `LM.forward` takes it."""


def build_drafter(spec: DraftSpec, target: LM, draft: LM | EagleWeights | None) -> Drafter:
    """The drafter of `spec` over the serving-form `target` and `draft`; ValueError when they do not fit."""
    if spec.kind == "eagle":
        if not isinstance(draft, EagleWeights):
            raise ValueError("draft kind 'eagle' needs EagleWeights")
        return EagleDrafter(draft, target)
    if spec.kind == "self":
        if spec.n_layers > target.n_layers:
            raise ValueError(f"self-draft with {spec.n_layers} layers > target's {target.n_layers}")
        return LMDrafter(target.truncated(spec.n_layers))
    if not isinstance(draft, LM):
        raise ValueError("draft kind 'model' needs a draft LM")
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"draft vocab {draft.cfg.vocab_size} != target vocab {target.cfg.vocab_size}")
    return LMDrafter(draft)


@dataclasses.dataclass(frozen=True)
class LMDrafter:
    """A separate LM, or the target's first layers: reads no features (X = 0)."""

    model: LM
    feature_dim = 0
    taps = ()

    def read(self, target_features):
        return target_features[..., :0]

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        return self.model.init_cache(batch, capacity)

    def prefill(self, tokens, positions, mask, target_hidden, cache, *, embeddings=None) -> KVCache:
        del target_hidden
        if embeddings is not None:
            embeddings = embeddings.astype(jnp.dtype(self.model.cfg.dtype))
        _, cache = self.model.forward(tokens, positions, mask, cache, jnp.zeros(tokens.shape[:1], jnp.int32),
                                      embeddings=embeddings)
        return cache

    def __call__(self, tokens, features, positions, mask, cache, write_pos):
        hidden, cache = self.model.forward(tokens, positions, mask, cache, write_pos)
        return jax.nn.log_softmax(self.model.head(hidden), axis=-1), features, cache


@dataclasses.dataclass(frozen=True)
class EagleDrafter:
    """An EAGLE-style head that reads the target's features (and the target's embedding, norm and LM head)."""

    weights: EagleWeights
    target: LM

    @property
    def feature_dim(self) -> int:
        return self.target.cfg.d_model

    @property
    def taps(self) -> tuple[int, ...]:
        return self.weights.taps

    def read(self, target_features):
        return eagle_head.fuse_features(self.weights.head, target_features)

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        return eagle_head.init_cache(self.weights.cfg, batch, capacity)

    def prefill(self, tokens, positions, mask, target_hidden, cache, *, embeddings=None) -> KVCache:
        """Prompt pairs (f_{t-1}, x_t) at slots [0, T); the first slot has no predecessor (zero feature). A head
        without M-RoPE reads a multimodal prompt's temporal positions (those of its text tokens are all equal)."""
        w, t = self.weights, self.target
        if positions.ndim == 3 and not w.cfg.rope.mrope_section:
            positions = positions[..., 0]
        feats = eagle_head.shift_features(self.read(target_hidden))
        _, cache = eagle_head.eagle_features(w.head, w.cfg, t.embed, tokens, feats,
                                             positions, mask, cache, jnp.zeros(tokens.shape[:1], jnp.int32),
                                             embeddings=embeddings)
        return cache

    def __call__(self, tokens, features, positions, mask, cache, write_pos):
        w, t = self.weights, self.target
        logits, feats, cache = eagle_head.eagle_forward(w.head, w.cfg, t.embed, t.final_norm, t.lm_head, tokens,
                                                        features, positions, mask, cache, write_pos, vocab=w.vocab)
        logq = w.vocab.log_probs_full(logits) if w.vocab is not None else jax.nn.log_softmax(logits, axis=-1)
        return logq, feats, cache
