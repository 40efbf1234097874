"""The learned part of the prior's denoiser: an MLP in the Gaussian prior's eigenbasis that adds a correction to what
the prior's reverse process returns (the `prior_refined` denoiser row).

With the closed-form ε-model (`prior.py`) every reverse step is affine and acts on each layer's eigen-directions one
by one, so from t* the prior's DDIM returns μ + U·diag(γ(σ))·Uᵀ(y − μ) + (a scalar times the rest of y − μ): a
linear filter (`Denoisers.prior_gains` reads γ off it). What it cannot do is anything a Gaussian does not know:
cross-layer structure, and directions the surrogate data rarely shows. The refiner reads the observation's
coefficients c = Uᵀ(y − μ) (each over its expected std √(λ + σ²)) and log σ, and returns a correction Δc in units of
σ; the denoised gradient is the prior's output plus U·Δc. Its output layers start at zero, so an untrained refiner
is the prior itself: the learned part can only add to the analytic one.

Training needs no reverse process: the prior's output is γ(σ)·c_y, so each step draws fresh noise at a level of the
grid (`RefinerConfig.noises` × `epsilons`, paper calibration) for a batch of clean surrogate gradients and fits
γ·c_y + σ·Δc to the clean coefficients (squared error, the gradient's own, over what the prior leaves at that
level: 1 is the prior, 0 the clean gradient). The noise is drawn in the eigenbasis as
Gaussian with the level's std: Laplace noise projected on a layer's dense directions is close to that. The clean
gradients are the surrogate's with half of the images varied (`gradients.augment`): fitted on Fashion-MNIST alone,
the learned part helps on Fashion-MNIST and not on MNIST digits; on both kinds of image it holds on digits too.

Resumable like the U-Net's loop: WORKDIR/refiner_state/<step> keeps {params, opt_state} every `checkpoint_every`
steps with the config; WORKDIR/refiner is the result (the project's checkpoint format, kind `KIND`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jaxtyping import Array, Float

from configs import checkpoint, sharding
from pgla_jax import protections
from pgla_jax.config import DenoiserConfig, ProtectionConfig, RefinerConfig
from pgla_jax.denoise import ddpm, gradients, loop
from pgla_jax.denoise.prior import GaussianPrior

KIND = "pgla-prior-refiner"
#: The refiner's training state and its own gradient data set, in the work directory.
STATE = "refiner_state"
DATA = "refiner_gradients"


def coefficients(gp: GaussianPrior, flat: Float[Array, "B P"]) -> Float[Array, "B C"]:
    """Each layer's top-K coefficients of `flat` − μ (flat real entries; trailing padding ignored), layers in turn."""
    r = flat[:, : gp.size] - gp.mean[None]
    return jnp.concatenate([r[:, lo:hi] @ u for (lo, hi), u in zip(gp.bounds, gp.vecs, strict=True)], axis=1)


def expand(gp: GaussianPrior, c: Float[Array, "B C"]) -> Float[Array, "B P"]:
    """The flat vector whose coefficients are `c` and whose rest is zero (no mean added)."""
    out, k = [], 0
    for u in gp.vecs:
        out.append(c[:, k : k + u.shape[1]] @ u.T)
        k += u.shape[1]
    return jnp.concatenate(out, axis=1)


def variances(gp: GaussianPrior) -> Float[Array, " C"]:
    """λ of every coefficient, layers in turn."""
    return jnp.concatenate(gp.vals)


class Refiner(nnx.Module):
    """Δc = skip(x) + MLP([x, log σ]) with x = c / √(λ + σ²); skip and the MLP's last layer start at zero."""

    def __init__(self, size: int, hidden: int, *, rngs: nnx.Rngs):
        zeros = nnx.initializers.zeros
        self.inp = nnx.Linear(size + 1, hidden, rngs=rngs)
        self.mid = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, size, kernel_init=zeros, bias_init=zeros, rngs=rngs)
        self.skip = nnx.Linear(size, size, use_bias=False, kernel_init=zeros, rngs=rngs)

    def __call__(self, c: Float[Array, "B C"], lam: Float[Array, " C"], sigma: Float[Array, " B"]
                 ) -> Float[Array, "B C"]:
        x = c / jnp.sqrt(lam[None] + sigma[:, None] ** 2)
        h = jax.nn.gelu(self.inp(jnp.concatenate([x, jnp.log(sigma)[:, None]], axis=1)))
        h = jax.nn.gelu(self.mid(h))
        return sigma[:, None] * (self.skip(x) + self.out(h))


