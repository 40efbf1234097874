"""The objectives of draft distillation from a frozen target: an EAGLE head and a separate small LM.

Both are trained on the self-distillation data of `data.py` (the target's own greedy answers) against the target's
distributions, recomputed in the step from the stored target features (the target's final norm + LM head are
frozen inputs of the jitted step, never constants: `frozen_target`):

* EAGLE head: teacher forcing with the target's true features (input at t: f_{t-1}, x_t), loss =
  KL(target ‖ head) + λ · smooth-L1(f̂_t, f_t), averaged with per-position weights (answer positions 1,
  prompt positions `prompt_weight`, padding 0); with `unroll` > 1, training-time test over the head's own features.
* LM draft: a small `Decoder` with the target's vocabulary, loss = KL(target ‖ draft) with the same weights.

With a reduced draft vocabulary both KLs are taken over the subset (the target renormalised on it), as EAGLE-3
does. Held-out "acceptance" = teacher-forced top-1 agreement of draft and target (FULL-vocab target argmax) on
held-out answers (`Task.agreement`); `chain_acceptance` measures greedy head chains. A `Task` joins a draft's loss
and agreement; `loop.train` trains one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sage_jax.models import eagle_head, layers, serving_lm
from sage_jax.models.config import LMConfig
from sage_jax.training.recipe import TrainConfig

# ---------------------------------------------------------------------------------------------------------------
# Frozen target parts and losses.
# ---------------------------------------------------------------------------------------------------------------


def frozen_target(target_lm: serving_lm.LM, vocab_ids=None) -> dict:
    """The target's embedding, final norm and head as a pure dict (+ the subset head, its ids and `in_vocab` [V],
    whether each full id is in the subset, with `vocab_ids`)."""
    out = {"embed": target_lm.embed, "final_norm": target_lm.final_norm}
    if target_lm.lm_head is not None:
        out["lm_head"] = target_lm.lm_head
    if vocab_ids is not None:
        ids = jnp.asarray(vocab_ids, jnp.int32)
        out["vocab_ids"] = ids
        out["vocab_head"] = (jnp.take(target_lm.embed, ids, axis=0).T if target_lm.lm_head is None
                             else jnp.take(target_lm.lm_head, ids, axis=1))
        out["in_vocab"] = jnp.zeros((target_lm.embed.shape[0],), bool).at[ids].set(True)
    return out


def _hidden(batch: dict):
    """The target's last hidden states (its logits' input): `hidden` where the head reads tapped features."""
    return batch["hidden"] if "hidden" in batch else batch["features"]


def head_inputs(params: dict, batch: dict):
    """The target features a head reads, at width D: its `fuse` of the tapped features, or for a plain head the
    last hidden state (`hidden` where the rows carry tapped `features`, so both kinds train on the same shards)."""
    if "fuse" in params:
        return eagle_head.fuse_features(params, batch["features"])
    return _hidden(batch)


def chain_valid(batch: dict, level: int, idx):
    """[B, W] whether a draft chain of depth level+1 ending at window positions `idx` is one that decoding meets:
    the `level` data tokens it was fed after its true start (x_{t-k+1} .. x_t) are each the target's argmax at
    the position before (`batch["top"]`). Always true on the target's own greedy answers; on teacher-forced
    text it keeps the deeper levels to the chains a tree would have accepted. All true without `top`."""
    if "top" not in batch or level == 0:
        return jnp.ones(idx.shape, bool)
    tokens, top = batch["tokens"], batch["top"]
    length = tokens.shape[1]
    j = jnp.arange(length)[None]
    nxt = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    miss = jnp.where((top != nxt) | (j >= length - 1), j, -1)  # positions whose next data token is not the argmax
    last_miss = jax.lax.cummax(miss, axis=1)  # [B, L] the latest miss at or before each position
    before = jnp.take_along_axis(last_miss, jnp.maximum(idx - 1, 0), axis=1)  # latest miss at or before t-1
    return (before < idx - level) & (idx >= level)


def _target_logits(cfg: LMConfig, fz: dict, feats, *, full: bool = False):
    if "vocab_head" in fz and not full:
        return serving_lm.head(cfg, None, fz["final_norm"], fz["vocab_head"], feats)
    return serving_lm.head(cfg, fz["embed"], fz["final_norm"], fz.get("lm_head"), feats)


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


def answer_window(batch: dict, window: int):
    """Positions [B, W] from the last prompt token on (`window` of them, clipped to the row), their validity, and
    the answer mask (positions whose next token is in the answer). `window` 0 = every position."""
    b, length = batch["tokens"].shape
    if not window:
        idx = jnp.broadcast_to(jnp.arange(length)[None], (b, length))
    else:
        idx = (batch["answer_start"] - 1)[:, None] + jnp.arange(window)[None]
    lengths = batch["lengths"][:, None]
    valid = (idx < lengths) & (idx >= (batch["answer_start"] - 1)[:, None])
    return jnp.clip(idx, 0, length - 1), valid, valid & (idx < lengths - 1)


def _take(x, idx):
    return jnp.take_along_axis(x, idx[:, :, None], axis=1)


def _draft_head(cfg: LMConfig, fz: dict, hidden, params: dict | None = None):
    """The head's own final norm + LM head when it has them, else the target's (its subset rows with a reduced
    vocabulary), on draft features."""
    if params is not None and "lm_head" in params:
        return serving_lm.head(cfg, None, params["final_norm"], params["lm_head"], hidden)
    if "vocab_head" in fz:
        return serving_lm.head(cfg, None, fz["final_norm"], fz["vocab_head"], hidden)
    return serving_lm.head(cfg, fz["embed"], fz["final_norm"], fz.get("lm_head"), hidden)


def eagle_teacher_forced(head_cfg: LMConfig, params, fz, batch):
    """f̂ [B, L, D] with the target's true features as inputs (f_{t-1}, x_t)."""
    pos, mask = _causal(batch)
    prev = eagle_head.shift_features(head_inputs(params, batch))
    f_hat, _ = eagle_head.eagle_features(params, head_cfg, fz["embed"], batch["tokens"], prev, pos, mask)
    return f_hat


