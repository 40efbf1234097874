"""SAGE's one training loop: draft distillation (`train`: EAGLE heads, LM drafts) and the home VLM's stages
(`stage`: its tower, align and draft-head stages) all run through `run`.

`run` trains `params` on `loss(params, frozen, batch) -> (loss, metrics)`, one jitted step that takes the frozen
inputs (the target's parts) as an argument, never as constants. Batch i is a function of i alone, and an Orbax
`CheckpointManager` in DIRECTORY/ckpt keeps params, optimizer state and step (+ the data position with
`data_position`) every `ckpt_every` steps and where the run stops, so a rerun resumes from the latest checkpoint
with the losses and weights of an uninterrupted run, bit for bit::

    DIRECTORY/ckpt/<step>/    {"params", "opt_state", "step"[, "data_index"]}, the last two checkpoints kept
    DIRECTORY/losses.json     with `record`: {step: loss} of every step so far (resumed runs included)
    DIRECTORY/evals.json      with `record`: {step: held-out evaluation}

A run stops at `steps`, at `stop_at` (an interruption, simulated) or after the first step that ends past
`deadline` (a `time.monotonic()` value: e.g. the end of a job's time allowance), checkpointed there. It shows a
tqdm bar, or without one writes a log line every 10 · `log_every` steps; it evaluates on held-out data every
`eval_every` steps and at the last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from configs import checkpoint, cli, sharding
from sage_jax.training import data as ddata
from sage_jax.training.objectives import Task
from sage_jax.training.recipe import TrainConfig


class Settings(Protocol):
    """What the loop reads of a training config (`recipe.TrainConfig`, `vlm_recipe.StageConfig`)."""

    steps: int
    lr: float
    warmup: int
    weight_decay: float
    clip: float
    ckpt_every: int
    eval_every: int


@dataclasses.dataclass
class Result:
    params: dict  # the trained parameters, as numpy
    step: int  # the step the run stopped at
    losses: dict[int, float]  # step -> loss of that step (this process's steps only)
    evals: dict[int, Any]  # step -> held-out evaluation (this process's evaluations only)
    seconds: float
    first_step_seconds: float = 0.0  # this run's first step, its compile included
    step_seconds: float = 0.0  # the mean of its later steps (held-out evaluations and checkpoints included)


def optimizer(c: Settings, labels=None, scales: dict[str, float] | None = None) -> optax.GradientTransformation:
    """Global-norm clipping at `c.clip`, then AdamW on a warm-up + cosine schedule down to 5% of `c.lr`. With
    `labels` (the params' tree of group names) and `scales` (group -> learning-rate factor): one AdamW per group."""

    def adamw(scale: float) -> optax.GradientTransformation:
        lr = optax.warmup_cosine_decay_schedule(0.0, c.lr * scale, max(1, min(c.warmup, c.steps - 1)),
                                                max(c.steps, 2), end_value=c.lr * scale * 0.05)
        return optax.adamw(lr, weight_decay=c.weight_decay)

    inner = adamw(1.0) if labels is None else optax.multi_transform({k: adamw(v) for k, v in scales.items()}, labels)
    return optax.chain(optax.clip_by_global_norm(c.clip), inner)


def log_line(msg: str) -> None:
    """Writes `msg` above any progress bar: the training log's default."""
    tqdm.write(msg)


def read_json(path: str, default):
    if not os.path.isfile(path):
        return default
    with open(path) as f:
        return json.load(f)


def write_json(path: str, obj) -> None:
    """Writes `obj` to `path` whole or not at all (a file beside it, then renamed)."""
    with cli.written(path) as f:
        json.dump(obj, f, indent=1)


def replicate(tree, mesh):
    """Every array of `tree` whole on every device of `mesh`."""
    return jax.tree.map(
        lambda x: jax.device_put(x, sharding.named_sharding((None,) * np.ndim(x), np.shape(x), mesh)), tree)


def run(name: str, c: Settings, params, loss: Callable, batch: Callable[[int], dict], directory: str, *,
        opt: optax.GradientTransformation | None = None, frozen=None,
        evaluate: Callable[[Any, int], Any] | None = None, eval_label: str = "held-out", mesh=None,
        put: Callable[[dict], dict] | None = None, data_position: bool = False, record: bool = False,
        log_every: int = 1, tokens: Callable[[dict], int] | None = None, stop_at: int | None = None,
        deadline: float | None = None, progress: bool = True, log: Callable[[str], None] | None = None) -> Result:
    """Trains (or resumes from DIRECTORY/ckpt) `params` on `loss(params, frozen, batch)` for `c.steps` steps
    (module docstring). `batch(i)`: the i-th batch (i the step, or with `data_position` the data position saved
    in the checkpoint). `opt`: the optimizer (default `optimizer(c)`). `evaluate(params, step)`: a held-out
    evaluation, logged after `eval_label`. `mesh`: params and `frozen` replicated on it, each batch placed by
    `put`, under its training rules (without: the default device). `tokens(batch)`: the tokens a batch holds,
    for a tokens/s figure. `record`: losses.json and evals.json in `directory`."""
    log = log or log_line
    opt = opt or optimizer(c)
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    stop = c.steps if stop_at is None else min(stop_at, c.steps)
    mngr = checkpoint.step_manager(os.path.join(directory, "ckpt"))
    t_start = time.perf_counter()
    with sharding.use(mesh, "train") if mesh is not None else contextlib.nullcontext():
        if mesh is not None:
            params, frozen = replicate(params, mesh), replicate(frozen, mesh)
        state = {"params": params, "opt_state": opt.init(params), "step": jnp.zeros((), jnp.int32)}
        if data_position:
            state["data_index"] = jnp.zeros((), jnp.int32)
        latest = mngr.latest_step()
        if latest is not None:
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
            restored = checkpoint.restore_step(mngr, latest, ocp.args.StandardRestore(abstract))
            state = jax.tree.unflatten(jax.tree.structure(state), jax.tree.leaves(restored))
        step0 = int(state["step"])
        index0 = int(state["data_index"]) if data_position else step0
        files = {k: os.path.join(directory, f"{k}.json") for k in ("losses", "evals")}
        recorded = {"losses": {k: v for k, v in read_json(files["losses"], {}).items() if int(k) < step0},
                    "evals": read_json(files["evals"], {})} if record else {}

        @jax.jit
        def step_fn(params, opt_state, frozen, batch):
            (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, frozen, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value, metrics

        params, opt_state = state["params"], state["opt_state"]
        losses: dict[int, float] = {}
        evals: dict[int, Any] = {}
        bar = tqdm(range(step0, stop), initial=step0, total=c.steps, desc=name, disable=not progress,
                   dynamic_ncols=True)
        seen, t0 = 0, time.perf_counter()
        t_first = t0
        for step in bar:
            b = batch(index0 + step - step0)
            seen += tokens(b) if tokens else 0
            params, opt_state, value, metrics = step_fn(params, opt_state, frozen, put(b) if put else b)
            losses[step] = float(value)
            if step == step0:
                t_first = time.perf_counter()
            done = step + 1
            if deadline is not None and done < stop and time.monotonic() >= deadline:
                log(f"[{name}] deadline reached at step {done}/{c.steps}")
                stop = done
            if done % log_every == 0 or done == stop:
                shown = {"loss": f"{losses[step]:.4f}"}
                if "acc" in metrics:
                    shown["acc"] = f"{float(metrics['acc']):.3f}"
                if tokens:
                    shown["tok_s"] = f"{seen / (time.perf_counter() - t0):.0f}"
                if progress:
                    bar.set_postfix(**shown)
                elif done % (10 * log_every) == 0 or done == stop:
                    log(f"[{name}] step {done}/{c.steps}: " + ", ".join(f"{k} {v}" for k, v in shown.items()))
            if evaluate is not None and c.eval_every and (done % c.eval_every == 0 or done == c.steps):
                evals[done] = evaluate(params, done)
                got = f"{evals[done]:.4f}" if isinstance(evals[done], float) else evals[done]
                log(f"[{name}] step {done}: loss {losses[step]:.4f}, {eval_label} {got}")
                if record:
                    recorded["evals"][str(done)] = evals[done]
                    write_json(files["evals"], recorded["evals"])
            if done % c.ckpt_every == 0 or done == stop:
                saved = {"params": params, "opt_state": opt_state, "step": jnp.asarray(done, jnp.int32)}
                if data_position:
                    saved["data_index"] = jnp.asarray(index0 + done - step0, jnp.int32)
                mngr.save(done, args=ocp.args.StandardSave(saved), force=True)
                checkpoint.seal_step(mngr, done)
                if record:  # the losses up to a checkpoint, once it is written
                    write_json(files["losses"], {**recorded["losses"], **{str(k): v for k, v in losses.items()}})
            if done == stop:
                break
        bar.close()
        mngr.wait_until_finished()
    mngr.close()
    params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)
    n = len(losses)
    timing = {} if not n else {"first_step_seconds": t_first - t0,
                               "step_seconds": (time.perf_counter() - t_first) / max(n - 1, 1)}
    return Result(params=params, step=max(stop, step0), losses=losses, evals=evals,
                  seconds=time.perf_counter() - t_start, **timing)


def saved_steps(directory: str) -> list[int]:
    """The steps of the training checkpoints in DIRECTORY/ckpt (none there: [])."""
    path = os.path.join(os.path.abspath(directory), "ckpt")
    if not os.path.isdir(path):
        return []
    with checkpoint.step_manager(path, read_only=True) as mngr:
        return list(mngr.all_steps())


def saved_params(directory: str, step: int, params, opt: optax.GradientTransformation, *,
                 data_position: bool = False) -> dict:
    """The params of training checkpoint `step` in DIRECTORY/ckpt, read while or after `run` trains (`params` and
    `opt`: the run's initial params and optimizer, which give the checkpoint's structure)."""
    state = {"params": params, "opt_state": opt.init(params), "step": np.zeros((), np.int32)}
    if data_position:
        state["data_index"] = np.zeros((), np.int32)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    path = os.path.join(os.path.abspath(directory), "ckpt")
    with checkpoint.step_manager(path, read_only=True) as mngr:
        return mngr.restore(step, args=ocp.args.StandardRestore(abstract))["params"]


def stage(name: str, c: Settings, params, loss: Callable, batch: Callable[[int], dict], workdir: str,
          **kw) -> Result:
    """`run` as stage `name` of a recipe of several (the home VLM's): WORKDIR/name/ckpt/ with the stage's
    losses.json and evals.json beside it (the recipe's loss plot reads them), batch s drawn for step s, and
    without a progress bar a log line every 50 steps."""
    return run(name, c, params, loss, batch, os.path.join(workdir, name), record=True, log_every=5, **kw)


# ---------------------------------------------------------------------------------------------------------------
# Draft distillation on a data set.
# ---------------------------------------------------------------------------------------------------------------

_BATCH_AXES = {"tokens": ("batch", "seq"), "features": ("batch", "seq", None), "hidden": ("batch", "seq", None),
               "top": ("batch", "seq"), "lengths": ("batch",), "answer_start": ("batch",), "kind": ("batch",)}


def put_batch(batch: dict) -> dict:
    """A batch of `data.py` rows cut over the current mesh's `batch` axes (cached float16 features widened: the
    step computes in float32)."""
    def put(v):
        v = np.asarray(v)
        return v.astype(np.float32) if v.dtype == np.float16 else v
    return {k: jax.device_put(put(v), sharding.named_sharding(_BATCH_AXES[k], np.shape(v))) for k, v in batch.items()}


def evaluate(task: Task, params, fz, heldout: dict[str, np.ndarray], batch_size: int, *, max_batches: int = 0,
             agree_fn=None) -> float:
    """Held-out teacher-forced top-1 agreement over the answer positions (under the mesh `params` are on)."""
    agree_fn = agree_fn or jax.jit(task.agreement)
    ds = ddata.eval_batches(heldout, batch_size)
    n = len(ds) if not max_batches else min(len(ds), max_batches)
    hits = total = 0
    for i in range(n):
        h, c = agree_fn(params, fz, put_batch(ds[i]))
        hits += int(h)
        total += int(c)
    return hits / max(total, 1)


def initial_acceptance(task: Task, params, fz, heldout, batch_size: int, mesh=None) -> float:
    """`evaluate` before training, on `mesh` (default: every device, data-parallel)."""
    mesh = sharding.make_mesh() if mesh is None else mesh
    with sharding.use(mesh, "train"):
        return evaluate(task, replicate(params, mesh), replicate(fz, mesh), heldout, batch_size)


def train(task: Task, params: dict, fz: dict, train_data: dict[str, np.ndarray], heldout: dict[str, np.ndarray],
          tc: TrainConfig, workdir: str, *, mesh=None, stop_at: int | None = None, progress: bool = True,
          log: Callable[[str], None] | None = None, deadline: float | None = None) -> Result:
    """Distils `task`'s draft (or resumes it from WORKDIR/ckpt) with the frozen target parts `fz` on `train_data`,
    seeded batches of `data.batches` whose position the checkpoints keep, data-parallel over `mesh` (default:
    every device); held-out agreement on `heldout` every `tc.eval_every` steps. `stop_at` / `deadline`: `run`."""
    mesh = sharding.make_mesh() if mesh is None else mesh
    ds = ddata.batches(train_data, tc.batch_size, seed=tc.seed)
    n_rows = len(ddata.source(train_data))
    if n_rows < tc.batch_size:
        raise ValueError(f"{n_rows} training rows < batch size {tc.batch_size}")
    fz = replicate(fz, mesh)
    agree_fn = jax.jit(task.agreement)
    return run(task.name, tc, params, task.loss, lambda i: ds[i], workdir, frozen=fz,
               evaluate=lambda p, _: evaluate(task, p, fz, heldout, tc.batch_size, agree_fn=agree_fn),
               eval_label="held-out acceptance (teacher-forced top-1)", mesh=mesh, put=put_batch, data_position=True,
               log_every=tc.log_every, tokens=lambda b: int(np.sum(b["lengths"])), stop_at=stop_at,
               deadline=deadline, progress=progress, log=log)
