"""Multimodal prompts in the decoding loops, and draft-side visual-token pruning.

A vision-language prompt reaches the loops as `Media`: the target's input embeddings (visual features spliced in
at the placeholders), its positions (Qwen2.5-VL's [B, T, 3] M-RoPE or plain [B, T]) and the position delta that
continues them after the prompt (slot s past the prompt sits at position s - pad + delta).

The target sees every visual token; the draft sees a pruned set (SpecVLM, SAGE's setting: 80% of image tokens
and 90% of video tokens dropped), ranked by

* "uniform": evenly spaced over each kind's tokens of a row, or
* "attention": the target's prefill attention from the prompt's last text tokens to the visual tokens, averaged
  over layers and heads (SpecVLM's stage I signal).

How many tokens of each kind a row keeps is decided on the host (`keep_counts`), so the draft's compacted prompt
has a static length (`SpecConfig.draft_prompt_len`, bucketed) and only which tokens survive is computed here.
The kept tokens keep their positions: the draft's slots are shorter but every position is the target's, and its
own position delta (`delta + pruned tokens`) lines its decode steps up with the target's.
"""

from __future__ import annotations

import math
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from sage_jax.models.serving_lm import Probe

TEXT, IMAGE, VIDEO = 0, 1, 2
METHODS = ("uniform", "attention")
Method = Literal["uniform", "attention"]
DEFAULT_RATIOS = (0.8, 0.9)  # (image, video): the paper's, following SpecVLM
PROBE_QUERIES = 32  # the prompt's last slots whose attention ranks the visual tokens (text after the last visual one)


@flax.struct.dataclass
class Media:
    """The multimodal part of a left-padded prompt batch (every array over the prompt's T slots).

    Attributes:
      embeddings: [B, T, D] the target's input embeddings.  positions: [B, T] or [B, T, 3].
      delta: [B] position delta after the prompt.  kind: [B, T] TEXT / IMAGE / VIDEO per slot (padding: TEXT).
      keep: [B, 2] image and video tokens the draft keeps per row (`keep_counts`).
      draft_embeddings: [B, T, Dd] a separate draft VLM's own input embeddings, or None (the draft reads the
        target's: a self-draft or an EAGLE-style head).
    """

    embeddings: Float[Array, "B T D"]
    positions: Int[Array, "B T"] | Int[Array, "B T 3"]
    delta: Int[Array, " B"]
    kind: Int[Array, "B T"]
    keep: Int[Array, "B 2"]
    draft_embeddings: Float[Array, "B T Dd"] | None = None


def keep_counts(n_image: int, n_video: int, ratios: tuple[float, float]) -> tuple[int, int]:
    """Visual tokens of each kind the draft keeps at pruning ratios (image, video): at least one of a kind that
    is present unless its ratio is 1 (a text-only draft)."""
    def keep(n, r):
        if not 0.0 <= r <= 1.0:
            raise ValueError(f"a pruning ratio must lie in [0, 1], got {r}")
        return 0 if r >= 1.0 else n - min(n - 1, math.floor(r * n + 1e-9)) if n else 0
    return keep(n_image, ratios[0]), keep(n_video, ratios[1])


def probe_rows(kind: Int[Array, "B T"], pad: Int[Array, " B"], n_queries: int = PROBE_QUERIES) -> Probe:
    """The probe of `LM.forward`: the prompt's last `n_queries` slots, weighted equally over those past the row's
    last visual token (its question); a row that ends on a visual token uses its last slot alone."""
    b, t = kind.shape
    q = min(n_queries, t)
    rows = jnp.broadcast_to(jnp.arange(t - q, t, dtype=jnp.int32), (b, q))
    slot = jnp.arange(t, dtype=jnp.int32)[None]
    last_visual = jnp.max(jnp.where(kind != TEXT, slot, -1), axis=1)
    on = (rows > last_visual[:, None]) & (rows >= pad[:, None])
    on = on | (~jnp.any(on, 1, keepdims=True) & (rows == t - 1))
    return Probe(rows=rows, weight=on / jnp.sum(on, 1, keepdims=True))


def keep_mask(method: Method, kind: Int[Array, "B T"], pad: Int[Array, " B"], keep: Int[Array, "B 2"],
              score: Float[Array, "B T"] | None = None) -> Bool[Array, "B T"]:
    """Which prompt slots the draft sees: every text slot past the padding, and `keep[b, k-1]` tokens of each
    visual kind k (uniformly spaced, or those of highest `score`)."""
    t = kind.shape[1]
    slot = jnp.arange(t, dtype=jnp.int32)[None]
    out = (kind == TEXT) & (slot >= pad[:, None])
    for k in (IMAGE, VIDEO):
        of_kind = kind == k
        n = jnp.sum(of_kind, 1, keepdims=True)
        m = keep[:, k - 1: k]
        if method == "uniform":
            i = jnp.cumsum(of_kind, 1) - 1  # index among the row's tokens of this kind
            pick = (i + 1) * m // jnp.maximum(n, 1) > i * m // jnp.maximum(n, 1)
        elif method == "attention":
            s = jnp.where(of_kind, score, -jnp.inf)
            order = jnp.argsort(-s, axis=1, stable=True)  # ties: the earlier slot first
            rank = jnp.argsort(order, axis=1)
            pick = rank < m
        else:
            raise ValueError(f"unknown pruning method {method!r}; expected one of {METHODS}")
        out = out | (of_kind & pick)
    return out


def compact_index(keep: Bool[Array, "B T"], width: int) -> tuple[Int[Array, "B Td"], Int[Array, " B"]]:
    """Where the draft's compacted prompt reads from: index [B, Td] into the T prompt slots (the kept slots in
    order, left-padded to `width`; padding reads slot 0) and the draft's left padding [B]."""
    b, t = keep.shape
    n = jnp.sum(keep, 1).astype(jnp.int32)
    pad_d = width - n
    dest = jnp.where(keep, pad_d[:, None] + jnp.cumsum(keep, 1) - 1, width)  # width = dropped
    src = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    idx = jax.vmap(lambda d, s: jnp.zeros((width,), jnp.int32).at[d].set(s, mode="drop"))(dest, src)
    return idx, pad_d


def gather(x: Array, idx: Int[Array, "B Td"]) -> Array:
    """`x` [B, T, ...] at the compacted slots."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def kinds_of(ids: np.ndarray, image_token_id: int, video_token_id: int) -> np.ndarray:
    """TEXT / IMAGE / VIDEO per token id (host side)."""
    return np.where(ids == image_token_id, IMAGE, np.where(ids == video_token_id, VIDEO, TEXT)).astype(np.int32)
