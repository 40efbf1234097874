"""A Gaussian prior over clean gradients, and the closed-form ε-model of the DDPM whose data it describes.

Batch-1 gradients of one network at the global weights are far from white noise. Per layer they live close to a
subspace of a few dozen directions: on the DLG LeNet, 25-37 eigenvalues per layer of the surrogate gradients'
covariance lie above the Gaussian ε = 1 noise's σ². A Gaussian N(μ, Σ) fitted to the surrogate gradients (the data
the U-Net trains on) therefore says most of what there is to know about them, and a DDPM over Gaussian data has an
exact ε-model:

    ε*(x_t, t) = √(1 − ᾱ)·(ᾱ·Σ + (1 − ᾱ)·I)⁻¹·(x_t − √ᾱ·μ).

Σ is kept per layer (the blocks of `blocks`) as its top-K eigen-directions U, their variances λ and one variance ρ
for the rest of the layer: Σ = U·diag(λ)·Uᵀ + ρ·(I − U·Uᵀ), so applying (ᾱΣ + (1 − ᾱ)I)⁻¹ is two [n, K] matmuls.
K is `DenoiserConfig.prior_rank`; `train_denoiser` fits the prior beside the U-Net. The `prior*` denoiser rows
(`denoisers`) run the paper's adaptive reverse processes with this ε-model in place of the U-Net's. Its one-shot x̂₀
is the linear MMSE estimate E[g | g'] under the Gaussian (a Wiener filter in the layers' eigenbases). A U-Net trained
on what it leaves, ε − ε*, is not built yet.

Only the flat layouts (`image2d`, `vector1d`: the real entries first, in leaf order, then the padding) are
supported. The padding (the gradient's own mean, `codec`) is modelled as one Gaussian scalar per entry.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Float

from configs import checkpoint

KIND = "pgla-gaussian-prior"


@struct.dataclass
class GaussianPrior:
    """Attributes:
      mean: [P] the clean gradients' mean over the real entries (flat, leaf order).
      vecs: per block, [n, K] orthonormal top-K eigen-directions of its covariance.
      vals: per block, [K] their variances λ.
      rest: per block, [] the mean variance ρ of the block's other directions.
      pad: [2] mean and variance of the padding value (the gradient's own mean).
      bounds: static per-block (start, stop) into the flat vector.
    """

    mean: Float[Array, " P"]
    vecs: tuple[Float[Array, "N K"], ...]
    vals: tuple[Float[Array, " K"], ...]
    rest: tuple[Float[Array, ""], ...]
    pad: Float[Array, " 2"]
    bounds: tuple[tuple[int, int], ...] = struct.field(pytree_node=False)

    @property
    def size(self) -> int:
        return self.bounds[-1][1]

    @property
    def rank(self) -> int:
        return max(v.shape[1] for v in self.vecs)


def blocks(grads_like) -> tuple[tuple[int, int], ...]:
    """(start, stop) of each layer in the flat gradient: consecutive leaves under one top-level module key."""
    out, start, prev, pos = [], 0, None, 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads_like):
        key = jax.tree_util.keystr(path[:1])
        if prev is not None and key != prev:
            out.append((start, pos))
            start = pos
        prev, pos = key, pos + int(np.prod(np.shape(leaf)))
    out.append((start, pos))
    return tuple(out)


def fit(grads: np.ndarray, bounds: tuple[tuple[int, int], ...], rank: int, progress=None) -> GaussianPrior:
    """The prior of clean flat gradients `grads` [N, P] (numpy): mean, and per block the top-`rank` eigenpairs of
    the sample covariance (float64) with the mean variance of the remaining directions. `progress(1)` per block."""
    g = np.asarray(grads, np.float64)
    if g.ndim != 2 or g.shape[1] != bounds[-1][1] or g.shape[0] < 2:
        raise ValueError(f"need [N ≥ 2, {bounds[-1][1]}] gradients, got {list(g.shape)}")
    mean = g.mean(0)
    vecs, vals, rest = [], [], []
    for a, b in bounds:
        c = np.cov(g[:, a:b], rowvar=False).reshape(b - a, b - a)
        lam, u = np.linalg.eigh(c)
        lam, u = np.clip(lam[::-1], 0.0, None), u[:, ::-1]
        k = min(rank, b - a)
        vecs.append(jnp.asarray(u[:, :k], jnp.float32))
        vals.append(jnp.asarray(lam[:k], jnp.float32))
        rest.append(jnp.asarray(lam[k:].mean() if k < b - a else 0.0, jnp.float32))
        progress and progress(1)
    own_mean = g.mean(1)  # what the codec pads each gradient with
    pad = jnp.asarray([own_mean.mean(), own_mean.var()], jnp.float32)
    return GaussianPrior(jnp.asarray(mean, jnp.float32), tuple(vecs), tuple(vals), tuple(rest), pad, tuple(bounds))


def build(cfg, data_dir: str, out: str, progress=None) -> str:
    """Fits the prior of `cfg.prior_rank` on every gradient of the data set in `data_dir` and saves it to `out`
    (`cfg`: the `DenoiserConfig` whose victim the gradients are of). Returns `out`."""
    from pgla_jax.denoise import gradients
    from pgla_jax.models import split_victim

    src, size = gradients.source(data_dir)
    bounds = blocks(split_victim(cfg.gradients.victim)[1])
    if size != bounds[-1][1]:
        raise ValueError(f"data set gradients have {size} entries, the config's victim {bounds[-1][1]}")
    grads = np.stack([src[i] for i in range(len(src))])
    prior = fit(grads, bounds, cfg.prior_rank, progress)
    return save(out, prior, config=cfg, overwrite=True, provenance={"gradients": len(grads), "rank": cfg.prior_rank,
                                                        "data": os.path.abspath(data_dir)})


def eps(prior: GaussianPrior, x: Float[Array, "B ..."], abar: Float[Array, " B"]) -> Float[Array, "B ..."]:
    """E[ε | x_t] for x_t = √ᾱ·x_0 + √(1 − ᾱ)·ε with x_0 from the prior (x in a flat layout, one ᾱ per example)."""
    b = x.shape[0]
    flat = x.reshape(b, -1)
    sa, c = jnp.sqrt(abar)[:, None], (1.0 - abar)[:, None]
    r = flat[:, : prior.size] - sa * prior.mean[None]
    out = []
    for (lo, hi), u, lam, rho in zip(prior.bounds, prior.vecs, prior.vals, prior.rest, strict=True):
        rb = r[:, lo:hi]
        z = jnp.einsum("bn,nk->bk", rb, u)
        inside = jnp.einsum("bk,nk->bn", z / (abar[:, None] * lam[None] + c), u)
        outside = (rb - jnp.einsum("bk,nk->bn", z, u)) / (abar[:, None] * rho + c)
        out.append(inside + outside)
    pad = (flat[:, prior.size :] - sa * prior.pad[0]) / (abar[:, None] * prior.pad[1] + c)
    return (jnp.sqrt(c) * jnp.concatenate(out + [pad], axis=1)).reshape(x.shape)


def abar_at(alphas_cumprod: Float[Array, " T"], t: Float[Array, " B"]) -> Float[Array, " B"]:
    """ᾱ at a (fractional, 0-based) model time: linear between grid steps, the inverse of `sampling.exact_start`."""
    return jnp.interp(t, jnp.arange(alphas_cumprod.shape[0], dtype=jnp.float32), alphas_cumprod)


def save(path: str, prior: GaussianPrior, *, config=None, provenance=None, overwrite: bool = False) -> str:
    """Saves `prior` (with `config`, the `DenoiserConfig` it was fitted for, when given) in the project's format."""
    # The directions are stored in float16 (half the bytes; `load` re-orthonormalises them): at rank 512 the
    # denoised gradients and DLG's images from them are the same as with float32 to the table's digits.
    tree = {"mean": prior.mean, "pad": prior.pad,
            "blocks": {f"{i:03d}": {"vecs": np.asarray(u, np.float16), "vals": lam, "rest": rho,
                                    "bounds": np.asarray(bd, np.int64)}
                       for i, (u, lam, rho, bd) in enumerate(zip(prior.vecs, prior.vals, prior.rest, prior.bounds))}}
    return checkpoint.save(path, tree, config=config, kind=KIND, provenance=provenance, overwrite=overwrite)


def load(path: str) -> GaussianPrior:
    """The prior saved at `path`; `CheckpointError` (one line) when it is not one."""
    meta = checkpoint.read_metadata(path)
    if meta.get("kind") != KIND:
        raise checkpoint.CheckpointError(f"{path} is a {meta.get('kind')!r} checkpoint, not a {KIND!r} one")
    tree = checkpoint.restore(path)
    bl = [tree["blocks"][k] for k in sorted(tree["blocks"])]
    return GaussianPrior(jnp.asarray(tree["mean"]), tuple(_orthonormal(d["vecs"]) for d in bl),
                         tuple(jnp.asarray(d["vals"]) for d in bl), tuple(jnp.asarray(d["rest"]) for d in bl),
                         jnp.asarray(tree["pad"]), tuple(tuple(int(v) for v in np.asarray(d["bounds"])) for d in bl))


def _orthonormal(u) -> Float[Array, "N K"]:
    # QR of the float16-rounded directions; the signs of R's diagonal keep each column's direction.
    q, r = np.linalg.qr(np.asarray(u, np.float32))
    return jnp.asarray(q * np.sign(np.diag(r))[None], jnp.float32)


def sibling(denoiser_path: str) -> str:
    """Where a denoiser checkpoint's prior lives: `…/prior` beside `…/denoiser`."""
    return os.path.join(os.path.dirname(os.path.abspath(denoiser_path)), "prior")