def correction(model: Refiner, gp: GaussianPrior, flat_y: Float[Array, "B P"], sigma: Float[Array, " B"]
               ) -> Float[Array, "B P"]:
    """What the refiner adds to the prior's output for observations `flat_y` at effective noise std `sigma`."""
    return expand(gp, model(coefficients(gp, flat_y), variances(gp), sigma))


def levels(cfg: RefinerConfig, gains: Callable[[float], np.ndarray], second: np.ndarray) -> dict[str, np.ndarray]:
    """The training grid: per (noise, ε) the noise's std, its effective std (what the prior starts from), the
    prior's gains γ there (`gains(σ_eff)`: `Denoisers.prior_gains`) and the prior's own expected squared error
    Σ (γ − 1)²·E[c²] + γ²·std² (`second`: E[c²] of the clean coefficients). Levels whose noise is below the
    schedule's first step are left out: the denoiser returns the observation there, the refiner never runs."""
    std, eff, gam, err = [], [], [], []
    for noise in cfg.noises:
        for eps in cfg.epsilons:
            plan = protections.plan(dataclasses.replace(ProtectionConfig(), noise=noise, calibration="paper"), eps, 1)
            sigma = float(ddpm.effective_sigma(plan.noise, plan.scale))
            g = np.asarray(gains(sigma), np.float32)
            if np.all(g == 1.0):
                continue
            std.append(plan.std)
            eff.append(sigma)
            gam.append(g)
            err.append(float(np.sum((g - 1.0) ** 2 * second + g**2 * plan.std**2)))
    if not std:
        raise ValueError("no level of the refiner's grid is above the schedule's first step")
    return {"std": np.asarray(std, np.float32), "eff": np.asarray(eff, np.float32), "gain": np.stack(gam),
            "err": np.asarray(err, np.float32)}


