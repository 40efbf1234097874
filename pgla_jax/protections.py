"""Gradient protections a client applies before sending: Gaussian / Laplace noise (paper or DP-SGD calibration),
per-example clipping, top-k pruning, quantisation.

Two calibrations of the noise scale, both exposed with the *effective* standard deviation of the added noise
(σ for Gaussian, √2·b for Laplace, whose scale parameter b is not its std):

* ``paper``: exactly the released Mjölnir code. Sensitivity 2·lr·C/m; scale √(2 ln(1.25/δ))/ε (Gaussian) or 1/ε
  (Laplace); noise M = sensitivity × scale added element-wise to the raw batch gradient. **No clipping is done**
  (C only enters the formula), and the sensitivity is that of the update lr·g although the noise is added to g,
  so this noise is ~1/lr times milder than DP-SGD's. Kept for fidelity, not as a privacy guarantee.
* ``dpsgd``: each per-example gradient is clipped to norm C (L2 for Gaussian, L1 for Laplace: the norm the
  mechanism's sensitivity is measured in), noise of scale z·C is added to their sum, and the sum is divided by the
  batch size B. z comes from (ε, δ) through `dp_accounting` (RDP for Gaussian, PLD for Laplace), composed over
  `steps` releases with Poisson sampling rate `sampling_rate`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from pgla_jax import fl
from pgla_jax.config import ProtectionConfig

Params = PyTree[Float[Array, "..."]]


@dataclasses.dataclass(frozen=True)
class NoisePlan:
    """The noise one release gets.

    Attributes:
      noise: "gaussian" or "laplace".
      scale: the distribution's own parameter on the *sent* gradient (σ, or Laplace b).
      std: the effective standard deviation of each added entry (σ, or √2·b).
      clip: per-example clipping norm, or None (paper calibration: no clipping).
      multiplier: z of DP-SGD (scale of the noise on the summed gradient in units of C); None for `paper`.
    """

    noise: str
    scale: float
    std: float
    clip: float | None
    multiplier: float | None = None


def paper_sensitivity(lr: float, clip: float, m: int) -> float:
    """The released code's `cal_sensitivity(lr, C, m) = 2·lr·C/m`."""
    return 2.0 * lr * clip / m


def paper_noise_scale(noise: str, epsilon: float, delta: float, clip: float, lr: float, m: int) -> float:
    """M of the released code: sensitivity × (√(2 ln(1.25/δ))/ε for Gaussian, 1/ε for Laplace)."""
    _check_eps(epsilon)
    if noise == "gaussian":
        scale = math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon
    elif noise == "laplace":
        scale = 1.0 / epsilon
    else:
        raise ValueError(f"unknown noise {noise!r}; expected 'gaussian' or 'laplace'")
    return paper_sensitivity(lr, clip, m) * scale


def effective_std(noise: str, scale: float) -> float:
    """Std of one noise entry: σ for Gaussian, √2·b for Laplace."""
    return scale * (math.sqrt(2.0) if noise == "laplace" else 1.0)


def _check_eps(epsilon: float) -> None:
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be a positive finite number, got {epsilon}")


@functools.lru_cache(maxsize=256)
def dpsgd_noise_multiplier(noise: str, epsilon: float, delta: float, steps: int = 1,
                           sampling_rate: float = 1.0) -> float:
    """z such that `steps` Poisson-sampled releases of the clipped sum + noise(z·C) are (ε, δ)-DP."""
    import dp_accounting
    from dp_accounting import pld, rdp

    _check_eps(epsilon)
    if noise == "gaussian":
        base, accountant = dp_accounting.GaussianDpEvent, rdp.RdpAccountant
    elif noise == "laplace":
        if steps == 1 and sampling_rate >= 1.0:
            # One Laplace release is pure ε-DP at b = Δ₁/ε (δ unused): exact, and PLD at large ε takes minutes.
            return 1.0 / epsilon
        base = dp_accounting.LaplaceDpEvent
        # RDP has no Laplace support; PLD is pessimistic under discretisation, so a coarse grid stays valid.
        accountant = functools.partial(pld.PLDAccountant, value_discretization_interval=1e-2)
    else:
        raise ValueError(f"unknown noise {noise!r}; expected 'gaussian' or 'laplace'")

    def event(z):
        e = base(z) if sampling_rate >= 1.0 else dp_accounting.PoissonSampledDpEvent(sampling_rate, base(z))
        return dp_accounting.SelfComposedDpEvent(e, steps)

    return float(dp_accounting.calibrate_dp_mechanism(accountant, event, epsilon, delta))


