"""Leakage metrics. Image metrics take a `data_range` argument that defaults to 1.0 and is always stated in reports.

The released Mjölnir code computes PSNR / SSIM with range 255 on [0, 1] images (+48 dB); here every image is in
[0, 1] and the range is 1. Gradient PSNR uses the peak max|g| of the *clean* gradient (documented choice: a
gradient has no natural range).
"""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PyTree

Params = PyTree[Float[Array, "..."]]


def mse(a: Float[Array, "B H W C"], b: Float[Array, "B H W C"]) -> Float[Array, " B"]:
    """Per-image mean squared error."""
    return jnp.mean(jnp.square(a - b).reshape(a.shape[0], -1), axis=1)


def psnr(a: Float[Array, "B H W C"], b: Float[Array, "B H W C"], data_range: float = 1.0) -> Float[Array, " B"]:
    """Per-image PSNR in dB, 10·log10(range² / MSE), with the data range explicit (1.0 for [0, 1] images)."""
    return 10.0 * jnp.log10(data_range**2 / jnp.maximum(mse(a, b), 1e-20))


def _gaussian_window(sigma: float = 1.5, truncate: float = 3.5) -> np.ndarray:
    r = int(truncate * sigma + 0.5)  # scipy.ndimage's radius rule: 11 taps at σ = 1.5
    t = np.arange(-r, r + 1, dtype=np.float64)
    w = np.exp(-0.5 * (t / sigma) ** 2)
    return (w / w.sum()).astype(np.float32)


def _blur(x: Float[Array, "B H W C"], w: np.ndarray) -> Float[Array, "B H W C"]:
    r = len(w) // 2
    # scipy.ndimage's default boundary "reflect" is numpy's "symmetric" (edge sample repeated).
    x = jnp.pad(x, ((0, 0), (r, r), (r, r), (0, 0)), mode="symmetric")
    x = sum(w[i] * x[:, i : i + x.shape[1] - 2 * r, :, :] for i in range(len(w)))
    return sum(w[i] * x[:, :, i : i + x.shape[2] - 2 * r, :] for i in range(len(w)))


def ssim(a: Float[Array, "B H W C"], b: Float[Array, "B H W C"], data_range: float = 1.0) -> Float[Array, " B"]:
    """Per-image SSIM (Wang et al. 2004): Gaussian window σ = 1.5, K1 = 0.01, K2 = 0.03, population covariances,
    channels averaged; the same definition as `skimage.metrics.structural_similarity(gaussian_weights=True,
    use_sample_covariance=False, data_range=...)`, including its crop of the window border. Images smaller than
    the 11-tap window (8×8 digits) are averaged without the crop."""
    w = _gaussian_window()
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    mu_a, mu_b = _blur(a, w), _blur(b, w)
    var_a = _blur(a * a, w) - mu_a**2
    var_b = _blur(b * b, w) - mu_b**2
    cov = _blur(a * b, w) - mu_a * mu_b
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    pad = len(w) // 2
    if min(a.shape[1], a.shape[2]) > 2 * pad:
        s = s[:, pad:-pad, pad:-pad, :]
    return s.reshape(s.shape[0], -1).mean(axis=1)


def match_order(recovered: Float[Array, "B H W C"], original: Float[Array, "B H W C"]) -> np.ndarray:
    """Permutation p minimising Σ MSE(recovered[p[i]], original[i]): a batch attack returns its images in an
    arbitrary order, so batch metrics pair them first (Hungarian assignment)."""
    from scipy.optimize import linear_sum_assignment

    r = np.asarray(recovered).reshape(recovered.shape[0], -1)
    o = np.asarray(original).reshape(original.shape[0], -1)
    cost = ((o[:, None, :] - r[None, :, :]) ** 2).mean(axis=-1)
    _, cols = linear_sum_assignment(cost)
    return cols


def label_accuracy(pred: Int[Array, " B"], true: Int[Array, " B"]) -> Float[Array, ""]:
    """Label recovery accuracy (LRA) as a multiset match: a batch attack may permute the labels."""
    p, t = Counter(np.asarray(pred).tolist()), Counter(np.asarray(true).tolist())
    return jnp.asarray(sum((p & t).values()) / len(np.asarray(true)), jnp.float32)


def _flat(g: Params) -> Float[Array, " P"]:
    return jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)])


def grad_cosine(g_hat: Params, g: Params) -> Float[Array, ""]:
    a, b = _flat(g_hat), _flat(g)
    return jnp.dot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b) + 1e-30)


def grad_psnr(g_hat: Params, g: Params) -> Float[Array, ""]:
    """10·log10(peak² / MSE) with peak = max|g| of the clean gradient `g`."""
    a, b = _flat(g_hat), _flat(g)
    peak = jnp.max(jnp.abs(b))
    return 10.0 * jnp.log10(peak**2 / jnp.maximum(jnp.mean(jnp.square(a - b)), 1e-30))


def grad_rel_l2(g_hat: Params, g: Params) -> Float[Array, ""]:
    """‖ĝ − g‖₂ / ‖g‖₂."""
    a, b = _flat(g_hat), _flat(g)
    return jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30)
