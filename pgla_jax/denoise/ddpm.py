"""DDPM maths: the linear β schedule, the forward marginal q(x_t | x_0), the ε-prediction Huber loss, and the
paper's noise-level → start-step map.

Indices are 0-based everywhere in code (index i is the paper's step t = i + 1): `alphas_cumprod[i]` is ᾱ of step
i + 1, and the reverse process from index i runs the model at indices i, i − 1, ..., 0 (i + 1 steps).

The adaptive step: a protected gradient g' = g + σ·z scaled by √n, n = 1/(1 + σ²), is
√n·g' = √n·g + √(1 − n)·z, exactly a sample of q(x_t | g) at ᾱ_t = n. The released code starts at the first step
whose ᾱ is below n (`t_index`), one β step noisier than exact at most.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from pgla_jax.config import DiffusionConfig


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The per-step tables, float64 numpy (exact constants; cast to float32 where used under jit).

    Attributes:
      betas, alphas (1 − β), alphas_cumprod (ᾱ), alphas_cumprod_prev (ᾱ of the previous step, 1 before the first),
      posterior_variance (β̃ = β·(1 − ᾱ_prev)/(1 − ᾱ)): all [T].
    """

    betas: np.ndarray
    alphas: np.ndarray
    alphas_cumprod: np.ndarray
    alphas_cumprod_prev: np.ndarray
    posterior_variance: np.ndarray

    @property
    def timesteps(self) -> int:
        return len(self.betas)

    def __hash__(self):  # a schedule is a static argument of jitted samplers
        return hash((self.timesteps, float(self.betas[0]), float(self.betas[-1])))

    def __eq__(self, other):
        return isinstance(other, Schedule) and np.array_equal(self.betas, other.betas)


def linear_schedule(cfg: DiffusionConfig | None = None) -> Schedule:
    """The paper's `linear_beta_schedule`: β linear from `beta_start` to `beta_end` over T steps."""
    cfg = DiffusionConfig() if cfg is None else cfg
    betas = np.linspace(cfg.beta_start, cfg.beta_end, cfg.timesteps, dtype=np.float64)
    alphas = 1.0 - betas
    ac = np.cumprod(alphas)
    ac_prev = np.concatenate([[1.0], ac[:-1]])
    return Schedule(betas, alphas, ac, ac_prev, betas * (1.0 - ac_prev) / (1.0 - ac))


def _at(table: np.ndarray, t: Int[Array, "..."], ndim: int) -> Float[Array, "..."]:
    """table[t] broadcast against a batch of rank `ndim` (t has the batch's leading axis or is a scalar)."""
    v = jnp.asarray(table, jnp.float32)[t]
    return v.reshape(v.shape + (1,) * (ndim - v.ndim))


def q_sample(s: Schedule, x0: Float[Array, "B ..."], t: Int[Array, " B"], eps: Float[Array, "B ..."]
             ) -> Float[Array, "B ..."]:
    """x_t = √ᾱ_t·x_0 + √(1 − ᾱ_t)·ε."""
    ac = _at(s.alphas_cumprod, t, x0.ndim)
    return jnp.sqrt(ac) * x0 + jnp.sqrt(1.0 - ac) * eps


def predict_x0(x_t, alpha_bar, eps_hat):
    """x̂_0 = (x_t − √(1 − ᾱ)·ε̂)/√ᾱ, for any ᾱ (a grid step's, or the exact start's n)."""
    return (x_t - jnp.sqrt(1.0 - alpha_bar) * eps_hat) / jnp.sqrt(alpha_bar)


def huber_loss(eps_hat: Float[Array, "B ..."], eps: Float[Array, "B ..."], mask: Float[Array, "..."] | None = None
               ) -> Float[Array, ""]:
    """`F.smooth_l1_loss` (β = 1) of the paper's trainer, averaged over the real (unpadded) entries."""
    per = optax.huber_loss(eps_hat, eps, delta=1.0)
    if mask is None:
        return per.mean()
    m = jnp.broadcast_to(mask, per.shape)
    return (per * m).sum() / m.sum()


def sample_t(key: PRNGKeyArray, batch: int, timesteps: int, focus_t: int, focus_prob: float) -> Int[Array, " B"]:
    """Training steps: uniform on [0, focus_t) with probability `focus_prob`, uniform on [0, T) otherwise."""
    k1, k2, k3 = jax.random.split(key, 3)
    low = jax.random.randint(k1, (batch,), 0, min(focus_t, timesteps))
    full = jax.random.randint(k2, (batch,), 0, timesteps)
    return jnp.where(jax.random.uniform(k3, (batch,)) < focus_prob, low, full)


# ---------------------------------------------------------------------------------------------------------------
# The adaptive start step.
# ---------------------------------------------------------------------------------------------------------------


def signal_fraction(sigma: float | Float[Array, ""]):
    """n = 1/(1 + σ²): ᾱ of a DDPM step whose noise matches std σ on a unit-scale signal."""
    return 1.0 / (1.0 + jnp.square(sigma)) if isinstance(sigma, jax.Array) else 1.0 / (1.0 + sigma * sigma)


def t_index(s: Schedule, sigma: float) -> int:
    """0-based index of the first step with ᾱ < n (the released rule); T − 1 if none is below (σ too large)."""
    n = signal_fraction(float(sigma))
    below = np.flatnonzero(s.alphas_cumprod < n)
    return int(below[0]) if below.size else s.timesteps - 1


def t_star(s: Schedule, sigma: float) -> int:
    """The paper's 1-based t* (what the released code prints): `t_index + 1`."""
    return t_index(s, sigma) + 1


#: σ of the Gaussian with the median absolute deviation of Laplace(b), per unit b: b·ln 2 = σ·Φ⁻¹(3/4).
LAPLACE_MAD_SIGMA = math.log(2.0) / 0.6744897501960817


def effective_sigma(noise: str, scale: float, calibration: str = "paper", released: bool = False,
                    laplace: str = "mad") -> float:
    """σ_eff of the added noise per gradient entry, the Gaussian level the diffusion model starts from: σ for
    Gaussian noise; for Laplace(b), by default the Gaussian of the same median absolute deviation (1.028·b), a robust
    match of its bulk. Laplace noise of a given std is mostly smaller entries with a few large ones; starting from its
    std (`laplace="std"`, √2·b) over-denoises, which measured both a lower cosine and DLG 0.6 dB below the protected
    gradient at ε = 1 (docs/pgla.md).

    `released=True` reproduces the released code, which maps Laplace with b itself (its bug (d); numerically close to
    the MAD match). DP-SGD noise is the plan's per-coordinate scale already divided by the batch (`protections.plan`).
    """
    del calibration  # both calibrations hand over the per-coordinate scale of the sent gradient
    if noise == "laplace" and not released:
        if laplace not in ("mad", "std"):
            raise ValueError(f"laplace must be 'mad' or 'std', got {laplace!r}")
        return scale * (LAPLACE_MAD_SIGMA if laplace == "mad" else math.sqrt(2.0))
    return scale
