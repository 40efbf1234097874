"""Token sampling primitives on logits: temperature, top-k, top-p. Pure functions, any leading shape."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """Static sampling knobs (they change shapes or code paths). Temperature is a per-row array instead.

    Attributes:
      top_k: keep the k most likely tokens (0 = all).
      top_p: keep the smallest set of tokens whose probability reaches top_p (1.0 = all).
    """

    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def _expand(t: Float[Array, " B"], ndim: int) -> Float[Array, "..."]:
    return t.reshape(t.shape + (1,) * (ndim - t.ndim))


def processed_logprobs(logits: Float[Array, "B ... V"], temperature: Float[Array, " B"],
                       cfg: SamplingConfig) -> Float[Array, "B ... V"]:
    """Log-probabilities of the distribution that sampling at `temperature` draws from (rows with T=0 get T=1;
    callers take the argmax of the raw logits for them)."""
    t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    x = logits.astype(jnp.float32) / _expand(t, logits.ndim)
    if cfg.top_k and cfg.top_k < x.shape[-1]:  # k ≥ the vocabulary keeps every token
        kth = jax.lax.top_k(x, cfg.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if cfg.top_p < 1.0:
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        probs = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
        drop_sorted = before >= cfg.top_p
        drop = jnp.zeros_like(drop_sorted).at[..., 0].set(False)
        drop = jnp.put_along_axis(drop, order, drop_sorted, axis=-1, inplace=False)
        x = jnp.where(drop, -jnp.inf, x)
    return jax.nn.log_softmax(x, axis=-1)


def sample(key: jax.Array, logits: Float[Array, "B ... V"], temperature: Float[Array, " B"],
           cfg: SamplingConfig) -> Int[Array, "B ..."]:
    """Greedy (argmax of the raw logits) where temperature == 0, else a draw from `processed_logprobs`."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawn = jax.random.categorical(key, processed_logprobs(logits, temperature, cfg), axis=-1).astype(jnp.int32)
    return jnp.where(_expand(temperature, greedy.ndim) > 0, drawn, greedy)
