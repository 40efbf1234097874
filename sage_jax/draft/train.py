"""Distillation training of drafts from a frozen target: an EAGLE head and a separate small LM.

Both are trained on the self-distillation data of `data.py` (the target's own greedy answers) against the target's
distributions, recomputed in the step from the stored target features (the target's final norm + LM head are
frozen inputs of the jitted step, never constants):

* EAGLE head: teacher forcing with the target's true features (input at t: f_{t-1}, x_t), loss =
  KL(target ‖ head) + λ · smooth-L1(f̂_t, f_t), averaged with per-position weights (answer positions 1,
  prompt positions `prompt_weight`, padding 0).
* LM draft: a small `Decoder` with the target's vocabulary, loss = KL(target ‖ draft) with the same weights.

With a reduced draft vocabulary both KLs are taken over the subset (the target renormalised on it), as EAGLE-3
does. Held-out "acceptance" = teacher-forced top-1 agreement of draft and target (FULL-vocab target argmax) on
held-out answers. Batches are data-parallel over the mesh of `configs.sharding` (logical names only); Orbax
`CheckpointManager` keeps params + optimizer state + step + data position, so a resumed run continues with the
identical loss sequence.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from configs import sharding
from sage_jax.draft import data as ddata
from sage_jax.draft import eagle
from sage_jax.models import layers, lm
from sage_jax.models.config import LMConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation settings of one draft (static, hashable)."""

    steps: int = 100
    batch_size: int = 8
    lr: float = 1e-3
    warmup: int = 10
    weight_decay: float = 0.0
    clip: float = 1.0
    seed: int = 0
    prompt_weight: float = 0.1
    feature_weight: float = 0.1  # λ (EAGLE head only)
    eval_every: int = 50
    ckpt_every: int = 50
    log_every: int = 1


# ---------------------------------------------------------------------------------------------------------------
# Frozen target parts and losses.
# ---------------------------------------------------------------------------------------------------------------


def frozen_target(target_lm: lm.LM, vocab_ids=None) -> dict:
    """The target's embedding, final norm and head as a pure dict (+ the subset head and ids with `vocab_ids`)."""
    out = {"embed": target_lm.embed, "final_norm": target_lm.final_norm}
    if target_lm.lm_head is not None:
        out["lm_head"] = target_lm.lm_head
    if vocab_ids is not None:
        ids = jnp.asarray(vocab_ids, jnp.int32)
        out["vocab_ids"] = ids
        out["vocab_head"] = (jnp.take(target_lm.embed, ids, axis=0).T if target_lm.lm_head is None
                             else jnp.take(target_lm.lm_head, ids, axis=1))
    return out


def _target_logits(cfg: LMConfig, fz: dict, feats, *, full: bool = False):
    if "vocab_head" in fz and not full:
        return lm.head(cfg, None, fz["final_norm"], fz["vocab_head"], feats)
    return lm.head(cfg, fz["embed"], fz["final_norm"], fz.get("lm_head"), feats)


def position_weights(batch: dict, prompt_weight: float):
    """[B, L] loss weights: 1 from the last prompt token on (it predicts the first answer token), `prompt_weight`
    before, 0 on padding; and the answer mask [B, L] (positions whose next token is in the answer)."""
    length = batch["tokens"].shape[1]
    t = jnp.arange(length)[None]
    start = batch["answer_start"][:, None] - 1
    valid = t < batch["lengths"][:, None]
    answer = valid & (t >= start)
    w = jnp.where(answer, 1.0, jnp.where(valid, prompt_weight, 0.0))
    return w, answer & (t < batch["lengths"][:, None] - 1)


def _kl(target_logits, draft_logits):
    lp_t = jax.nn.log_softmax(target_logits, -1)
    lp_d = jax.nn.log_softmax(draft_logits.astype(jnp.float32), -1)
    return jnp.sum(jnp.exp(lp_t) * (lp_t - lp_d), -1)


def _causal(batch):
    b, length = batch["tokens"].shape
    pos = jnp.broadcast_to(jnp.arange(length), (b, length))
    return pos, layers.causal_mask(length, jnp.zeros((b,), jnp.int32))


def eagle_logits_features(head_cfg: LMConfig, params, fz, batch):
    """Teacher-forced head outputs over the batch: (logits over the subset or full vocab, f̂)."""
    pos, mask = _causal(batch)
    feats = batch["features"]
    prev = eagle.shift_features(feats)
    if "vocab_head" in fz:
        f_hat, _ = eagle.eagle_features(params, head_cfg, fz["embed"], batch["tokens"], prev, pos, mask)
        return lm.head(head_cfg, None, fz["final_norm"], fz["vocab_head"], f_hat), f_hat
    logits, f_hat, _ = eagle.eagle_forward(params, head_cfg, fz["embed"], fz["final_norm"], fz.get("lm_head"),
                                           batch["tokens"], prev, pos, mask)
    return logits, f_hat


