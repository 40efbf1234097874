"""One attack experiment: pick private images, compute clean and protected client gradients, invert both, score.

This is the logic behind `python -m pgla_jax.attack`, importable from Colab. Part 1 has one gradient "denoiser",
`none` (the protected gradient is attacked as received); the diffusion denoiser arrives with part 2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pgla_jax import data, fl, metrics, protections
from pgla_jax.attacks import dlg, ig
from pgla_jax.config import ExperimentConfig
from pgla_jax.models import split_victim

DENOISERS = ("none",)

_batch_grad = jax.jit(fl.batch_grad, static_argnums=0)


@dataclasses.dataclass
class Outcome:
    """Rows (one per (ε, denoiser)) in the CLI's JSON schema, and the image panels for the figure.

    Attributes:
      rows: dicts with epsilon, noise, calibration, denoiser, t_star, grad_cosine, grad_psnr, image_psnr,
        image_ssim, label_accuracy (+ noise_std, the effective std of the added noise).
      clean: the clean-gradient recovery as one row (epsilon None).
      panels: name → [N, H, W, C] images: "original", "clean", then "eps=<ε>" per ε.
    """

    rows: list[dict[str, Any]]
    clean: dict[str, Any]
    panels: dict[str, np.ndarray]


def validate(cfg: ExperimentConfig, ds: data.ImageSet) -> None:
    """Raises ValueError for inputs the CLI reports as one line with exit code 2."""
    for eps in cfg.epsilons:
        if not (eps > 0 and np.isfinite(eps)):
            raise ValueError(f"epsilon must be > 0, got {eps}")
    if cfg.batch_size < 1 or cfg.num_images < 1:
        raise ValueError("batch size and number of images must be ≥ 1")
    n = len(ds.labels)
    if cfg.batch_size > n:
        raise ValueError(f"batch size {cfg.batch_size} is larger than the data set {ds.name} ({n} images)")
    if cfg.num_images > n:
        raise ValueError(f"{cfg.num_images} images requested, the data set {ds.name} has {n}")
    if cfg.num_images % cfg.batch_size:
        raise ValueError(f"--images {cfg.num_images} is not a multiple of the batch size {cfg.batch_size}")
    if ds.images.shape[1:] != cfg.victim.image_shape:
        raise ValueError(f"data {ds.name} has images {ds.images.shape[1:]}; victim expects {cfg.victim.image_shape}")
    if ds.num_classes > cfg.victim.num_classes:
        raise ValueError(f"data {ds.name} has {ds.num_classes} classes, the victim {cfg.victim.num_classes}")


def attack_fn(cfg: ExperimentConfig) -> Callable:
    """(graphdef, params, target, key) -> Recovery for the configured attack."""
    kw = dict(cfg=cfg.attack, batch=cfg.batch_size, num_classes=cfg.victim.num_classes,
              image_shape=cfg.victim.image_shape)
    if cfg.attack.kind == "dlg":
        return lambda g, p, t, k: dlg.dlg(g, p, t, k, **kw)
    if cfg.attack.kind == "idlg":
        return lambda g, p, t, k: dlg.idlg(g, p, t, k, **kw)
    if cfg.attack.kind == "ig":
        return lambda g, p, t, k: ig.ig(g, p, t, k, **kw)
    raise ValueError(f"unknown attack {cfg.attack.kind!r}")


def _score(rec: dlg.Recovery, x, labels, g_sent, g_clean) -> tuple[dict[str, float], np.ndarray]:
    perm = metrics.match_order(rec.images, x)
    images = np.asarray(rec.images)[perm]
    return {
        "grad_cosine": float(metrics.grad_cosine(g_sent, g_clean)),
        "grad_psnr": float(metrics.grad_psnr(g_sent, g_clean)),
        "image_psnr": float(metrics.psnr(images, x, data_range=1.0).mean()),
        "image_ssim": float(metrics.ssim(images, x, data_range=1.0).mean()),
        "label_accuracy": float(metrics.label_accuracy(rec.labels, labels)),
    }, images


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def run(cfg: ExperimentConfig, ds: data.ImageSet | None = None, progress: Callable | None = None,
        denoiser: str = "none") -> Outcome:
    """Runs the experiment; `progress(n)` is called after each attack (n = 1) for a progress bar."""
    if denoiser not in DENOISERS:
        raise ValueError(f"denoiser {denoiser!r} is not available in part 1 (only 'none')")
    ds = data.load(cfg.data) if ds is None else ds
    validate(cfg, ds)
    x_all, y_all = data.pick(ds, cfg.num_images, cfg.data.seed)
    graphdef, params = split_victim(cfg.victim)
    attack = attack_fn(cfg)
    plans = {eps: protections.plan(cfg.protection, eps, cfg.batch_size) for eps in cfg.epsilons}
    key = jax.random.key(cfg.attack.seed)

    clean_scores, clean_imgs = [], []
    scores = {eps: [] for eps in cfg.epsilons}
    imgs = {eps: [] for eps in cfg.epsilons}
    for b in range(cfg.num_images // cfg.batch_size):
        sl = slice(b * cfg.batch_size, (b + 1) * cfg.batch_size)
        x, labels = jnp.asarray(x_all[sl]), y_all[sl]
        y = fl.one_hot(jnp.asarray(labels), cfg.victim.num_classes)
        g_clean = _batch_grad(graphdef, params, x, y)
        k_b = jax.random.fold_in(key, b)
        s, im = _score(attack(graphdef, params, g_clean, jax.random.fold_in(k_b, 0)), x, labels, g_clean, g_clean)
        clean_scores.append(s)
        clean_imgs.append(im)
        progress and progress(1)
        for i, eps in enumerate(cfg.epsilons):
            k_noise, k_att = jax.random.split(jax.random.fold_in(k_b, i + 1))
            g_sent = protections.protected_grad(graphdef, params, x, y, k_noise, cfg=cfg.protection,
                                                noise_plan=plans[eps])
            s, im = _score(attack(graphdef, params, g_sent, k_att), x, labels, g_sent, g_clean)
            scores[eps].append(s)
            imgs[eps].append(im)
            progress and progress(1)

    p = cfg.protection
    rows = [
        {"epsilon": float(eps), "noise": p.noise, "calibration": p.calibration, "denoiser": denoiser,
         "t_star": None, **_mean(scores[eps]), "noise_std": plans[eps].std}
        for eps in cfg.epsilons
    ]
    clean = {"epsilon": None, "noise": None, "calibration": None, "denoiser": None, "t_star": None,
             **_mean(clean_scores), "noise_std": 0.0}
    panels = {"original": np.asarray(x_all), "clean": np.concatenate(clean_imgs)}
    panels.update({f"eps={eps:g}": np.concatenate(imgs[eps]) for eps in cfg.epsilons})
    return Outcome(rows, clean, panels)


def save_figure(outcome: Outcome, path: str, title: str = "") -> str:
    """PNG grid: one row per panel (original / recovered from clean / recovered at each ε), one column per image."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(outcome.panels)
    n = outcome.panels["original"].shape[0]
    fig, axes = plt.subplots(len(names), n, figsize=(1.3 * n + 1.2, 1.3 * len(names) + 0.4), squeeze=False)
    psnr_of = {f"eps={r['epsilon']:g}": r["image_psnr"] for r in outcome.rows}
    psnr_of["clean"] = outcome.clean["image_psnr"]
    for r, name in enumerate(names):
        for c in range(n):
            ax = axes[r, c]
            im = np.clip(outcome.panels[name][c], 0.0, 1.0)
            ax.imshow(im[..., 0] if im.shape[-1] == 1 else im, cmap="gray", vmin=0.0, vmax=1.0)
            ax.set_xticks([])
            ax.set_yticks([])
        label = name if name not in psnr_of else f"{name}\n{psnr_of[name]:.1f} dB"
        axes[r, 0].set_ylabel(label, fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
