"""The denoisers' one training loop (`run`), and the gradient diffusion model trained on it (`train`; the DnCNN
baseline's trainer is `dncnn.train`): ε-prediction with the Huber loss on clean surrogate gradients.

One jitted step, data-parallel (the batch is cut over the mesh's `batch` axes, parameters replicated), an optax
optimizer and optionally an EMA of the weights (the diffusion model's saved denoiser). Every random draw of step s
comes from `fold_in(key(seed), s)` and batch s from a seeded per-epoch permutation, so a resumed run is the same
run. An Orbax `CheckpointManager` keeps the training state every `checkpoint_every` steps and where the run stops,
with the config it was trained with; a rerun resumes from the latest one, and refuses a state of another config::

    WORKDIR/state/<step>/state/     {"params", "ema", "opt_state", "step"}: the diffusion model's
    WORKDIR/state/<step>/config/    its `DenoiserConfig` (JSON)
    WORKDIR/dncnn_state/<step>/     the DnCNN's, alike
    WORKDIR/denoiser/               the final denoiser (`denoiser_checkpoint`, the project's format)

Multi-host (`configs.sharding.initialize_distributed`, then `train` on every process with a mesh over every host's
devices): each host loads only its rows of a batch, and `workdir` must be one folder all hosts see (the
checkpoints are written by every host together).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from configs import checkpoint, sharding
from pgla_jax.codec import GradientCodec
from pgla_jax.config import DenoiserConfig, RefinerConfig
from pgla_jax.denoise import ddpm, denoiser_checkpoint, gradients
from pgla_jax.denoise.unet import UNet

EMA_DECAY = 0.99
#: The diffusion model's training state, in the work directory.
STATE = "state"


def manager(path: str, *, read_only: bool = False) -> ocp.CheckpointManager:
    """The Orbax manager of a training state folder: the two newest steps kept."""
    return checkpoint.step_manager(path, read_only=read_only)


def saved_step(workdir: str, state: str = STATE) -> int:
    """The step of the latest training state in WORKDIR/`state` (0 when there is none): where a rerun resumes."""
    path = os.path.join(os.path.abspath(workdir), state)
    if not os.path.isdir(path):
        return 0
    with manager(path, read_only=True) as mngr:
        return mngr.latest_step() or 0


def run(cfg: DenoiserConfig, data_dir: str, workdir: str, params: nnx.State, loss: Callable,
        opt: optax.GradientTransformation, *, state: str, seed: int, steps: int,
        fields: Callable[[DenoiserConfig], Any], steps_field: str | None = None, ema_decay: float | None = None,
        mesh=None, progress: Callable | None = None, log: Callable | None = None, max_steps: int | None = None,
        extend: bool = False) -> tuple[nnx.State, nnx.State | None, int]:
    """Trains `params` on `loss(params, x0, key)` (x0: a batch of encoded gradients of `data_dir`) for `steps` steps,
    or resumes them from WORKDIR/`state`; returns (params, their EMA or None, the step reached).

    `seed`: the keys' and the batch order's. `fields(cfg)`: what of the config the state depends on (a state whose
    config differs there is refused). `max_steps`: stop after this many steps of the run (its schedule unchanged).
    `extend`: the saved state may come from the same config with fewer steps (config field `steps_field`);
    training goes on from it towards `steps` (`train`)."""
    state_dir = os.path.join(os.path.abspath(workdir), state)
    if os.path.isfile(os.path.join(state_dir, checkpoint.METADATA_FILE)):
        raise ValueError(f"{state_dir} holds a training state of the layout before Orbax's CheckpointManager; use a "
                         f"new --workdir")
    codec: GradientCodec = denoiser_checkpoint.make_codec(cfg)
    src, size = gradients.source(data_dir)
    if size != codec.size:
        raise ValueError(f"data set gradients have {size} entries, the config's victim {codec.size}")
    mesh = sharding.make_mesh(data=-1) if mesh is None else mesh
    if cfg.batch_size % mesh.shape["data"]:
        raise ValueError(f"batch size {cfg.batch_size} is not a multiple of the {mesh.shape['data']} data shards")
    mngr = manager(state_dir)
    n = len(src)
    encode = jax.jit(jax.vmap(lambda v: codec.encode(codec.unflatten(v))))

    @jax.jit
    def step_fn(params, opt_state, ema, x0, step):
        key = jax.random.fold_in(jax.random.key(seed), step)
        value, g = jax.value_and_grad(lambda p: loss(p, x0, key))(params)
        updates, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        if ema is not None:
            ema = jax.tree.map(lambda e, p: ema_decay * e + (1 - ema_decay) * p, ema, params)
        return params, opt_state, ema, value

    with sharding.use(mesh, "train"):
        repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        tree = {"params": params, "opt_state": opt.init(params), **({} if ema_decay is None else {"ema": params})}
        tree = {**jax.tree.map(lambda x: sharding.place(x, repl), tree), "step": np.zeros((), np.int32)}
        step0 = mngr.latest_step() or 0
        if step0:
            saved = denoiser_checkpoint.config_from_json(checkpoint.restore_step(
                mngr, step0, ocp.args.Composite(config=ocp.args.JsonRestore()))["config"])
            same = fields(saved) == fields(cfg)
            longer = extend and steps_field is not None and fields(
                dataclasses.replace(saved, **{steps_field: getattr(cfg, steps_field)})) == fields(cfg)
            if not (same or longer):
                hint = "" if extend or steps_field is None else " (or --extend it to more --steps)"
                raise ValueError(f"{state_dir} was written with another config; use a new --workdir{hint}")
            if extend and not same and steps <= step0:  # a finished extended run just resumes (a no-op)
                raise ValueError(f"{state_dir} is at step {step0}; --extend needs --steps above that, got {steps}")
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
            restored = checkpoint.restore_step(
                mngr, step0, ocp.args.Composite(state=ocp.args.StandardRestore(abstract)), verify=False)
            tree = jax.tree.unflatten(jax.tree.structure(tree), jax.tree.leaves(restored["state"]))
        params, opt_state, ema = tree["params"], tree["opt_state"], tree.get("ema")
        stop = steps if max_steps is None else min(steps, max_steps)
        x_shape = (cfg.batch_size, *codec.shape)
        x_where = sharding.named_sharding(("batch",) + (None,) * len(codec.shape), x_shape)
        rows = sharding.process_rows(x_where, x_shape)  # each host reads and encodes only its rows of a batch
        for step in range(step0, stop):
            idx = gradients.batch_indices(step, cfg.batch_size, n, seed)[rows]
            x0 = np.asarray(encode(jnp.asarray(np.stack([src[int(i)] for i in idx]))))  # this host's rows
            x0 = jax.make_array_from_process_local_data(x_where, x0, x_shape)
            params, opt_state, ema, value = step_fn(params, opt_state, ema, x0, step)
            progress and progress(float(value))
            if log and (step % 50 == 0 or step == steps - 1):
                log(f"step {step} loss {float(value):.5f}")
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == stop:
                saved = {"params": params, "opt_state": opt_state, **({} if ema is None else {"ema": ema}),
                         "step": np.asarray(step + 1, np.int32)}
                mngr.save(step + 1, args=ocp.args.Composite(state=ocp.args.StandardSave(saved),
                                                            config=ocp.args.JsonSave(checkpoint.config_to_json(cfg))),
                          force=True)
                checkpoint.seal_step(mngr, step + 1)
        mngr.wait_until_finished()
    mngr.close()
    return params, ema, max(step0, stop)


# ---------------------------------------------------------------------------------------------------------------
# The gradient diffusion model.
# ---------------------------------------------------------------------------------------------------------------


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
    # The DnCNN baseline's, the Gaussian prior's and its refiner's fields do not touch the diffusion training state.
    return dataclasses.replace(cfg, dncnn_depth=0, dncnn_width=0, dncnn_steps=0, prior_rank=0,
                               refiner=RefinerConfig())


def train(cfg: DenoiserConfig, data_dir: str, workdir: str, *, progress: Callable | None = None,
          mesh=None, log: Callable | None = None, max_steps: int | None = None, extend: bool = False) -> str:
    """Trains (or resumes) the diffusion model in `workdir`; returns the path of the final denoiser checkpoint
    `workdir/denoiser` (its EMA weights).

    `max_steps`: stop after this many steps of the configured run (its learning-rate schedule unchanged) and write
    the denoiser from the EMA weights there; rerunning without it resumes towards `cfg.steps`.
    `extend`: the state in `workdir` may come from the same config with fewer `steps`; training goes on from its
    weights and optimiser state towards `cfg.steps`, the cosine schedule stretched to the new length (a warm restart:
    the learning rate jumps back to the new schedule's value at the saved step).
    """
    sched = ddpm.linear_schedule(cfg.diffusion)
    graphdef, params = nnx.split(UNet(cfg.unet, rngs=nnx.Rngs(cfg.seed)), nnx.Param)
    mask = denoiser_checkpoint.make_codec(cfg).mask()
    _, ema, done = run(cfg, data_dir, workdir, params,
                       lambda p, x0, key: loss_fn(graphdef, p, x0, mask, key, cfg, sched), optimizer(cfg),
                       state=STATE, seed=cfg.seed, steps=cfg.steps, fields=_diffusion_fields, steps_field="steps",
                       ema_decay=EMA_DECAY, mesh=mesh, progress=progress, log=log, max_steps=max_steps,
                       extend=extend)
    out = os.path.join(workdir, "denoiser")
    denoiser_checkpoint.save(out, denoiser_checkpoint.to_pure(ema), cfg, overwrite=True,
                             provenance={"steps": done, "ema_decay": EMA_DECAY, "data": os.path.abspath(data_dir)})
    return out
