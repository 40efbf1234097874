"""Classical gradient-image denoisers the diffusion model is compared with: identity, a Gaussian filter and a local
(adaptive) Wiener filter told the true noise variance. All act on the encoded gradient image, like the U-Net.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

GAUSSIAN_SIGMA = 0.5  # pixels; wider kernels smear the gradient image's fine texture more than they remove noise
WIENER_SIZE = 3  # local window, as scipy.signal.wiener's default


def _box(x: Float[Array, "H W"], k: int) -> Float[Array, "H W"]:
    # Mean over a k×k window with reflected borders (not zeros: the image edge is not a dark border).
    r = k // 2
    p = jnp.pad(x, r, mode="reflect")
    out = sum(p[i : i + x.shape[0], :] for i in range(k)) / k
    return sum(out[:, j : j + x.shape[1]] for j in range(k)) / k


@jax.jit
def gaussian_filter(y: Float[Array, "H W 1"], sigma_px: float = GAUSSIAN_SIGMA) -> Float[Array, "H W 1"]:
    """Separable Gaussian blur (radius 2, reflected borders), the noise level ignored."""
    t = jnp.arange(-2, 3, dtype=jnp.float32)
    w = jnp.exp(-0.5 * (t / sigma_px) ** 2)
    w = w / w.sum()
    x = jnp.pad(y[..., 0], 2, mode="reflect")
    x = sum(w[i] * x[i : i + y.shape[0], :] for i in range(5))
    x = sum(w[j] * x[:, j : j + y.shape[1]] for j in range(5))
    return x[..., None]


@jax.jit
def wiener(y: Float[Array, "H W 1"], noise_var: Float[Array, ""]) -> Float[Array, "H W 1"]:
    """Lee / scipy.signal.wiener local Wiener filter with the *known* noise variance: in each window,
    x̂ = m + max(v − σ², 0)/v·(y − m) with m, v the local mean and variance."""
    x = y[..., 0]
    m = _box(x, WIENER_SIZE)
    v = _box(x * x, WIENER_SIZE) - m * m
    gain = jnp.maximum(v - noise_var, 0.0) / jnp.maximum(v, 1e-20)
    return (m + gain * (x - m))[..., None]