def unroll_mask(length: int, idx, level: int, window: int):
    """[B, W, L + level·W] visibility of level `level` (>= 1) of training-time test over the stacked caches: the
    level-0 slots [0, L) (one per position) and, per level m in 1..level, W slots (one per window entry).

    Level k's query at window entry w (position t = idx[w]) is depth k+1 of a draft chain that started after the
    true position t0 = t - k: it sees the true slots j <= t0 and, of each level m in 1..k, the one slot of its own
    chain, window entry w - k + m (position t0 + m; m = k is itself). Exactly what the head sees when it drafts
    k+1 tokens ahead."""
    b = idx.shape[0]
    w = jnp.arange(window)
    true_vis = jnp.arange(length)[None, None, :] <= (idx - level)[:, :, None]
    m = jnp.arange(1, level + 1)
    own = (w[:, None, None] - level + m[None, :, None]) == w[None, None, :]  # [W, k, W]
    chain_vis = jnp.broadcast_to(own.reshape(window, level * window)[None], (b, window, level * window))
    return jnp.concatenate([true_vis, chain_vis], axis=-1)


def eagle_unrolled(head_cfg: LMConfig, params, fz, batch, levels: int, window: int):
    """(f̂ of level 0 [B, L, D], [f̂ of levels 1..levels-1, each [B, W, D]], window positions idx [B, W] or None).

    Level 0 is teacher forcing over every position; level k >= 1 feeds level k-1's predictions back as input
    features (training-time test, as in HASS / EAGLE-3), so the head learns to draft from its own features the
    way it does at depth > 1. Levels >= 1 run only on the answer window (`answer_window`), where the loss is; at
    a window entry w < k - 1 the chain would start before the window (zero weight in the loss)."""
    tokens = batch["tokens"]
    b, length = tokens.shape
    pos, mask = _causal(batch)
    prev = eagle_head.shift_features(head_inputs(params, batch))
    if levels == 1:
        f0, _ = eagle_head.eagle_features(params, head_cfg, fz["embed"], tokens, prev, pos, mask)
        return f0, [], None
    idx, _, _ = answer_window(batch, window)
    w = idx.shape[1]
    cap = length + (levels - 1) * w
    cache = eagle_head.init_cache(head_cfg, b, cap)
    f0, cache = eagle_head.eagle_features(params, head_cfg, fz["embed"], tokens, prev, pos,
                                     jnp.pad(mask, ((0, 0), (0, 0), (0, cap - length))), cache,
                                     jnp.zeros((b,), jnp.int32))
    toks_w = jnp.take_along_axis(tokens, idx, axis=1)
    feed = _take(f0, jnp.maximum(idx - 1, 0))  # level 1's input at t: level 0's prediction at t - 1
    out = []
    for k in range(1, levels):
        vis = unroll_mask(length, idx, k, w)
        vis = jnp.pad(vis, ((0, 0), (0, 0), (0, cap - vis.shape[-1])))
        f_k, cache = eagle_head.eagle_features(params, head_cfg, fz["embed"], toks_w, feed, idx, vis, cache,
                                          jnp.full((b,), length + (k - 1) * w, jnp.int32))
        out.append(f_k)
        feed = eagle_head.shift_features(f_k)  # level k+1's input at entry w: level k's prediction at entry w - 1
    return f0, out, idx