def eagle_loss(head_cfg: LMConfig, tc: TrainConfig, params, fz, batch):
    logits, f_hat = eagle_logits_features(head_cfg, params, fz, batch)
    feats = batch["features"]
    t_logits = jax.lax.stop_gradient(_target_logits(head_cfg, fz, feats))
    w, answer = position_weights(batch, tc.prompt_weight)
    kl = _kl(t_logits, logits)
    reg = jnp.mean(optax.huber_loss(f_hat.astype(jnp.float32), feats.astype(jnp.float32), delta=1.0), -1)
    denom = jnp.maximum(jnp.sum(w), 1.0)
    loss = jnp.sum(w * (kl + tc.feature_weight * reg)) / denom
    agree = jnp.argmax(logits, -1) == jnp.argmax(t_logits, -1)
    n_ans = jnp.maximum(jnp.sum(answer), 1)
    return loss, {"kl": jnp.sum(w * kl) / denom, "reg": jnp.sum(w * reg) / denom,
                  "acc": jnp.sum(agree & answer) / n_ans}


def eagle_agreement(head_cfg: LMConfig, params, fz, batch):
    """(agreeing positions, answer positions): draft top-1 (mapped to full ids) vs the target's FULL-vocab top-1."""
    logits, _ = eagle_logits_features(head_cfg, params, fz, batch)
    d_top = jnp.argmax(logits, -1)
    if "vocab_ids" in fz:
        d_top = jnp.take(fz["vocab_ids"], d_top)
    t_top = jnp.argmax(_target_logits(head_cfg, fz, batch["features"], full=True), -1)
    _, answer = position_weights(batch, 0.0)
    return jnp.sum((d_top == t_top) & answer), jnp.sum(answer)


def lm_logits(draft_cfg: LMConfig, params, fz, batch):
    pos, mask = _causal(batch)
    model = lm.serving_params(draft_cfg, params)
    hidden, _ = model.forward(batch["tokens"], pos, mask)
    if "vocab_ids" in fz:
        sub_head = (jnp.take(params["embed"], fz["vocab_ids"], axis=0).T if model.lm_head is None
                    else jnp.take(model.lm_head, fz["vocab_ids"], axis=1))
        return lm.head(draft_cfg, None, model.final_norm, sub_head, hidden)
    return model.head(hidden)


def lm_loss(draft_cfg: LMConfig, tc: TrainConfig, params, fz, batch):
    logits = lm_logits(draft_cfg, params, fz, batch)
    t_logits = jax.lax.stop_gradient(_target_logits(draft_cfg, fz, batch["features"]))
    w, answer = position_weights(batch, tc.prompt_weight)
    kl = _kl(t_logits, logits)
    loss = jnp.sum(w * kl) / jnp.maximum(jnp.sum(w), 1.0)
    agree = jnp.argmax(logits, -1) == jnp.argmax(t_logits, -1)
    return loss, {"kl": loss, "acc": jnp.sum(agree & answer) / jnp.maximum(jnp.sum(answer), 1)}


def lm_agreement(draft_cfg: LMConfig, params, fz, batch):
    d_top = jnp.argmax(lm_logits(draft_cfg, params, fz, batch), -1)
    if "vocab_ids" in fz:
        d_top = jnp.take(fz["vocab_ids"], d_top)
    t_top = jnp.argmax(_target_logits(draft_cfg, fz, batch["features"], full=True), -1)
    _, answer = position_weights(batch, 0.0)
    return jnp.sum((d_top == t_top) & answer), jnp.sum(answer)


# ---------------------------------------------------------------------------------------------------------------
# The loop.
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Task:
    """One draft to train: `loss(params, frozen, batch) -> (loss, metrics)`, `agreement(params, frozen, batch) ->
    (hits, count)`; both pure (closures over static configs only)."""

    name: str
    loss: Callable
    agreement: Callable


def eagle_task(head_cfg: LMConfig, tc: TrainConfig) -> Task:
    return Task("eagle", lambda p, f, b: eagle_loss(head_cfg, tc, p, f, b),
                lambda p, f, b: eagle_agreement(head_cfg, p, f, b))


def lm_task(draft_cfg: LMConfig, tc: TrainConfig) -> Task:
    return Task("lm", lambda p, f, b: lm_loss(draft_cfg, tc, p, f, b),
                lambda p, f, b: lm_agreement(draft_cfg, p, f, b))


@dataclasses.dataclass
class Result:
    params: dict
    step: int
    losses: dict[int, float]  # step -> loss of that step (this process's steps only)
    evals: dict[int, float]  # step -> held-out acceptance
    seconds: float


def optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    sched = optax.warmup_cosine_decay_schedule(0.0, tc.lr, max(1, min(tc.warmup, tc.steps - 1)), max(tc.steps, 2),
                                               end_value=tc.lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(tc.clip), optax.adamw(sched, weight_decay=tc.weight_decay))


_BATCH_AXES = {"tokens": ("batch", "seq"), "features": ("batch", "seq", None), "lengths": ("batch",),
               "answer_start": ("batch",), "kind": ("batch",)}


def _put_batch(batch: dict) -> dict:
    return {k: jax.device_put(np.asarray(v), sharding.named_sharding(_BATCH_AXES[k], np.shape(v)))
            for k, v in batch.items()}


