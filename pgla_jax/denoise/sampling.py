"""Adaptive denoising of a protected gradient with a trained ε-model: the paper's reverse process, done right.

Given g' = g + noise of per-entry std σ: n = 1/(1 + σ²), x_{t*} = √n·g' (a sample of q(x_{t*} | g)), then the
reverse process from t* down to 0. One jitted program per (model, method, shape): t* is a traced integer, so the
`lax.fori_loop` has a dynamic trip count and every ε reuses the same compilation.

Methods:
* ``ddpm``: ancestral sampling, x_{s} ~ q(x_s | x_t, x̂_0) with the posterior variance, no noise on the last step.
  With `max_steps` < t* + 1 the chain is respaced onto `max_steps` evenly spaced steps (the same posterior formula
  between non-adjacent steps); at stride 1 it is the textbook DDPM step.
* ``ddim``: deterministic DDIM (η = 0) over the same steps.
* ``oneshot``: x̂_0 = (x_{t*} − √(1 − ᾱ)·ε̂)/√ᾱ from one model call.
* ``nonadaptive``: the paper's Non-Adaptive Mjölnir: ancestral sampling from a fixed step on the unscaled g'
  (σ is not used).
* ``conditional``: ancestral sampling whose model also sees the observation √n·g' as an input channel.
* ``released``: the released `p_sample_loop` bug (a): every step denoises the *original* input, so the result is
  one t = 0 step applied to √n·g'. Reproduced for comparison only (with the released b-for-Laplace σ if the caller
  passes it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from pgla_jax.config import SamplerKind
from pgla_jax.denoise import ddpm

METHODS: tuple[str, ...] = ("ddpm", "ddim", "oneshot", "nonadaptive", "conditional", "released")

# Inside the loops: eps_fn(x [B, ...], t [B] int32, cond [B, ...] | None) -> ε̂ [B, ...]. `denoise` takes a static
# `apply(params, x, t, cond)` and traced `params` instead, so the weights are arguments, never baked-in constants.


def _tables(s: ddpm.Schedule):
    # ᾱ with a leading 1 so that index i + 1 is step i and index 0 is "before the first step" (x_0 itself).
    return jnp.asarray(np.concatenate([[1.0], s.alphas_cumprod]), jnp.float32)


def reverse(eps_fn, x: Float[Array, "B ..."], t_index: Array, key: PRNGKeyArray, *, schedule: ddpm.Schedule,
            method: str = "ddpm", max_steps: int = 1000, cond=None, released: bool = False) -> Float[Array, "B ..."]:
    """Runs the reverse process from step index `t_index` (traced int) down to 0 on x = x_{t*}.

    `method` is "ddpm" (ancestral) or "ddim"; `released=True` is the released loop (every step on the input).
    """
    ac = _tables(schedule)
    b = x.shape[0]
    count = jnp.minimum(t_index + 1, max_steps)  # model calls
    denom = jnp.maximum(count - 1, 1)

    def step_at(k):  # the k-th visited step index: t*, ..., 0 evenly spaced (stride 1 when count = t* + 1)
        return (t_index * (count - 1 - k)) // denom

    x_in = x

    def body(k, x):
        t = step_at(k)
        s = jnp.where(k + 1 < count, step_at(k + 1), -1)  # the next step, -1: x_0
        src = x_in if released else x
        eps = eps_fn(src, jnp.full((b,), t, jnp.int32), cond)
        a_t, a_s = ac[t + 1], ac[s + 1]
        if method == "ddim" and not released:
            x0 = (src - jnp.sqrt(1.0 - a_t) * eps) / jnp.sqrt(a_t)
            return jnp.sqrt(a_s) * x0 + jnp.sqrt(1.0 - a_s) * eps
        alpha = a_t / a_s  # 1 − β of the (possibly respaced) step t → s
        mean = (src - (1.0 - alpha) / jnp.sqrt(1.0 - a_t) * eps) / jnp.sqrt(alpha)
        var = (1.0 - alpha) * (1.0 - a_s) / (1.0 - a_t)  # posterior variance β̃; 0 on the last step (a_s = 1)
        z = jax.random.normal(jax.random.fold_in(key, k), x.shape)
        return mean + jnp.sqrt(var) * z

    return jax.lax.fori_loop(0, count, body, x)


def oneshot(eps_fn, x, t_index, *, schedule: ddpm.Schedule, cond=None):
    b = x.shape[0]
    t = jnp.full((b,), t_index, jnp.int32)
    return ddpm.predict_x0(schedule, x, t, eps_fn(x, t, cond))


@functools.partial(jax.jit, static_argnames=("apply", "schedule", "method", "max_steps"))
def denoise(apply, params, y: Float[Array, "B ..."], sigma: Float[Array, ""], t_index: Array, key: PRNGKeyArray, *,
            schedule: ddpm.Schedule, method: SamplerKind = "ddpm", max_steps: int = 1000) -> Float[Array, "B ..."]:
    """The estimate of the clean encoded gradient from the noisy encoded gradient `y`.

    `sigma`: the per-entry noise std (σ_eff), `t_index`: the 0-based start step (`ddpm.t_index(σ)`, or the fixed
    step for ``nonadaptive``). Both are traced, so one compilation serves every ε.
    """
    eps_fn = functools.partial(apply, params)
    n = ddpm.signal_fraction(sigma)
    x = jnp.sqrt(n) * y
    if method == "oneshot":
        return oneshot(eps_fn, x, t_index, schedule=schedule)
    if method == "nonadaptive":
        return reverse(eps_fn, y, t_index, key, schedule=schedule, max_steps=max_steps)
    if method == "conditional":
        return reverse(eps_fn, x, t_index, key, schedule=schedule, max_steps=max_steps, cond=x)
    if method == "released":
        return reverse(eps_fn, x, t_index, key, schedule=schedule, max_steps=max_steps, released=True)
    return reverse(eps_fn, x, t_index, key, schedule=schedule, method=method, max_steps=max_steps)