def _kl_terms(head_cfg: LMConfig, tc: TrainConfig, params, fz, f_hat, t_logits, w_kl, answer, top=None):
    """KL(target ‖ head) (+ `hard_weight` · cross-entropy on the target's argmax) averaged with weights `w_kl`,
    and the top-1 agreement on `answer`; `t_logits`: the target's (`_target_logits`, no gradient). With a reduced
    vocabulary and the target's full-vocab argmax `top`, positions whose argmax lies outside the subset get no
    weight (EAGLE-3's mask: nothing the head could draft)."""
    logits = _draft_head(head_cfg, fz, f_hat, params)
    if top is not None and "in_vocab" in fz:
        ok = jnp.take(fz["in_vocab"], top)
        w_kl, answer = w_kl * ok, answer & ok
    loss = _kl(t_logits, logits)
    if tc.hard_weight:
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        hard = -jnp.take_along_axis(lp, jnp.argmax(t_logits, -1)[..., None], -1)[..., 0]
        loss = loss + tc.hard_weight * hard
    kl_term = jnp.sum(w_kl * loss) / jnp.maximum(jnp.sum(w_kl), 1.0)
    agree = jnp.argmax(logits, -1) == jnp.argmax(t_logits, -1)
    return kl_term, jnp.sum(agree & answer) / jnp.maximum(jnp.sum(answer), 1)


def _reg(f_hat, feats, w):
    reg = jnp.mean(optax.huber_loss(f_hat.astype(jnp.float32), feats.astype(jnp.float32), delta=1.0), -1)
    return jnp.sum(w * reg) / jnp.maximum(jnp.sum(w), 1.0)


