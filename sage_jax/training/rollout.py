"""The target's greedy answers WITH its features, in one pass: the self-distillation data of the draft recipe.

`data.generate` + `data.compute_features` cost two target passes per token (a decode loop, then a teacher-forced
forward). Here the decode loop keeps the hidden state of every token it feeds, so the features come for free:
prefill gives the prompt's features, decode step i gives the feature of answer token a_i (fed at step i) and the
next token a_{i+1} = argmax. A row's answer stops at its first EOS (kept) or at `max_new_tokens`.

The features differ from a teacher-forced forward only by float reassociation (decode runs T=1 matmuls), well
below what the draft can learn; `tests/sage_jax/draft` checks the tokens against `Engine`'s AR decoding.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from sage_jax.decoding.tree import causal_visibility
from sage_jax.models.serving_lm import LM


@functools.partial(jax.jit, static_argnames=("max_new",))
def _rollout(model: LM, tokens: Int[Array, "B T"], pad: Int[Array, " B"], max_new: int
             ) -> tuple[Int[Array, "B out"], Float[Array, "B T D"], Float[Array, "B out D"]]:
    """Greedy continuation of left-padded prompts: (answer tokens [B, out], prompt features, answer features)."""
    b, p = tokens.shape
    cap = p + max_new
    cache = model.init_cache(b, cap)
    slots = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    positions = jnp.maximum(slots - pad[:, None], 0)
    hidden, cache = model.forward(tokens, positions, causal_visibility(slots, pad, cap), cache,
                                  jnp.zeros((b,), jnp.int32))
    first = jnp.argmax(model.head(hidden[:, -1:]), -1)[:, 0].astype(jnp.int32)

    def step(carry, i):
        cache, tok = carry
        slot = jnp.full((b, 1), p + i, jnp.int32)
        h, cache = model.forward(tok[:, None], slot - pad[:, None], causal_visibility(slot, pad, cap), cache,
                                 slot[:, 0])
        nxt = jnp.argmax(model.head(h), -1)[:, 0].astype(jnp.int32)
        return (cache, nxt), (tok, h[:, 0])

    _, (toks, feats) = jax.lax.scan(step, (cache, first), jnp.arange(max_new, dtype=jnp.int32))
    return toks.T, hidden, jnp.swapaxes(feats, 0, 1)


def rollout(model: LM, prompts: Sequence[Sequence[int]], *, batch: int, max_new_tokens: int, prompt_len: int,
            eos_ids: Sequence[int], pad_id: int, progress: Callable[[int, float], None] | None = None
            ) -> dict[str, np.ndarray]:
    """Dataset arrays (`data.py` layout, features included) of the target's greedy answers to `prompts`.

    Every prompt must fit `prompt_len` tokens. One compiled shape: batches are padded to `batch` rows."""
    if any(len(q) > prompt_len or not q for q in prompts):
        raise ValueError(f"every prompt needs 1..{prompt_len} tokens")
    eos = np.asarray(list(eos_ids), np.int32)
    n, length = len(prompts), prompt_len + max_new_tokens
    d = model.cfg.d_model
    out = {"tokens": np.full((n, length), pad_id, np.int32), "lengths": np.zeros((n,), np.int32),
           "answer_start": np.zeros((n,), np.int32), "features": np.zeros((n, length, d), np.float32)}
    t0 = time.perf_counter()
    for s in range(0, n, batch):
        chunk = [list(q) for q in prompts[s: s + batch]]
        chunk += [chunk[-1]] * (batch - len(chunk))
        pad = np.asarray([prompt_len - len(q) for q in chunk], np.int32)
        toks = np.full((batch, prompt_len), pad_id, np.int32)
        for j, q in enumerate(chunk):
            toks[j, pad[j]:] = q
        ans, f_p, f_a = jax.device_get(_rollout(model, jnp.asarray(toks), jnp.asarray(pad), max_new_tokens))
        for j in range(min(batch, n - s)):
            m = max_new_tokens
            hits = np.flatnonzero(np.isin(ans[j], eos))
            if hits.size:
                m = int(hits[0]) + 1
            q = len(chunk[j])
            row = s + j
            out["tokens"][row, :q] = chunk[j]
            out["tokens"][row, q: q + m] = ans[j, :m]
            out["features"][row, :q] = f_p[j, pad[j]:]
            out["features"][row, q: q + m] = f_a[j, :m]
            out["lengths"][row] = q + m
            out["answer_start"][row] = q
        if progress is not None:
            progress(min(s + batch, n), time.perf_counter() - t0)
    return out
