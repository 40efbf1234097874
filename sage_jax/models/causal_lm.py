"""A loaded language model as users call it: `model(**tokenizer_outputs) -> logits`, as with transformers.

`sage_jax.load(path)` returns one. It holds the NNX `Decoder` (canonical parameters, the checkpoint layout), its
tokenizer, and the serving form the decoding loops run (built once, on first use); `Engine` accepts it as a
target or a draft.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from sage_jax.models.config import LMConfig
from sage_jax.models.decoder import Decoder
from sage_jax.models.serving_lm import LM

# Keyword arrays of a vision-language processor: a text-only model refuses them instead of ignoring the image.
_VISION_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "image_sizes")


@jax.jit
def _logits(lm: LM, tokens: Int[Array, "B T"], positions: Int[Array, "B T"], valid: Array) -> Float[Array, "B T V"]:
    t = tokens.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))[None]
    # A query sees the earlier tokens the attention mask keeps, and always itself (so a padding query is finite).
    mask = (causal & valid[:, None, :]) | jnp.eye(t, dtype=bool)[None]
    hidden, _ = lm.forward(tokens, positions, mask)
    return lm.head(hidden).astype(jnp.float32)


def token_batch(input_ids, attention_mask, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A tokenizer's `input_ids` / `attention_mask` ([B, T] or [T], numpy or jax) -> (ids [B, T], kept bool
    [B, T]), checked with one-line ValueErrors (every model's `__call__` takes its ids through here)."""
    tokens = np.asarray(input_ids)
    tokens = tokens[None] if tokens.ndim == 1 else tokens
    if tokens.ndim != 2 or tokens.shape[1] == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"input_ids must be integer ids of shape [B, T] with T >= 1, got {list(tokens.shape)} "
                         f"{tokens.dtype}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"input_ids must lie in [0, {vocab_size}), got {tokens.min()}..{tokens.max()}")
    valid = np.ones(tokens.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    valid = valid[None] if valid.ndim == 1 else valid
    if valid.shape != tokens.shape:
        raise ValueError(f"attention_mask has shape {list(valid.shape)}, input_ids {list(tokens.shape)}")
    return tokens, valid


class CausalLM:
    """A decoder LM with its tokenizer.

    Attributes:
      config: the `LMConfig`.  module: the NNX `Decoder` (canonical parameters).  tokenizer: a transformers fast
      tokenizer, or None for a checkpoint without one.  source: where it was loaded from.
    """

    def __init__(self, module: Decoder, tokenizer=None, source: str | None = None):
        self.module = module
        self.tokenizer = tokenizer
        self.source = source
        self._serving: LM | None = None

    @property
    def config(self) -> LMConfig:
        return self.module.cfg

    def serving(self) -> LM:
        """The serving form (per-layer fused weights), built once."""
        if self._serving is None:
            self._serving = self.module.serving()
        return self._serving

    def __call__(self, input_ids, attention_mask=None, position_ids=None, **kw: Any) -> Float[Array, "B T V"]:
        """Float32 logits [B, T, V] of every position.

        `input_ids` [B, T] (or [T]) and `attention_mask` [B, T] (1 = token, 0 = padding, left or right), numpy or
        jax, as a tokenizer returns them. Positions count the kept tokens only (as transformers' `generate` does),
        so a padded row gets the logits of the same row unpadded; logits at padding positions are unspecified.
        """
        for name in _VISION_KEYS:
            if kw.pop(name, None) is not None:
                raise ValueError(f"{name} given, but {self.source or 'this model'} is a text-only language model")
        kw.pop("token_type_ids", None)  # some tokenizers return it; a decoder LM has no segments
        if kw:
            raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(kw))}")
        tokens, valid = token_batch(input_ids, attention_mask, self.config.vocab_size)
        if position_ids is None:
            positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
        else:
            positions = np.broadcast_to(np.asarray(position_ids), tokens.shape)
        return _logits(self.serving(), jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
                       jnp.asarray(valid))

    def __repr__(self) -> str:
        c = self.config
        return (f"CausalLM({self.source or 'in memory'}: {c.n_layers} layers, d_model {c.d_model}, "
                f"vocab {c.vocab_size}, {c.param_dtype})")