def eagle_loss(head_cfg: LMConfig, tc: TrainConfig, params, fz, batch):
    """Level 0: KL(target ‖ head) over the answer window (+ prompt positions at `prompt_weight` without a window)
    plus λ · smooth-L1 feature regression over every valid position. Levels k >= 1 (`unroll`): the same KL + λ·reg
    over the answer window, weighted unroll_decay**k; the sum is normalised by Σ_k decay^k. Metrics: level 0's
    kl / reg / acc, and `acc_last`, the deepest level's agreement."""
    feats = _hidden(batch)
    top = batch.get("top")
    window = tc.head_window or feats.shape[1]
    f0, deeper, idx = eagle_unrolled(head_cfg, params, fz, batch, tc.unroll, window)
    w, answer = position_weights(batch, tc.prompt_weight)
    reg0 = _reg(f0, feats, w) if tc.feature_weight else jnp.zeros(())
    if tc.head_window:
        idx0, valid, answer = answer_window(batch, tc.head_window)
        f_kl, feats_kl, w_kl = _take(f0, idx0), _take(feats, idx0), valid.astype(jnp.float32)
        top_kl = None if top is None else jnp.take_along_axis(top, idx0, 1)
    else:
        f_kl, feats_kl, w_kl, top_kl = f0, feats, w, top
    t_kl = jax.lax.stop_gradient(_target_logits(head_cfg, fz, feats_kl))
    kl0, acc0 = _kl_terms(head_cfg, tc, params, fz, f_kl, t_kl, w_kl, answer, top_kl)
    total, norm = kl0 + tc.feature_weight * reg0, 1.0
    metrics = {"kl": kl0, "reg": reg0, "acc": acc0, "acc_last": acc0}
    if deeper:
        _, valid, answer = answer_window(batch, window)
        feats_w = _take(feats, idx)
        top_w = None if top is None else jnp.take_along_axis(top, idx, 1)
        # the target's logits on the window, once for every level (level 0's when it runs on the same window)
        t_w = t_kl if tc.head_window else jax.lax.stop_gradient(_target_logits(head_cfg, fz, feats_w))
        for k, f_k in enumerate(deeper, start=1):
            ok = valid & (jnp.arange(idx.shape[1]) >= k - 1)[None] & (idx >= k)  # the chain is in the window
            ok = ok & chain_valid(batch, k, idx)
            kl_k, acc_k = _kl_terms(head_cfg, tc, params, fz, f_k, t_w, ok.astype(jnp.float32), answer & ok, top_w)
            loss_k = kl_k + (tc.feature_weight * _reg(f_k, feats_w, ok.astype(jnp.float32)) if tc.feature_weight
                             else 0.0)
            total, norm = total + tc.unroll_decay ** k * loss_k, norm + tc.unroll_decay ** k
            metrics["acc_last"] = acc_k
    return total / norm, metrics


def _agreement(cfg: LMConfig, fz, batch, hidden, window: int, draft_head):
    idx, _, answer = answer_window(batch, window)
    d_top = jnp.argmax(draft_head(_take(hidden, idx)), -1)
    if "vocab_ids" in fz:
        d_top = jnp.take(fz["vocab_ids"], d_top)
    if "top" in batch:
        t_top = jnp.take_along_axis(batch["top"], idx, 1)
    else:
        t_top = jnp.argmax(_target_logits(cfg, fz, _take(_hidden(batch), idx), full=True), -1)
    return jnp.sum((d_top == t_top) & answer), jnp.sum(answer)


def eagle_agreement(head_cfg: LMConfig, params, fz, batch, window: int = 0):
    """(agreeing positions, answer positions): draft top-1 (mapped to full ids) vs the target's FULL-vocab top-1."""
    f_hat = eagle_teacher_forced(head_cfg, params, fz, batch)
    return _agreement(head_cfg, fz, batch, f_hat, window, lambda h: _draft_head(head_cfg, fz, h, params))


def _lm_hidden(draft_cfg: LMConfig, params, batch):
    pos, mask = _causal(batch)
    model = serving_lm.serving_params(draft_cfg, params)
    return model, model.forward(batch["tokens"], pos, mask)[0]


def _lm_head(draft_cfg: LMConfig, model, fz, hidden):
    if "vocab_ids" in fz:
        sub_head = (jnp.take(model.embed, fz["vocab_ids"], axis=0).T if model.lm_head is None
                    else jnp.take(model.lm_head, fz["vocab_ids"], axis=1))
        return serving_lm.head(draft_cfg, None, model.final_norm, sub_head, hidden)
    return model.head(hidden)


def lm_loss(draft_cfg: LMConfig, tc: TrainConfig, params, fz, batch):
    model, hidden = _lm_hidden(draft_cfg, params, batch)
    feats = batch["features"]
    if tc.head_window:
        idx, valid, answer = answer_window(batch, tc.head_window)
        hidden, feats, w = _take(hidden, idx), _take(feats, idx), valid.astype(jnp.float32)
    else:
        w, answer = position_weights(batch, tc.prompt_weight)
    logits = _lm_head(draft_cfg, model, fz, hidden)
    t_logits = jax.lax.stop_gradient(_target_logits(draft_cfg, fz, feats))
    kl = _kl(t_logits, logits)
    loss = jnp.sum(w * kl) / jnp.maximum(jnp.sum(w), 1.0)
    agree = jnp.argmax(logits, -1) == jnp.argmax(t_logits, -1)
    return loss, {"kl": loss, "acc": jnp.sum(agree & answer) / jnp.maximum(jnp.sum(answer), 1)}


