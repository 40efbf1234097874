"""One attack experiment: pick private images, compute clean and protected client gradients, invert both, score.

This is the logic behind `python -m pgla_jax.attack`, importable from Colab. Every protected gradient goes through
each denoiser of `pgla_jax.denoise.denoisers` (the identity `none`, classical baselines, the diffusion model and its
variants); gradient metrics are scored for all of them, and the attack is run on the outputs of `attacked` ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pgla_jax import data, fl, metrics, protections
from pgla_jax.codec import make_codec
from pgla_jax.config import ExperimentConfig
from pgla_jax.denoise.denoisers import Denoisers
from pgla_jax.inversion import dlg, ig
from pgla_jax.models import split_victim

_batch_grad = jax.jit(fl.batch_grad, static_argnums=0)

#: Denoisers whose output is attacked by default (the others get gradient metrics only; attacks dominate the cost).
#: DDIM rather than the paper's ancestral loop: from the same t* it has the higher gradient cosine in every noisy
#: row and the better DLG image in each: at Laplace ε = 1 DLG from it is 0.6-0.7 dB below the protected gradient,
#: from the ancestral loop (whose fresh noise DLG follows) ~3 dB below (docs/pgla.md). The U-Net's and the Gaussian
#: prior's DDIM both, where the checkpoint has them, and the prior's DDIM with its learned correction.
ATTACKED = ("none", "diffusion_ddim", "prior_ddim", "prior_refined", "attack_aware")

#: The default attack path (`attack_aware`): DLG on blends α·ĝ + (1 − α)·g_sent of the best available denoiser's
#: output ĝ and the protected gradient g_sent, keeping the reconstruction under which g_sent is the most likely
#: (`noise_misfit`). DLG's squared-L2 objective on a blend is, up to a constant, (1 − α)·‖∇x − g_sent‖² +
#: α·‖∇x − ĝ‖²: the noise model's likelihood and the denoiser's estimate, weighted. Neither end alone serves every
#: noise level: the denoiser wins when the noise is large, the protected gradient when it is moderate (the prior
#: shrinks directions that the surrogate data rarely shows and the attack needs), and a blend between them beats
#: both at moderate noise (docs/pgla.md).
AWARE = "attack_aware"
AWARE_BASES = ("prior_refined", "prior_ddim", "diffusion_ddim")  # the first available is blended
BLENDS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclasses.dataclass
class Outcome:
    """Rows (one per (noise, calibration, ε, denoiser)) in the CLI's JSON schema, and image panels for figures.

    Attributes:
      rows: dicts with epsilon, noise, calibration, denoiser, t_star, grad_cosine, grad_psnr, image_psnr,
        image_ssim, label_accuracy (+ noise_std, the effective std of the added noise; image metrics are None for
        denoisers whose output was not attacked).
      clean: the clean-gradient recovery as one row (epsilon None).
      panels: (noise, calibration) → name → [N, H, W, C] images: "original", "clean", then "<denoiser> ε=<ε>".
      psnr: (noise, calibration) → panel name → mean image PSNR (figure labels).
    """

    rows: list[dict[str, Any]]
    clean: dict[str, Any]
    panels: dict[tuple[str, str], dict[str, np.ndarray]]
    psnr: dict[tuple[str, str], dict[str, float]]


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

def aware_base(names: Sequence[str]) -> str | None:
    """The denoiser `attack_aware` blends with the protected gradient: the first of `AWARE_BASES` in `names`."""
    return next((n for n in AWARE_BASES if n in names), None)


def noise_misfit(graphdef, params, g_sent, rec: dlg.Recovery, plan: protections.NoisePlan,
                 protection, num_classes: int) -> float:
    """What the attacker can compute about a reconstruction (x̂, ŷ) without the clean gradient: the negative
    log-likelihood per entry (up to a constant) of the protected gradient it observed, given the gradient the
    reconstruction would have sent, under the known noise. With r = g_sent − T(∇(x̂, ŷ)), T the protection without
    its noise (clipping, top-k, quantisation as configured): ‖r‖²/(n·σ²) for Gaussian noise, ‖r‖₁/(n·b) for Laplace;
    ≈ 1 for a reconstruction that explains g_sent up to the noise."""
    silent = dataclasses.replace(plan, scale=0.0)
    g_rec = protections.protected_grad(graphdef, params, rec.images, fl.one_hot(rec.labels, num_classes),
                                       jax.random.key(0), cfg=protection, noise_plan=silent)
    r = [jnp.ravel(a - b) for a, b in zip(jax.tree.leaves(g_sent), jax.tree.leaves(g_rec), strict=True)]
    n = sum(x.size for x in r)
    scale = plan.scale or 1.0  # no noise: the plain mean misfit, which orders reconstructions the same way
    if plan.noise == "laplace":
        return float(sum(jnp.abs(x).sum() for x in r)) / (n * scale)
    return float(sum(jnp.sum(x * x) for x in r)) / (n * scale**2)


def attack_aware(graphdef, params, g_sent, g_hat, plan: protections.NoisePlan, protection, attack: Callable, key,
                 num_classes: int, *, blends: Sequence[float] = BLENDS, known: dict | None = None,
                 progress: Callable | None = None) -> tuple[dlg.Recovery, float, Any]:
    """Attack-aware inversion: `attack` on each blend α·g_hat + (1 − α)·g_sent (α in `blends`; 0 is the protected
    gradient, 1 the denoised one), all from the same start `key`; returns (the recovery with the smallest
    `noise_misfit`, its α, the gradient it inverted). `known`: α → a recovery already made with `key` (not rerun);
    `progress(1)` after each attack run."""
    best = None
    for a in blends:
        target = g_sent if a == 0 else g_hat if a == 1 else jax.tree.map(
            lambda h, s, a=a: a * h + (1.0 - a) * s, g_hat, g_sent)
        rec = (known or {}).get(a)
        if rec is None:
            rec = attack(graphdef, params, target, key)
            progress and progress(1)
        m = noise_misfit(graphdef, params, g_sent, rec, plan, protection, num_classes)
        if best is None or m < best[0]:
            best = (m, rec, float(a), target)
    return best[1], best[2], best[3]


def _grad_scores(g_hat, g_clean) -> dict[str, float]:
    return {"grad_cosine": float(metrics.grad_cosine(g_hat, g_clean)),
            "grad_psnr": float(metrics.grad_psnr(g_hat, g_clean))}


def _score(rec: dlg.Recovery, x, labels) -> tuple[dict[str, float], np.ndarray]:
    perm = metrics.match_order(rec.images, x)
    images = np.asarray(rec.images)[perm]
    return {
        "image_psnr": float(metrics.psnr(images, x, data_range=1.0).mean()),
        "image_ssim": float(metrics.ssim(images, x, data_range=1.0).mean()),
        "label_accuracy": float(metrics.label_accuracy(rec.labels, labels)),
    }, images


def _jitter(starts: list[list[float]]) -> float:
    """Std (ddof 1) over random starts of the mean PSNR over images: one start per inner list."""
    return float(np.std([np.mean(s) for s in starts], ddof=1))


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


_IMAGE_KEYS = ("image_psnr", "image_ssim", "label_accuracy")


def run(cfg: ExperimentConfig, ds: data.ImageSet | None = None, progress: Callable | None = None,
        denoisers: Denoisers | None = None, settings: Sequence[tuple[str, str]] | None = None,
        names: Sequence[str] | None = None, attacked: Sequence[str] = ATTACKED, jitter: int = 0) -> Outcome:
    """Runs the experiment; `progress(n)` is called after each attack (n = 1) for a progress bar.

    `settings`: (noise, calibration) pairs (default: the config's protection); `denoisers`: from
    `pgla_jax.denoise.denoisers.load` (default: the baselines only); `names`: which of them (default all);
    `attacked`: the denoisers whose output is also inverted by the attack; `jitter`: that many more attacks of the
    protected gradient (`none`) per image from other random starts, whose spread is the row's `image_psnr_jitter`
    (the std over starts of the images' mean PSNR): the attack's own noise, against which a denoiser's gain or
    loss is read. `AWARE` in `attacked` adds its row (`attack_aware`, blending `aware_base(names)`; `blend` is the
    mean α it chose) where a denoiser to blend is among `names`; below the first diffusion step (t* = 0) the
    denoised gradient is the protected one, and the row is `none`'s attack.
    """
    ds = data.load(cfg.data) if ds is None else ds
    validate(cfg, ds)
    x_all, y_all = data.pick(ds, cfg.num_images, cfg.data.seed)
    graphdef, params = split_victim(cfg.victim)
    if denoisers is None:
        denoisers = Denoisers(make_codec(params, "image2d", 4))
    names = tuple(denoisers.names if names is None else names)
    settings = tuple(settings or ((cfg.protection.noise, cfg.protection.calibration),))
    attack = attack_fn(cfg)
    base = aware_base(names) if AWARE in attacked else None
    prots = {s: dataclasses.replace(cfg.protection, noise=s[0], calibration=s[1]) for s in settings}
    plans = {(s, eps): protections.plan(prots[s], eps, cfg.batch_size) for s in settings for eps in cfg.epsilons}
    key = jax.random.key(cfg.attack.seed)

    clean_scores, clean_imgs = [], []
    grad = {}  # (setting, ε, name) -> list of grad score dicts
    image = {}  # (setting, ε, name) -> list of image score dicts
    imgs = {}  # (setting, ε, name) -> list of image batches
    t_stars = {}
    spread = {}  # (setting, ε) -> [start][batch] mean image PSNR of the protected gradient
    alphas = {}  # (setting, ε) -> the α attack_aware chose, per batch
    for b in range(cfg.num_images // cfg.batch_size):
        sl = slice(b * cfg.batch_size, (b + 1) * cfg.batch_size)
        x, labels = jnp.asarray(x_all[sl]), y_all[sl]
        y = fl.one_hot(jnp.asarray(labels), cfg.victim.num_classes)
        g_clean = _batch_grad(graphdef, params, x, y)
        k_b = jax.random.fold_in(key, b)
        # One attack key per batch, shared by every gradient it inverts (clean, protected, each denoiser's): the
        # attack's random start then differs in nothing, and a PSNR gap is the gradient's doing, not a luckier start.
        k_att = jax.random.fold_in(k_b, 0)
        s, im = _score(attack(graphdef, params, g_clean, k_att), x, labels)
        clean_scores.append({**_grad_scores(g_clean, g_clean), **s})
        clean_imgs.append(im)
        progress and progress(1)
        for si, setting in enumerate(settings):
            for i, eps in enumerate(cfg.epsilons):
                # Three keys, the middle one unused: the noise draws stay those of the published gradient tables.
                k_noise, _, k_den = jax.random.split(jax.random.fold_in(jax.random.fold_in(k_b, si + 1), i + 1), 3)
                plan = plans[(setting, eps)]
                g_sent = protections.protected_grad(graphdef, params, x, y, k_noise, cfg=prots[setting],
                                                    noise_plan=plan)
                outputs, recs = {}, {}  # name -> denoised gradient, recovery (attack_aware reuses them)
                for name in names:
                    g_hat, t_star = denoisers.run(name, g_sent, plan, k_den)
                    outputs[name] = g_hat
                    k = (setting, eps, name)
                    t_stars[k] = t_star
                    grad.setdefault(k, []).append(_grad_scores(g_hat, g_clean))
                    if name in attacked:
                        recs[name] = attack(graphdef, params, g_hat, k_att)
                        s, im = _score(recs[name], x, labels)
                        image.setdefault(k, []).append(s)
                        imgs.setdefault(k, []).append(im)
                        progress and progress(1)
                    if name == "none" and jitter:
                        starts = spread.setdefault((setting, eps), [[] for _ in range(jitter + 1)])
                        if name in attacked:
                            starts[0].append(image[k][-1]["image_psnr"])
                        else:
                            starts[0].append(_score(attack(graphdef, params, g_hat, k_att), x, labels)[0]["image_psnr"])
                            progress and progress(1)
                        for j in range(1, jitter + 1):
                            rec = attack(graphdef, params, g_hat, jax.random.fold_in(k_b, 1000 + j))
                            starts[j].append(_score(rec, x, labels)[0]["image_psnr"])
                            progress and progress(1)
                if base is not None:
                    known = {a: recs[n] for a, n in ((0.0, "none"), (1.0, base)) if n in recs}
                    blends = BLENDS if t_stars[(setting, eps, base)] else (0.0,)
                    rec, alpha, target = attack_aware(
                        graphdef, params, g_sent, outputs[base], plan, prots[setting], attack, k_att,
                        cfg.victim.num_classes, blends=blends, known=known, progress=progress)
                    if progress:  # the bar counts every blend: those skipped at t* = 0 too
                        progress(sum(a not in known for a in BLENDS) - sum(a not in known for a in blends))
                    k = (setting, eps, AWARE)
                    t_stars[k] = t_stars[(setting, eps, base)]
                    grad.setdefault(k, []).append(_grad_scores(target, g_clean))
                    s, im = _score(rec, x, labels)
                    image.setdefault(k, []).append(s)
                    imgs.setdefault(k, []).append(im)
                    alphas.setdefault((setting, eps), []).append(alpha)

    rows = []
    shown = (*names, AWARE) if base is not None else names
    for setting in settings:
        for eps in cfg.epsilons:
            for name in shown:
                k = (setting, eps, name)
                img = _mean(image[k]) if k in image else dict.fromkeys(_IMAGE_KEYS)
                rows.append({"epsilon": float(eps), "noise": setting[0], "calibration": setting[1], "denoiser": name,
                             "t_star": t_stars[k], **_mean(grad[k]), **img,
                             "noise_std": plans[(setting, eps)].std,
                             "image_psnr_jitter": _jitter(spread[(setting, eps)])
                             if name == "none" and (setting, eps) in spread else None,
                             **({"base": base, "blend": float(np.mean(alphas[(setting, eps)]))}
                                if name == AWARE else {})})
    clean = {"epsilon": None, "noise": None, "calibration": None, "denoiser": None, "t_star": None,
             **_mean(clean_scores), "noise_std": 0.0}
    panels, psnr = {}, {}
    for setting in settings:
        panels[setting] = {"original": np.asarray(x_all), "clean": np.concatenate(clean_imgs)}
        psnr[setting] = {"clean": clean["image_psnr"]}
        for eps in cfg.epsilons:
            for name in shown:
                k = (setting, eps, name)
                if k in imgs:
                    label = f"{name} ε={eps:g}"
                    panels[setting][label] = np.concatenate(imgs[k])
                    psnr[setting][label] = _mean(image[k])["image_psnr"]
    return Outcome(rows, clean, panels, psnr)


def save_figure(panels: dict[str, np.ndarray], psnr_of: dict[str, float], path: str, title: str = "") -> str:
    """PNG grid: one row per panel (original / recovered from clean / from protected and denoised gradients at each
    ε), one column per image; row labels carry the mean PSNR."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(panels)
    n = panels["original"].shape[0]
    fig, axes = plt.subplots(len(names), n, figsize=(1.3 * n + 1.6, 1.1 * len(names) + 0.4), squeeze=False)
    for r, name in enumerate(names):
        for c in range(n):
            ax = axes[r, c]
            im = np.clip(panels[name][c], 0.0, 1.0)
            ax.imshow(im[..., 0] if im.shape[-1] == 1 else im, cmap="gray", vmin=0.0, vmax=1.0)
            ax.set_xticks([])
            ax.set_yticks([])
        label = name if name not in psnr_of else f"{name}\n{psnr_of[name]:.1f} dB"
        axes[r, 0].set_ylabel(label, fontsize=7, rotation=0, ha="right", va="center")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
