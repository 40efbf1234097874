"""Prefill and the autoregressive baseline: one `jax.jit` around `lax.while_loop`, batch >= 1, left padding.

Layout of a row: prompt tokens left-padded into T slots (slot s holds position s - pad), then generated
tokens. `length[b]` is the number of cache slots committed so far (including padding).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from sage_jax.decoding import sampling
from sage_jax.decoding.tree import causal_visibility
from sage_jax.models.kv_cache import KVCache
from sage_jax.models.serving_lm import LM, Probe
from sage_jax.models.visibility import Visibility

if TYPE_CHECKING:
    from sage_jax.decoding.visual_pruning import Media


@dataclasses.dataclass(frozen=True, kw_only=True)
class ARConfig:
    """Static shape and sampling config of a run (hashable: a `jax.jit` static argument).

    Attributes: prompt_len (the prompt bucket T), max_new_tokens (output buffer), sampling, eos_ids, pad_id.
    """

    prompt_len: int
    max_new_tokens: int
    sampling: sampling.SamplingConfig = sampling.SamplingConfig()
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0

    @property
    def capacity(self) -> int:
        return self.prompt_len + self.max_new_tokens + 1


def prompt_layout(tokens: Int[Array, "B T"], pad: Int[Array, " B"], capacity: int
                  ) -> tuple[Int[Array, "B T"], Bool[Array, "B T S"]]:
    """Positions and causal mask of a left-padded prompt written at slots [0, T)."""
    b, p = tokens.shape
    slots = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    return jnp.maximum(slots - pad[:, None], 0), causal_visibility(slots, pad, capacity)


def prefill(model: LM, tokens: Int[Array, "B T"], pad: Int[Array, " B"], cache: KVCache, media: Media | None = None,
            probe: Probe | None = None, *, taps: tuple[int, ...] = ()):
    """Runs a left-padded prompt through the model into slots [0, T); returns every slot's hidden state and the
    cache (and with a `probe`, the probe's attention to every slot; with `taps`, the tapped layer inputs last:
    `LM.forward`). With `media`, the model reads its embeddings and positions instead of the tokens'."""
    positions, mask = prompt_layout(tokens, pad, cache.capacity)
    zeros = jnp.zeros(tokens.shape[:1], jnp.int32)
    if model.cfg.matmul == "exact":  # the same visibility, as the exact mode's fixed-order kernel reads it
        u = jnp.arange(tokens.shape[1])
        mask = Visibility(pad=pad, start=zeros, window=(u[None, None, :] <= u[None, :, None])
                          & (u[None, None, :] >= pad[:, None, None]))
    if media is None:
        return model.forward(tokens, positions, mask, cache, zeros, probe=probe, taps=taps)
    return model.forward(None, media.positions, mask, cache, zeros, embeddings=media.embeddings.astype(
        jnp.dtype(model.cfg.dtype)), probe=probe, taps=taps)


def is_eos(tokens: Int[Array, "..."], eos_ids: tuple[int, ...]) -> Bool[Array, "..."]:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


@flax.struct.dataclass
class ARState:
    """Autoregressive loop state.

    Attributes:
      out: [B, max_new] generated tokens (pad after the end).  n_gen: [B] tokens generated.  done: [B].
      last: [B] the newest token (not yet in the cache).  length: [B] committed cache slots.  pad: [B].
      cache: the target's KV cache.  key: PRNG key.  steps: decode forwards so far.  max_new: [B] per-row limit.
      delta: [B] position delta: slot s past the prompt sits at position s - pad + delta (0 for text; a VLM's
        multimodal positions shift it).
    """

    out: Int[Array, "B out"]
    n_gen: Int[Array, " B"]
    done: Bool[Array, " B"]
    last: Int[Array, " B"]
    length: Int[Array, " B"]
    pad: Int[Array, " B"]
    cache: KVCache
    key: jax.Array
    steps: Int[Array, ""]
    max_new: Int[Array, " B"]
    delta: Int[Array, " B"]


def ar_prefill(cfg: ARConfig, model: LM, tokens, pad, temperature, max_new, key, media: Media | None = None
               ) -> ARState:
    b = tokens.shape[0]
    cache = model.init_cache(b, cfg.capacity)
    hidden, cache = prefill(model, tokens, pad, cache, media)
    key, sub = jax.random.split(key)
    first = sampling.sample(sub, model.head(hidden[:, -1:])[:, 0], temperature, cfg.sampling)
    out = jnp.full((b, cfg.max_new_tokens), cfg.pad_id, jnp.int32).at[:, 0].set(first)
    done = is_eos(first, cfg.eos_ids) | (max_new <= 1)
    return ARState(out=out, n_gen=jnp.ones((b,), jnp.int32), done=done, last=first,
                   length=jnp.full((b,), tokens.shape[1], jnp.int32), pad=pad, cache=cache, key=key,
                   steps=jnp.int32(0), max_new=max_new,
                   delta=jnp.zeros((b,), jnp.int32) if media is None else media.delta.astype(jnp.int32))


def ar_decode(cfg: ARConfig, model: LM, state: ARState, temperature: Float[Array, " B"]) -> ARState:
    """Generates until every row hit EOS or its `max_new` tokens."""

    def cond(s: ARState):
        return (s.steps < cfg.max_new_tokens - 1) & ~jnp.all(s.done)

    def body(s: ARState):
        mask = Visibility.chain(s.length, s.pad, 1)
        hidden, cache = model.forward(s.last[:, None], (s.length - s.pad + s.delta)[:, None], mask, s.cache, s.length)
        key, sub = jax.random.split(s.key)
        tok = sampling.sample(sub, model.head(hidden)[:, 0], temperature, cfg.sampling)
        active = ~s.done
        tok = jnp.where(active, tok, cfg.pad_id)
        out = jax.vmap(lambda o, t, i, a: jnp.where(a, o.at[i].set(t, mode="drop"), o))(s.out, tok, s.n_gen, active)
        n_gen = s.n_gen + active
        done = s.done | (active & is_eos(tok, cfg.eos_ids)) | (n_gen >= s.max_new)
        return s.replace(out=out, n_gen=n_gen, done=done, last=jnp.where(active, tok, s.last),
                         length=s.length + active, cache=cache, key=key, steps=s.steps + 1)

    return jax.lax.while_loop(cond, body, state)