def lm_agreement(draft_cfg: LMConfig, params, fz, batch, window: int = 0):
    model, hidden = _lm_hidden(draft_cfg, params, batch)
    return _agreement(draft_cfg, fz, batch, hidden, window, lambda h: _lm_head(draft_cfg, model, fz, h))


# ---------------------------------------------------------------------------------------------------------------
# Tasks: what a draft is trained on, and how its held-out agreement is measured.
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
                lambda p, f, b: eagle_agreement(head_cfg, p, f, b, tc.head_window))


def lm_task(draft_cfg: LMConfig, tc: TrainConfig) -> Task:
    return Task("lm", lambda p, f, b: lm_loss(draft_cfg, tc, p, f, b),
                lambda p, f, b: lm_agreement(draft_cfg, p, f, b, tc.head_window))


# ---------------------------------------------------------------------------------------------------------------
# Held-out chains.
# ---------------------------------------------------------------------------------------------------------------


def chain_acceptance(head_cfg: LMConfig, params, fz, batch: dict, starts, depth: int):
    """Accepted lengths [B] of a greedy CHAIN of `depth` head drafts per row, started after the answer token at
    position `starts[b]` (input (f_{t-1}, x_t) true there; then the head feeds its own f̂ and tokens), compared with
    the target's greedy continuation (the stored answer). The bonus token is excluded (τ, not τ+1)."""
    tokens = jnp.asarray(batch["tokens"])
    feats = head_inputs(params, {k: jnp.asarray(v) for k, v in batch.items()})
    b, length = tokens.shape
    cap = length + depth
    starts = jnp.asarray(starts, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(length), (b, length))
    slots = jnp.arange(cap)
    mask = jnp.broadcast_to(slots[None, :] <= jnp.arange(length)[:, None], (b, length, cap))
    cache = eagle_head.init_cache(head_cfg, b, cap)
    f_hat, cache = eagle_head.eagle_features(params, head_cfg, fz["embed"], tokens, eagle_head.shift_features(feats),
                                             pos, mask, cache, jnp.zeros((b,), jnp.int32))
    f = _take(f_hat, starts[:, None])  # [B, 1, D] prediction at the start position
    lengths = jnp.asarray(batch["lengths"])
    alive = jnp.ones((b,), bool)
    accepted = jnp.zeros((b,), jnp.int32)
    for k in range(depth):
        logits = _draft_head(head_cfg, fz, f, params)
        tok = jnp.argmax(logits, -1)
        if "vocab_ids" in fz:
            tok = jnp.take(fz["vocab_ids"], tok)
        p = starts + 1 + k  # the position this draft token would take
        truth = jnp.take_along_axis(tokens, jnp.clip(p, 0, length - 1)[:, None], axis=1)
        alive = alive & (tok[:, 0] == truth[:, 0]) & (p < lengths)
        accepted = accepted + alive.astype(jnp.int32)
        q = p[:, None]
        step_mask = (slots[None, None, :] <= q[:, :, None])
        f, cache = eagle_head.eagle_features(params, head_cfg, fz["embed"], tok, f, q, step_mask, cache, p)
    return accepted


def mean_chain_acceptance(head_cfg: LMConfig, params, fz, heldout: dict, depth: int,
                          offsets=(0, 8, 16, 32, 48, 64), batch_size: int = 16) -> float:
    """Mean τ of greedy head chains of `depth` started at several answer offsets of every held-out row (a proxy of
    the chain policy's τ; bonus token excluded)."""
    fn = jax.jit(chain_acceptance, static_argnums=(0, 5))
    total, count = 0.0, 0
    n = len(heldout["tokens"])
    for s in range(0, n - batch_size + 1, batch_size):
        batch = {k: np.asarray(v[s: s + batch_size]) for k, v in heldout.items()}
        for off in offsets:
            starts = batch["answer_start"] - 1 + off
            ok = starts + 1 < batch["lengths"]
            acc = np.asarray(fn(head_cfg, params, fz, batch, starts, depth))
            total += float(np.sum(acc[ok]))
            count += int(np.sum(ok))
    return total / max(count, 1)
