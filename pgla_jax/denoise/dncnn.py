"""A small DnCNN (Zhang et al. 2017) baseline: residual learning of the noise with a plain conv stack, trained on the
same clean surrogate gradients with synthetic noise of random level (a blind denoiser, unlike the adaptive DDPM
that is told σ)."""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Float

from configs import sharding
from pgla_jax.config import DenoiserConfig
from pgla_jax.denoise import denoiser_checkpoint

KIND = "pgla-dncnn"
#: Its training state, in the work directory (`loop.run`).
STATE = "dncnn_state"
SIGMA_RANGE = (1e-4, 0.3)  # log-uniform training noise std: the paper calibration's range and a bit beyond


class DnCNN(nnx.Module):
    """conv+ReLU, (conv+GroupNorm+ReLU) × (depth − 2), conv; returns y − noise estimate."""

    def __init__(self, depth: int, width: int, *, rngs: nnx.Rngs):
        self.first = nnx.Conv(1, width, (3, 3), rngs=rngs)
        self.mid = nnx.List([nnx.Conv(width, width, (3, 3), use_bias=False, rngs=rngs) for _ in range(depth - 2)])
        self.norms = nnx.List([nnx.GroupNorm(width, num_groups=4, rngs=rngs) for _ in range(depth - 2)])
        self.last = nnx.Conv(width, 1, (3, 3), rngs=rngs)

    def noise(self, y: Float[Array, "B H W 1"]) -> Float[Array, "B H W 1"]:
        h = jax.nn.relu(self.first(sharding.shard(y, ("batch", "height", "width", None))))
        for conv, norm in zip(self.mid, self.norms):
            h = jax.nn.relu(norm(conv(h)))
        return self.last(h)

    def __call__(self, y):
        return y - self.noise(y)


def optimizer(cfg: DenoiserConfig) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adam(optax.cosine_decay_schedule(1e-3, cfg.dncnn_steps, 0.1)))


def loss_fn(graphdef, params, x0, mask, key):
    """The noise's squared error relative to σ² (floored at 0.01², below which the noise is negligible for every
    metric here), so that the large-noise examples do not drown the small-noise ones nor the tiniest ones everything
    else; σ log-uniform on `SIGMA_RANGE` per example."""
    k1, k2 = jax.random.split(key)
    lo, hi = np.log(SIGMA_RANGE[0]), np.log(SIGMA_RANGE[1])
    sigma = jnp.exp(jax.random.uniform(k1, (x0.shape[0], 1, 1, 1), minval=lo, maxval=hi))
    noise = sigma * jax.random.normal(k2, x0.shape)
    err = (nnx.merge(graphdef, params).noise(x0 + noise) - noise) ** 2 / (sigma**2 + 1e-4)
    return (err * mask).sum() / (mask.sum() * x0.shape[0])


def _fields(cfg: DenoiserConfig) -> tuple:
    # What the DnCNN's training state depends on: its data, codec, batches and seed, and its own fields.
    return (cfg.gradients, cfg.layout, cfg.side, cfg.unet.multiple, cfg.batch_size, cfg.seed, cfg.dncnn_depth,
            cfg.dncnn_width, cfg.dncnn_steps)


def train(cfg: DenoiserConfig, data_dir: str, workdir: str, progress: Callable | None = None, *, mesh=None,
          log: Callable | None = None, max_steps: int | None = None) -> str:
    """Trains (or resumes from WORKDIR/dncnn_state, `loop.run`) the DnCNN for `cfg.dncnn_steps` steps (or stops
    after `max_steps`); writes and returns `workdir/dncnn`."""
    from pgla_jax.denoise import loop  # the training loop's data and checkpoint imports, only to train

    graphdef, params = nnx.split(DnCNN(cfg.dncnn_depth, cfg.dncnn_width, rngs=nnx.Rngs(cfg.seed)), nnx.Param)
    mask = denoiser_checkpoint.make_codec(cfg).mask()[None]  # [1, H, W, 1]: the real (unpadded) entries
    params, _, _ = loop.run(cfg, data_dir, workdir, params, lambda p, x0, key: loss_fn(graphdef, p, x0, mask, key),
                            optimizer(cfg), state=STATE, seed=cfg.seed + 1, steps=cfg.dncnn_steps, fields=_fields,
                            mesh=mesh, progress=progress, log=log, max_steps=max_steps)
    out = os.path.join(workdir, "dncnn")
    denoiser_checkpoint.save(out, denoiser_checkpoint.to_pure(params), cfg, kind=KIND, overwrite=True)
    return out


def restore(path: str) -> tuple[DnCNN, DenoiserConfig]:
    tree, cfg, _ = denoiser_checkpoint.load(path, KIND)
    model = nnx.eval_shape(lambda: DnCNN(cfg.dncnn_depth, cfg.dncnn_width, rngs=nnx.Rngs(0)))  # overwritten below
    denoiser_checkpoint.load_pure(model, tree)
    return model, cfg
