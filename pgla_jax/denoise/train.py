"""Training the gradient diffusion model: ε-prediction with the Huber loss on clean surrogate gradients.

One jitted step (data-parallel: the batch is sharded over the mesh's `batch` axes, parameters replicated), optax
Adam with warm-up + cosine decay and gradient clipping, an EMA of the weights (what is saved as the denoiser), and a
resumable training state written every `checkpoint_every` steps. Every random draw of step s comes from
`fold_in(key(seed), s)` and batch s from a seeded per-epoch permutation, so a resumed run is the same run.

Multi-host (`configs.sharding.initialize_distributed`, then `train` on every process with a mesh over every host's
devices): each host loads only its rows of a batch, and `workdir` must be one folder all hosts see (the checkpoints
are written by every host together, `configs.checkpoint.save`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from configs import sharding
from pgla_jax.config import DenoiserConfig
from pgla_jax.denoise import ddpm, denoiser_checkpoint, gradients
from pgla_jax.denoise.unet import UNet

STATE_KIND = "pgla-denoiser-state"
EMA_DECAY = 0.99


def optimizer(cfg: DenoiserConfig) -> optax.GradientTransformation:
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, min(50, cfg.steps // 10 + 1), cfg.steps, cfg.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(sched))


def loss_fn(graphdef, params, x0, mask, key, cfg: DenoiserConfig, sched: ddpm.Schedule):
    """Huber(ε̂(x_t, t[, c]), ε) on the real entries; conditional models see c = √n·(x_0 + σz) (σ log-uniform),
    zeroed for a `cond_dropout` fraction of the batch (those examples train the unconditional model)."""
    b = x0.shape[0]
    kt, ke, ks, kz, kd = jax.random.split(key, 5)
    t = ddpm.sample_t(kt, b, sched.timesteps, cfg.focus_t, cfg.focus_prob)
    eps = jax.random.normal(ke, x0.shape)
    x_t = ddpm.q_sample(sched, x0, t, eps)
    cond = None
    if cfg.unet.cond_channels:
        shape = (b,) + (1,) * (x0.ndim - 1)
        sigma = jnp.exp(jax.random.uniform(ks, shape, minval=jnp.log(1e-4), maxval=jnp.log(cfg.cond_max_std)))
        cond = jnp.sqrt(ddpm.signal_fraction(sigma)) * (x0 + sigma * jax.random.normal(kz, x0.shape))
        cond = jnp.where(jax.random.uniform(kd, shape) < cfg.cond_dropout, 0.0, cond)
    eps_hat = nnx.merge(graphdef, params)(x_t, t, cond)
    return ddpm.huber_loss(eps_hat, eps, mask)


def _diffusion_fields(cfg: DenoiserConfig) -> DenoiserConfig:
    # The DnCNN baseline's and the Gaussian prior's fields do not touch the diffusion training state.
    return dataclasses.replace(cfg, dncnn_depth=0, dncnn_width=0, dncnn_steps=0, prior_rank=0)


def train(cfg: DenoiserConfig, data_dir: str, workdir: str, *, progress: Callable | None = None,
          mesh=None, log: Callable | None = None, max_steps: int | None = None, extend: bool = False) -> str:
    """Trains (or resumes) in `workdir`; returns the path of the final denoiser checkpoint `workdir/denoiser`.

    `max_steps`: stop after this many steps of the configured run (its learning-rate schedule unchanged) and write
    the denoiser from the EMA weights there; rerunning without it resumes towards `cfg.steps`.
    `extend`: the state in `workdir` may come from the same config with fewer `steps`; training goes on from its
    weights and optimiser state towards `cfg.steps`, the cosine schedule stretched to the new length (a warm restart:
    the learning rate jumps back to the new schedule's value at the saved step).
    """
    codec = denoiser_checkpoint.make_codec(cfg)
    src, size = gradients.source(data_dir)
    if size != codec.size:
        raise ValueError(f"data set gradients have {size} entries, the config's victim {codec.size}")
    sched = ddpm.linear_schedule(cfg.diffusion)
    mesh = sharding.make_mesh(data=-1) if mesh is None else mesh
    if cfg.batch_size % mesh.shape["data"]:
        raise ValueError(f"batch size {cfg.batch_size} is not a multiple of the {mesh.shape['data']} data shards")
    model = UNet(cfg.unet, rngs=nnx.Rngs(cfg.seed))
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optimizer(cfg)
    opt_state, ema, step0 = opt.init(params), params, 0

    state_dir = os.path.join(workdir, "state")
    if os.path.isdir(state_dir):
        tree, saved_cfg, _ = denoiser_checkpoint.load(state_dir, STATE_KIND)
        step0 = int(tree["step"])
        same = _diffusion_fields(saved_cfg) == _diffusion_fields(cfg)
        longer = extend and _diffusion_fields(dataclasses.replace(saved_cfg, steps=cfg.steps)) == _diffusion_fields(cfg)
        if not (same or longer):
            hint = "" if extend else " (or --extend it to more --steps)"
            raise ValueError(f"{state_dir} was written with another config; use a new --workdir{hint}")
        if extend and not same and cfg.steps <= step0:  # a finished extended run just resumes (a no-op)
            raise ValueError(f"{state_dir} is at step {step0}; --extend needs --steps above that, got {cfg.steps}")
        params, ema = _restored(graphdef, params, tree["params"]), _restored(graphdef, params, tree["ema"])
        leaves, treedef = jax.tree.flatten(opt_state)
        opt_state = jax.tree.unflatten(treedef, [jnp.asarray(tree["opt"][f"{i:05d}"]) for i in range(len(leaves))])

    mask = codec.mask()

    @jax.jit
    def step_fn(params, opt_state, ema, x0, step):
        key = jax.random.fold_in(jax.random.key(cfg.seed), step)
        loss, g = jax.value_and_grad(lambda p: loss_fn(graphdef, p, x0, mask, key, cfg, sched))(params)
        updates, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: EMA_DECAY * e + (1 - EMA_DECAY) * p, ema, params)
        return params, opt_state, ema, loss

    def save_state(step):
        leaves = jax.tree.leaves(opt_state)
        tree = {"params": denoiser_checkpoint.to_pure(params), "ema": denoiser_checkpoint.to_pure(ema),
                "step": np.asarray(step, np.int64),
                "opt": {f"{i:05d}": leaf for i, leaf in enumerate(leaves)}}
        denoiser_checkpoint.save(state_dir, tree, cfg, kind=STATE_KIND, overwrite=True)

    n = len(src)
    encode = jax.jit(jax.vmap(lambda v: codec.encode(codec.unflatten(v))))
    with sharding.use(mesh, "train"):
        repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        params, opt_state, ema = jax.tree.map(lambda x: sharding.place(x, repl), (params, opt_state, ema))
        stop = cfg.steps if max_steps is None else min(cfg.steps, max_steps)
        x_shape = (cfg.batch_size, *codec.shape)
        x_where = sharding.named_sharding(("batch",) + (None,) * len(codec.shape), x_shape)
        rows = sharding.process_rows(x_where, x_shape)  # each host reads and encodes only its rows of a batch
        for step in range(step0, stop):
            idx = gradients.batch_indices(step, cfg.batch_size, n, cfg.seed)[rows]
            x0 = np.asarray(encode(jnp.asarray(np.stack([src[int(i)] for i in idx]))))  # this host's rows
            x0 = jax.make_array_from_process_local_data(x_where, x0, x_shape)
            params, opt_state, ema, loss = step_fn(params, opt_state, ema, x0, step)
            progress and progress(float(loss))
            if log and (step % 50 == 0 or step == cfg.steps - 1):
                log(f"step {step} loss {float(loss):.5f}")
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == stop:
                save_state(step + 1)
        done = max(step0, stop)
    out = os.path.join(workdir, "denoiser")
    denoiser_checkpoint.save(out, denoiser_checkpoint.to_pure(ema), cfg, overwrite=True,
               provenance={"steps": done, "ema_decay": EMA_DECAY, "data": os.path.abspath(data_dir)})
    return out


def saved_step(workdir: str) -> int:
    """The step of the training state saved in `workdir` (0 when there is none): where a rerun resumes."""
    state_dir = os.path.join(workdir, "state")
    return int(denoiser_checkpoint.load(state_dir, STATE_KIND)[0]["step"]) if os.path.isdir(state_dir) else 0


def _restored(graphdef, like, tree):
    module = nnx.merge(graphdef, like, copy=True)  # without the copy, a second restore overwrites the first
    denoiser_checkpoint.load_pure(module, tree)
    return nnx.state(module, nnx.Param)