def train(cfg: DenoiserConfig, gp: GaussianPrior, gains: Callable[[float], np.ndarray], data_dir: str, workdir: str,
          *, progress: Callable | None = None, provenance: dict | None = None,
          mesh: jax.sharding.Mesh | None = None) -> str:
    """Trains the refiner of `gp` on the clean gradients in `data_dir` (`gradients.build` of
    `cfg.refiner.gradients`), resuming from WORKDIR/refiner_state; saves WORKDIR/refiner and returns its path.
    `progress(loss)` after every step; `provenance` joins the checkpoint's. ValueError (one line) for a state
    written with another config. It trains on one device of each process; in a job of several processes (each
    training the same refiner) every checkpoint is saved from one copy replicated over `mesh`, as the checkpointer
    takes only arrays that span the job."""
    rc = cfg.refiner
    src, size = gradients.source(data_dir)
    if size != gp.size:
        raise ValueError(f"{data_dir} holds gradients of {size} entries; the prior's victim has {gp.size}")
    pool = jnp.concatenate([coefficients(gp, jnp.asarray(np.stack([src[i] for i in range(s, min(s + 1024, len(src)))])))
                            for s in range(0, len(src), 1024)])
    grid = {k: jnp.asarray(v) for k, v in levels(rc, gains, np.asarray(jnp.mean(pool**2, axis=0))).items()}
    lam = variances(gp)
    model = Refiner(pool.shape[1], rc.hidden, rngs=nnx.Rngs(rc.seed))
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.adamw(optax.cosine_decay_schedule(rc.lr, rc.steps), weight_decay=rc.weight_decay)
    opt_state = opt.init(params)
    # What the state depends on: the refiner's own fields and the prior's (the U-Net's and DnCNN's may change).
    want = checkpoint.config_to_json(dataclasses.replace(
        DenoiserConfig(), gradients=cfg.gradients, prior_rank=cfg.prior_rank, refiner=rc))
    path = os.path.join(os.path.abspath(workdir), STATE)
    start = 0
    with loop.manager(path) as mngr:
        if mngr.latest_step() is not None:
            start = mngr.latest_step()
            saved = checkpoint.restore_step(mngr, start, ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
            if saved != want:
                raise ValueError(f"{path} holds a refiner trained with another config; use another --workdir")
            abstract = {"params": params, "opt_state": opt_state}
            restored = checkpoint.restore_step(
                mngr, start, ocp.args.Composite(state=ocp.args.StandardRestore(abstract)), verify=False)
            params, opt_state = restored["state"]["params"], restored["state"]["opt_state"]

        def loss_fn(p, cg, lv, noise):
            cy = cg + grid["std"][lv][:, None] * noise
            sigma = grid["eff"][lv]
            pred = grid["gain"][lv] * cy + nnx.merge(graphdef, p)(cy, lam, sigma)
            # Each level's error over the prior's own there: the share of what the prior leaves that is removed,
            # so that every level counts alike (in absolute terms the noisiest would drown the others).
            return jnp.mean(jnp.sum((pred - cg) ** 2, axis=1) / grid["err"][lv])

        @jax.jit
        def step_fn(p, s, idx, k):
            k_lv, k_n = jax.random.split(k)
            cg = pool[idx]
            lv = jax.random.randint(k_lv, (idx.shape[0],), 0, grid["std"].shape[0])
            loss, g = jax.value_and_grad(loss_fn)(p, cg, lv, jax.random.normal(k_n, cg.shape))
            upd, s = opt.update(g, s, p)
            return optax.apply_updates(p, upd), s, loss

        key = jax.random.key(rc.seed)
        for step in range(start, rc.steps):
            idx = jnp.asarray(gradients.batch_indices(step, rc.batch_size, pool.shape[0], rc.seed))
            params, opt_state, loss = step_fn(params, opt_state, idx, jax.random.fold_in(key, step))
            progress and progress(float(loss))
            if (step + 1) % rc.checkpoint_every == 0 or step + 1 == rc.steps:
                state = {"params": params, "opt_state": opt_state}
                if jax.process_count() > 1:
                    repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
                    state = jax.tree.map(functools.partial(sharding.place, where=repl), state)
                mngr.save(step + 1, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(want)))
                checkpoint.seal_step(mngr, step + 1)
        mngr.wait_until_finished()
    out = os.path.join(os.path.abspath(workdir), "refiner")
    return save(out, nnx.to_pure_dict(params), cfg, overwrite=True,
                provenance={"steps": rc.steps, "gradients": int(pool.shape[0]), "data": os.path.abspath(data_dir),
                            **(provenance or {})})


def save(path: str, params: dict, cfg: DenoiserConfig, *, overwrite: bool = False, provenance=None) -> str:
    """Saves refiner parameters (float16: the correction is a small fraction of the gradient) with the config."""
    tree = jax.tree.map(lambda a: np.asarray(a, np.float16), params)
    return checkpoint.save(path, tree, config=cfg, kind=KIND, provenance=provenance, overwrite=overwrite)


def sibling(prior_path: str) -> str:
    """Where a prior checkpoint's refiner lives: `…/refiner` beside `…/prior`."""
    return os.path.join(os.path.dirname(os.path.abspath(prior_path)), "refiner")


def load(path: str, gp: GaussianPrior) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) of the refiner saved at `path` for prior `gp`; `CheckpointError` / ValueError (one line)
    when it is not one or does not fit the prior."""
    meta = checkpoint.read_metadata(path)
    if meta.get("kind") != KIND:
        raise checkpoint.CheckpointError(f"{path} is a {meta.get('kind')!r} checkpoint, not a {KIND!r} one")
    hidden = int(meta["config"]["refiner"]["hidden"])
    size = int(variances(gp).shape[0])
    model = nnx.eval_shape(lambda: Refiner(size, hidden, rngs=nnx.Rngs(0)))
    graphdef, abstract = nnx.split(model, nnx.Param)
    tree = checkpoint.restore(path)
    want = jax.tree.map(lambda a: a.shape, nnx.to_pure_dict(abstract))
    if jax.tree.map(lambda a: tuple(np.shape(a)), tree) != want:
        raise ValueError(f"refiner {path} does not fit the prior's {size} coefficients")
    nnx.replace_by_pure_dict(abstract, jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree))
    return graphdef, abstract
