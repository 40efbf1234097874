"""Every gradient denoiser by name, behind one call: `Denoisers.run(name, g_sent, plan, key) -> (ĝ, t*)`.

Names (the `denoiser` column of the attack's JSON):

* ``none``: the protected gradient as received (identity);
* ``gaussian_filter``, ``wiener`` (told the true noise variance), ``dncnn`` (trained, blind): baselines;
* ``diffusion``: the paper's adaptive Mjölnir done right (σ_eff → t*, √n scaling, ancestral loop from t*);
* ``diffusion_ddim``, ``diffusion_oneshot``: other reverse processes from the same t*;
* ``diffusion_nonadaptive``: from a fixed step on the unscaled gradient (`NONADAPTIVE_T`);
* ``diffusion_conditional``: ancestral loop with the observation as a condition channel (conditional checkpoints);
* ``diffusion_released``: the released code (b for Laplace, a loop that never iterates), for comparison.
* ``prior``, ``prior_ddim``, ``prior_oneshot``: the adaptive ancestral / DDIM / one-shot reverse processes with
  the closed-form ε-model of a Gaussian fitted to the same surrogate gradients (`prior.py`, checkpoints with a
  `…/prior` beside `…/denoiser`); `prior_oneshot` is the linear MMSE estimate under that Gaussian.
* ``prior_refined``: ``prior_ddim`` plus the learned correction of `refiner.py` (a `…/refiner` beside the prior).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import checkpoint
from pgla_jax import codec as codec_lib
from pgla_jax.config import DenoiserConfig
from pgla_jax.denoise import baselines, ddpm, denoiser_checkpoint, dncnn, prior, refiner, sampling
from pgla_jax.denoise.unet import UNet
from pgla_jax.protections import NoisePlan

BASELINES = ("none", "gaussian_filter", "wiener", "dncnn")
DIFFUSION = ("diffusion", "diffusion_ddim", "diffusion_oneshot", "diffusion_nonadaptive", "diffusion_conditional",
             "diffusion_released")
_METHOD = {"diffusion": "ddpm", "diffusion_ddim": "ddim", "diffusion_oneshot": "oneshot",
           "diffusion_nonadaptive": "nonadaptive", "diffusion_conditional": "conditional",
           "diffusion_released": "released", "prior": "ddpm", "prior_ddim": "ddim", "prior_oneshot": "oneshot",
           "prior_refined": "ddim"}
PRIOR = ("prior", "prior_ddim", "prior_oneshot")
REFINED = "prior_refined"
#: Non-adaptive start step (0-based): the paper's Gaussian ε = 1 start, used whatever the noise.
NONADAPTIVE_T = 23
#: Reverse-process model calls at most (respaced ancestral chain beyond): DP-SGD noise maps to t* ≈ 1000.
MAX_STEPS = 100


def _unet_apply(graphdef, params, x, t, cond):
    return nnx.merge(graphdef, params)(x, t, cond)


def _prior_apply(alphas_cumprod, gaussian, x, t, cond):
    del cond  # the Gaussian's ε-model is unconditional
    return prior.eps(gaussian, x, prior.abar_at(jnp.asarray(alphas_cumprod, jnp.float32), t))


def _dncnn_apply(graphdef, params, y):
    return nnx.merge(graphdef, params)(y)


@dataclasses.dataclass
class Denoisers:
    """The denoisers available for one victim layout; diffusion ones only with a U-Net checkpoint.

    Attributes:
      codec: gradient pytree ↔ image.
      cfg: the checkpoint's config (None for baselines only).
      schedule: the DDPM schedule.
      unet / dncnn: (graphdef, params) or None.
      prior: the Gaussian prior of the surrogate gradients (`prior.GaussianPrior`) or None.
      refiner: (graphdef, params) of the prior's learned correction (`refiner.py`) or None.
      path: the U-Net checkpoint path (reported).
    """

    codec: codec_lib.GradientCodec
    cfg: DenoiserConfig | None = None
    schedule: ddpm.Schedule = dataclasses.field(default_factory=ddpm.linear_schedule)
    unet: tuple | None = None
    dncnn: tuple | None = None
    path: str | None = None
    max_steps: int = MAX_STEPS
    prior: prior.GaussianPrior | None = None
    refiner: tuple | None = None

    @property
    def names(self) -> tuple[str, ...]:
        out = [n for n in BASELINES if n != "dncnn" or self.dncnn is not None]
        if self.unet is not None:
            out += [n for n in DIFFUSION if n != "diffusion_conditional" or self.cfg.unet.cond_channels]
        if self.prior is not None:
            out += PRIOR
        if self.prior is not None and self.refiner is not None:
            out.append(REFINED)
        return tuple(out)

    def prior_gains(self, sigma: float) -> np.ndarray:
        """γ(σ): what the prior's DDIM from σ's t* multiplies each eigen-coefficient of y − μ by (`refiner.py`: the
        reverse process is a per-direction linear filter), read off one run on an input whose coefficients are
        all 1. Ones where σ is below the first step (the identity)."""
        gp = self.prior
        size = int(refiner.variances(gp).shape[0])
        if sampling.below_first_step(self.schedule, sigma):
            return np.ones((size,), np.float32)
        ones = jnp.ones((1, size), jnp.float32)
        y = self.codec.encode(self.codec.unflatten(gp.mean + refiner.expand(gp, ones)[0]))[None]
        out = sampling.denoise(_prior_apply_for(self.schedule), gp, y, jnp.float32(sigma),
                               jnp.int32(ddpm.t_index(self.schedule, sigma)), jax.random.key(0),
                               schedule=self.schedule, method="ddim", max_steps=self.max_steps)
        return np.asarray(refiner.coefficients(gp, out.reshape(1, -1))[0])

    def start_index(self, name: str, plan: NoisePlan) -> int:
        """0-based start step of a diffusion denoiser for this noise (the JSON's t_star is this + 1)."""
        if name == "diffusion_nonadaptive":
            return NONADAPTIVE_T
        sigma = ddpm.effective_sigma(plan.noise, plan.scale, released=name == "diffusion_released")
        return ddpm.t_index(self.schedule, sigma)

    def run(self, name: str, g_sent, plan: NoisePlan, key) -> tuple[object, int | None]:
        """(denoised gradient pytree, the paper's 1-based t* or None).

        t* = 0: the noise is below the model's first step, and the adaptive diffusion denoisers return `g_sent`
        itself (`sampling.below_first_step`); the paper's own non-adaptive and released loops still run.
        """
        if name == "none":
            return g_sent, None
        y = self.codec.encode(g_sent)
        if name == "gaussian_filter":
            return self.codec.decode(baselines.gaussian_filter(y)), None
        if name == "wiener":
            return self.codec.decode(baselines.wiener(y, jnp.float32(plan.std**2))), None
        if name == "dncnn":
            graphdef, params = self.dncnn
            return self.codec.decode(_dncnn_call(graphdef, params, y[None])[0]), None
        if name not in self.names or name not in _METHOD:
            raise ValueError(f"unknown or unavailable denoiser {name!r}; available: {', '.join(self.names)}")
        paper_loop = name in ("diffusion_nonadaptive", "diffusion_released")
        # The Gaussian level the adaptive reverse processes start from (for Laplace noise the one of its median
        # absolute deviation, `ddpm.effective_sigma`); the paper's own loops keep the noise's std.
        sigma = plan.std if paper_loop else ddpm.effective_sigma(plan.noise, plan.scale)
        if not paper_loop and sampling.below_first_step(self.schedule, sigma):
            return g_sent, 0
        ti = self.start_index(name, plan)
        k_pad, k_run = jax.random.split(key)
        # The sent gradient has noise on the real entries only; put noise of that level on the padding, so the whole
        # image is a sample of q(x_t* | x_0) as in training (the released code noised its padding too).
        pad = 1.0 - self.codec.mask()
        y = y + pad * sigma * jax.random.normal(k_pad, y.shape)
        if name in PRIOR or name == REFINED:
            apply, params = _prior_apply_for(self.schedule), self.prior
        else:
            apply, params = _apply_for(self.unet[0]), self.unet[1]
        out = sampling.denoise(apply, params, y[None], jnp.float32(sigma),
                               jnp.int32(ti), k_run, schedule=self.schedule, method=_METHOD[name],
                               max_steps=self.max_steps)
        if name == REFINED:  # the observation's real entries, as sent: what the refiner was trained to read
            flat_y = self.codec.encode(g_sent).reshape(1, -1)
            fix = _refine(self.refiner[0], self.refiner[1], self.prior, flat_y, jnp.float32(sigma))
            out = out.reshape(1, -1).at[:, : self.codec.size].add(fix).reshape(out.shape)
        return self.codec.decode(out[0]), ti + 1


@functools.lru_cache(maxsize=8)
def _apply_for(graphdef):
    # One function object per model structure: `denoise` takes it as a static argument, and a fresh partial per
    # call would hash differently and recompile the whole reverse loop every time.
    return functools.partial(_unet_apply, graphdef)


@functools.lru_cache(maxsize=8)
def _prior_apply_for(schedule: ddpm.Schedule):
    return functools.partial(_prior_apply, tuple(float(a) for a in schedule.alphas_cumprod))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _refine(graphdef, params, gaussian, flat_y, sigma):
    return refiner.correction(nnx.merge(graphdef, params), gaussian, flat_y, sigma[None])


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _dncnn_call(graphdef, params, y):
    return _dncnn_apply(graphdef, params, y)


def load(path: str | None, codec: codec_lib.GradientCodec) -> Denoisers:
    """The denoisers of a checkpoint folder: `path` is a U-Net checkpoint (`…/denoiser`) whose siblings `…/dncnn`
    and `…/prior` (if present) are the DnCNN baseline and the Gaussian prior, or a prior checkpoint alone (its
    `prior*` rows and the baselines); None gives the classical baselines only (on `codec`'s layout). Raises
    `CheckpointError` / `ValueError` (one line) for a checkpoint trained for another victim."""
    if path is None:
        return Denoisers(codec)
    meta = checkpoint.read_metadata(path)
    if meta.get("kind") == prior.KIND:  # a prior alone: its rows and the baselines
        cfg = denoiser_checkpoint.config_from_json(meta["config"])
        want = _fitting(denoiser_checkpoint.make_codec(cfg), codec, path)
        gaussian = _checked_prior(prior.load(path), want, path)
        return Denoisers(want, cfg, ddpm.linear_schedule(cfg.diffusion), path=os.path.abspath(path),
                         prior=gaussian, refiner=_refiner_of(path, gaussian))
    tree, cfg, _ = denoiser_checkpoint.load(path)
    want = _fitting(denoiser_checkpoint.make_codec(cfg), codec, path)
    model = nnx.eval_shape(lambda: UNet(cfg.unet, rngs=nnx.Rngs(0)))  # shapes only: a random init costs ~30 s
    denoiser_checkpoint.load_pure(model, tree)
    unet = nnx.split(model, nnx.Param)
    dn = None
    sibling = os.path.join(os.path.dirname(os.path.abspath(path)), "dncnn")
    if os.path.isdir(sibling):
        dn = nnx.split(dncnn.restore(sibling)[0], nnx.Param)
    gaussian = fine = None
    if os.path.isdir(prior.sibling(path)):
        gaussian = _checked_prior(prior.load(prior.sibling(path)), want, prior.sibling(path))
        fine = _refiner_of(prior.sibling(path), gaussian)
    return Denoisers(want, cfg, ddpm.linear_schedule(cfg.diffusion), unet, dn, os.path.abspath(path),
                     prior=gaussian, refiner=fine)


def _refiner_of(prior_path: str, gaussian: prior.GaussianPrior) -> tuple | None:
    """The refiner beside a prior checkpoint, or None where there is none."""
    path = refiner.sibling(prior_path)
    return refiner.load(path, gaussian) if os.path.isdir(path) else None


def _fitting(want: codec_lib.GradientCodec, codec: codec_lib.GradientCodec, path: str) -> codec_lib.GradientCodec:
    if want.shapes != codec.shapes:
        raise ValueError(f"denoiser {path} was trained for a victim with {want.size} gradient entries "
                         f"{list(want.shapes)[:2]}...; this victim has {codec.size}")
    return want


def _checked_prior(gaussian: prior.GaussianPrior, want: codec_lib.GradientCodec, path: str) -> prior.GaussianPrior:
    if gaussian.size != want.size or want.layout == "per_layer":
        raise ValueError(f"prior {path} does not fit the denoiser's {want.layout} layout of {want.size} entries")
    return gaussian