def plan(cfg: ProtectionConfig, epsilon: float, batch: int) -> NoisePlan:
    """The noise for one release of a `batch`-example gradient at privacy `epsilon`."""
    if cfg.calibration == "paper":
        m = paper_noise_scale(cfg.noise, epsilon, cfg.delta, cfg.clip, cfg.lr, cfg.dataset_size)
        return NoisePlan(cfg.noise, m, effective_std(cfg.noise, m), None)
    if cfg.calibration == "dpsgd":
        z = dpsgd_noise_multiplier(cfg.noise, float(epsilon), cfg.delta, cfg.steps, cfg.sampling_rate)
        # Noise z·C is added to the *sum* of clipped gradients; the client sends the mean, hence / batch.
        scale = z * cfg.clip / batch
        return NoisePlan(cfg.noise, scale, effective_std(cfg.noise, scale), cfg.clip, z)
    raise ValueError(f"unknown calibration {cfg.calibration!r}; expected 'paper' or 'dpsgd'")


# ---------------------------------------------------------------------------------------------------------------
# Pure transforms (jit-friendly).
# ---------------------------------------------------------------------------------------------------------------


def add_noise(key: PRNGKeyArray, grads: Params, noise: str, scale: Float[Array, ""] | float) -> Params:
    """Independent Gaussian(0, scale) or Laplace(0, scale) entries added to every leaf."""
    leaves, tree = jax.tree.flatten(grads)
    keys = jax.random.split(key, len(leaves))
    draw = jax.random.normal if noise == "gaussian" else jax.random.laplace
    return jax.tree.unflatten(tree, [g + scale * draw(k, g.shape, g.dtype) for k, g in zip(keys, leaves, strict=True)])


def per_example_norms(per_ex: Params, ord: int = 2) -> Float[Array, " B"]:
    """Norm of each example's whole gradient (all leaves together)."""
    leaves = jax.tree.leaves(per_ex)
    if ord == 1:
        return sum(jnp.abs(g).reshape(g.shape[0], -1).sum(axis=1) for g in leaves)
    return jnp.sqrt(sum(jnp.square(g).reshape(g.shape[0], -1).sum(axis=1) for g in leaves))


def clip_per_example(per_ex: Params, clip: float, ord: int = 2) -> Params:
    """Scales each example's gradient to norm ≤ `clip` (DP-SGD); smaller ones are untouched."""
    factor = jnp.minimum(1.0, clip / (per_example_norms(per_ex, ord) + 1e-12))
    return jax.tree.map(lambda g: g * factor.reshape((-1,) + (1,) * (g.ndim - 1)), per_ex)


def topk_prune(grads: Params, fraction: float) -> Params:
    """Keeps the `fraction` largest-magnitude entries over the whole gradient, zeroes the rest (DLG's pruning
    defence). Ties at the threshold are kept."""
    flat = jnp.concatenate([jnp.abs(g).ravel() for g in jax.tree.leaves(grads)])
    k = max(1, int(round(fraction * flat.size)))
    threshold = jax.lax.top_k(flat, k)[0][-1]
    return jax.tree.map(lambda g: jnp.where(jnp.abs(g) >= threshold, g, 0.0), grads)


def quantize(grads: Params, bits: int) -> Params:
    """Symmetric uniform quantisation per tensor: 2^(bits−1)−1 levels each side of 0, step max|g|/levels."""
    levels = 2 ** (bits - 1) - 1

    def q(g):
        step = jnp.max(jnp.abs(g)) / levels
        step = jnp.where(step > 0, step, 1.0)
        return jnp.round(g / step) * step

    return jax.tree.map(q, grads)


def dpsgd_grad(graphdef: nnx.GraphDef, params: Params, x, y, clip: float, ord: int = 2) -> Params:
    """Mean of the per-example gradients clipped to `clip` (noise not yet added)."""
    per_ex = clip_per_example(fl.per_example_grads(graphdef, params, x, y), clip, ord)
    return jax.tree.map(lambda g: g.mean(axis=0), per_ex)


def protected_grad(
    graphdef: nnx.GraphDef,
    params: Params,
    x: Float[Array, "B H W C"],
    y: Float[Array, "B K"],
    key: PRNGKeyArray,
    *,
    cfg: ProtectionConfig,
    noise_plan: NoisePlan | None,
) -> Params:
    """The gradient a protected client sends: (clip →) mean → (+ noise) → (top-k) → (quantise).

    `noise_plan=None` skips noise (pruning / quantisation alone). The noise scale is traced, so sweeping ε reuses
    one compiled program per (noise kind, clipping norm).
    """
    noise = None if noise_plan is None else noise_plan.noise
    clip = None if noise_plan is None else noise_plan.clip
    scale = jnp.float32(0.0 if noise_plan is None else noise_plan.scale)
    return _protected_grad(graphdef, params, x, y, key, scale, cfg=cfg, noise=noise, clip=clip)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "noise", "clip"))
def _protected_grad(graphdef, params, x, y, key, scale, *, cfg: ProtectionConfig, noise: str | None,
                    clip: float | None) -> Params:
    if clip is not None:
        g = dpsgd_grad(graphdef, params, x, y, clip, ord=1 if noise == "laplace" else 2)
    else:
        g = fl.batch_grad(graphdef, params, x, y)
    if noise is not None:
        g = add_noise(key, g, noise, scale)
    if cfg.topk is not None:
        g = topk_prune(g, cfg.topk)
    if cfg.quant_bits is not None:
        g = quantize(g, cfg.quant_bits)
    return g