def _replicate(tree):
    return jax.tree.map(lambda x: jax.device_put(x, sharding.named_sharding((None,) * np.ndim(x), np.shape(x))),
                        tree)


def evaluate(task: Task, params, fz, heldout: dict[str, np.ndarray], batch_size: int, *, max_batches: int = 0,
             agree_fn=None) -> float:
    """Held-out teacher-forced top-1 agreement over the answer positions."""
    agree_fn = agree_fn or jax.jit(task.agreement)
    ds = ddata.eval_batches(heldout, batch_size)
    n = len(ds) if not max_batches else min(len(ds), max_batches)
    hits = total = 0
    for i in range(n):
        h, c = agree_fn(params, fz, _put_batch(ds[i]))
        hits += int(h)
        total += int(c)
    return hits / max(total, 1)


def train(task: Task, params: dict, fz: dict, train_data: dict[str, np.ndarray], heldout: dict[str, np.ndarray],
          tc: TrainConfig, workdir: str, *, mesh=None, stop_at: int | None = None, progress: bool = True,
          log: Callable[[str], None] | None = None) -> Result:
    """Trains (or resumes from `workdir`'s latest checkpoint) up to `tc.steps` (or `stop_at`, to simulate an
    interruption). Returns the final params and this run's losses and held-out acceptances."""
    mesh = sharding.make_mesh() if mesh is None else mesh
    log = log or (lambda s: tqdm.write(s))
    opt = optimizer(tc)
    ds = ddata.batches(train_data, tc.batch_size, seed=tc.seed)
    if len(train_data["tokens"]) < tc.batch_size:
        raise ValueError(f"{len(train_data['tokens'])} training rows < batch size {tc.batch_size}")
    stop = tc.steps if stop_at is None else min(stop_at, tc.steps)
    ckpt_dir = os.path.join(os.path.abspath(workdir), "ckpt")
    mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    t_start = time.perf_counter()
    with sharding.use(mesh, "train"):
        params = _replicate(params)
        fz = _replicate(fz)
        state = {"params": params, "opt_state": opt.init(params), "step": jnp.zeros((), jnp.int32),
                 "data_index": jnp.zeros((), jnp.int32)}
        latest = mngr.latest_step()
        if latest is not None:
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
            restored = mngr.restore(latest, args=ocp.args.StandardRestore(abstract))
            state = jax.tree.unflatten(jax.tree.structure(state), jax.tree.leaves(restored))
        step0, index0 = int(state["step"]), int(state["data_index"])

        @jax.jit
        def step_fn(params, opt_state, fz, batch):
            (loss, metrics), grads = jax.value_and_grad(task.loss, has_aux=True)(params, fz, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, metrics

        agree_fn = jax.jit(task.agreement)
        params, opt_state = state["params"], state["opt_state"]
        losses: dict[int, float] = {}
        evals: dict[int, float] = {}
        bar = tqdm(range(step0, stop), initial=step0, total=tc.steps, desc=f"train {task.name}", disable=not progress,
                   dynamic_ncols=True)
        tokens_seen, t0 = 0, time.perf_counter()
        for step in bar:
            batch = ds[index0 + step - step0]
            tokens_seen += int(np.sum(batch["lengths"]))
            params, opt_state, loss, metrics = step_fn(params, opt_state, fz, _put_batch(batch))
            losses[step] = float(loss)
            done = step + 1
            if progress and (done % tc.log_every == 0 or done == stop):
                bar.set_postfix(loss=f"{losses[step]:.4f}", acc=f"{float(metrics['acc']):.3f}",
                                tok_s=f"{tokens_seen / (time.perf_counter() - t0):.0f}")
            if tc.eval_every and (done % tc.eval_every == 0 or done == tc.steps):
                evals[done] = evaluate(task, params, fz, heldout, tc.batch_size, agree_fn=agree_fn)
                log(f"[{task.name}] step {done}: loss {losses[step]:.4f}  held-out acceptance (teacher-forced "
                    f"top-1) {evals[done]:.4f}")
            if done % tc.ckpt_every == 0 or done == stop:
                mngr.save(done, args=ocp.args.StandardSave({
                    "params": params, "opt_state": opt_state, "step": jnp.asarray(done, jnp.int32),
                    "data_index": jnp.asarray(index0 + done - step0, jnp.int32)}), force=True)
        bar.close()
        mngr.wait_until_finished()
    mngr.close()
    params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)
    return Result(params=params, step=max(stop, step0), losses=losses, evals=evals,
                  seconds=time.perf_counter() - t_start)


def initial_acceptance(task: Task, params, fz, heldout, batch_size: int, mesh=None) -> float:
    mesh = sharding.make_mesh() if mesh is None else mesh
    with sharding.use(mesh, "train"):
        return evaluate(task, _replicate(params), _replicate(fz), heldout, batch_size)


def describe(x: Any) -> str:
    return f"{sum(int(np.size(v)) for v in jax.tree.leaves(x)):,} params"
