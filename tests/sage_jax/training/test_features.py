"""EAGLE-3-style training: the training-time-test loss equals a plain loop that feeds the head its own outputs,
the chain-validity mask, teacher-forced feature shards (array_record through grain), and the fused recipe end to
end (trained, saved, decoding losslessly)."""

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.engine import Engine, load_engine
from sage_jax.io import lm_checkpoint
from sage_jax.models import eagle_head, layers
from sage_jax.models.causal_lm import CausalLM
from sage_jax.training import data, distillation, features, objectives
from sage_jax.training.recipe import TrainConfig


@pytest.fixture(scope="module")
def target(tiny_lm):
    return tiny_lm(0, scale=2.5, n_layers=3)


def _batch(cfg, b, length, z, seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (b, length))
    top = np.where(rng.random((b, length)) < 0.7, np.roll(tokens, -1, 1), rng.integers(0, cfg.vocab_size, (b, length)))
    return {"tokens": jnp.asarray(tokens, jnp.int32), "top": jnp.asarray(top, jnp.int32),
            "features": jnp.asarray(rng.normal(size=(b, length, z)), jnp.float32),
            "hidden": jnp.asarray(rng.normal(size=(b, length, cfg.d_model)), jnp.float32),
            "lengths": jnp.asarray([length, length - 2], jnp.int32), "answer_start": jnp.asarray([3, 2], jnp.int32)}


def test_chain_valid_follows_the_argmax_runs():
    # tokens x_1.. and the target's argmax at each position (its guess of the next token)
    tokens = jnp.asarray([[5, 1, 2, 3, 4, 6, 7]])
    top = jnp.asarray([[1, 2, 9, 4, 6, 7, 0]])  # position 2 misses (argmax 9, next token 3)
    batch = {"tokens": tokens, "top": top}
    idx = jnp.arange(7)[None]
    got = {k: np.asarray(objectives.chain_valid(batch, k, idx))[0].tolist() for k in (1, 2, 3)}
    # level k at t consumed x_{t-k+1..t}: valid iff positions t-k .. t-1 all matched
    assert got[1] == [False, True, True, False, True, True, True]
    assert got[2] == [False, False, True, False, False, True, True]
    assert got[3] == [False, False, False, False, False, False, True]
    assert np.all(np.asarray(objectives.chain_valid({"tokens": tokens}, 2, idx)))  # no argmax stored: all valid


def _plain_loss(cfg, tc, params, fz, batch, levels):
    """The same objective by brute force: for every chain start t0, teacher-force the true context up to t0,
    then feed the head its own feature k times through its cache (as the engine drafts), and score level k's
    prediction at t0 + k against the target there."""
    tokens, b, length = batch["tokens"], *batch["tokens"].shape
    prev = eagle_head.shift_features(eagle_head.fuse_features(params, batch["features"]))
    lengths, start = np.asarray(batch["lengths"]), np.asarray(batch["answer_start"])
    in_vocab = np.asarray(fz["in_vocab"])
    top = np.asarray(batch["top"])
    nxt = np.concatenate([np.asarray(tokens)[:, 1:], np.asarray(tokens)[:, -1:]], 1)
    sums = np.zeros(levels)
    weights = np.zeros(levels)
    slots = jnp.arange(length + levels)
    for t0 in range(length):
        cache = eagle_head.init_cache(cfg, b, length + levels)
        q = jnp.arange(t0 + 1)
        mask = jnp.broadcast_to(slots[None, :] <= q[:, None], (b, t0 + 1, length + levels))
        f, cache = _features(params, cfg, fz["embed"], tokens[:, : t0 + 1], prev[:, : t0 + 1],
                             jnp.broadcast_to(q, (b, t0 + 1)), mask, cache, jnp.zeros((b,), jnp.int32))
        f = f[:, -1:]
        for k in range(levels):
            t = t0 + k
            if t >= length:
                break
            if k:
                step_mask = jnp.broadcast_to(slots[None, None, :] <= t, (b, 1, length + levels))
                f, cache = _features(params, cfg, fz["embed"], tokens[:, t: t + 1], f, jnp.full((b, 1), t), step_mask,
                                     cache, jnp.full((b,), t, jnp.int32))
            logits = np.asarray(objectives._draft_head(cfg, fz, f, params))[:, 0]
            t_logits = np.asarray(objectives._target_logits(cfg, fz, batch["hidden"][:, t: t + 1]))[:, 0]
            lp_t = jax.nn.log_softmax(t_logits, -1)
            lp_d = jax.nn.log_softmax(logits, -1)
            loss = np.sum(np.exp(lp_t) * (lp_t - lp_d), -1)
            loss = loss + tc.hard_weight * -np.take_along_axis(np.asarray(lp_d), np.argmax(t_logits, -1)[:, None],
                                                                1)[:, 0]
            for r in range(b):
                s0 = start[r] - 1  # the last prompt position: the answer window starts there
                if t >= lengths[r]:
                    continue
                if k == 0:
                    w = 1.0 if t >= s0 else tc.prompt_weight
                else:  # deeper levels: chains that start at s0 - 1 or later, fed only argmax tokens
                    chain_ok = all(top[r, j] == nxt[r, j] for j in range(t0, t))
                    w = float(chain_ok and t0 >= s0 - 1)
                w *= float(in_vocab[top[r, t]])  # nothing the reduced head could draft
                sums[k] += w * loss[r]
                weights[k] += w
    per_level = sums / np.maximum(weights, 1.0)
    decay = tc.unroll_decay ** np.arange(levels)
    return float(np.sum(decay * per_level) / np.sum(decay))


# Jitted (compiled once per shape): eagerly, op by op, the loop and the loss took ~60 s on 2 cores.
_features = jax.jit(eagle_head.eagle_features, static_argnums=(1,))
_eagle_loss = jax.jit(objectives.eagle_loss, static_argnums=(0, 1))


def test_training_time_test_loss_equals_a_plain_loop(target):
    """EAGLE-3-style head (taps fused, own LM head over a reduced vocabulary), no feature regression, 3 levels,
    hard cross-entropy on: the batched unroll's loss equals the brute-force loop's, and so do its gradients' sign
    of life (the loss moves when the fused projection does)."""
    cfg = eagle_head.head_config(target.cfg)
    ids = np.arange(0, cfg.vocab_size, 2)
    lm_t = target.serving()
    params = eagle_head.init_params(cfg, 2, n_taps=2, head_vocab=len(ids))
    params = eagle_head.warm_start(params, ids, lm_t.embed, lm_t.final_norm, lm_t.lm_head)
    params = jax.tree.map(lambda x: x * 3.0 if x.ndim > 1 else x, params)
    fz = objectives.frozen_target(lm_t, ids)
    tc = TrainConfig(unroll=3, feature_weight=0.0, hard_weight=0.5, prompt_weight=0.3)
    batch = _batch(cfg, 2, 7, 2 * cfg.d_model, seed=4)
    loss, metrics = _eagle_loss(cfg, tc, params, fz, batch)
    want = _plain_loss(cfg, tc, params, fz, batch, 3)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5)
    g = jax.jit(jax.grad(lambda p: objectives.eagle_loss(cfg, tc, p, fz, batch)[0]))(params)
    assert float(jnp.abs(g["fuse"]).sum()) > 0 and float(jnp.abs(g["lm_head"]).sum()) > 0


def test_feature_shards_hold_the_targets_teacher_forced_features(target, tmp_path):
    lm_t = target.serving()
    rng = np.random.default_rng(0)
    n, length = 11, 40
    lengths = np.sort(rng.integers(6, 30, n)).astype(np.int32)  # sorted, as the recipe run's rows: batches of
    lengths[-1] = length  # ... rows up to 32 run at width 32, the last batch at the full 40
    rows = {"tokens": rng.integers(0, 128, (n, length)).astype(np.int32), "lengths": lengths,
            "answer_start": np.full((n,), 4, np.int32), "kind": np.zeros((n,), np.int32)}
    taps = (2, 0)
    paths = features.write_shards(lm_t, rows, str(tmp_path), "train", taps=taps, batch=4, shard_rows=8, log=print)
    assert len(paths) == 2 and all(os.path.exists(p) for p in paths)
    stamp = os.path.getmtime(paths[0])
    assert features.write_shards(lm_t, rows, str(tmp_path), "train", taps=taps, batch=4, shard_rows=8) == paths
    assert os.path.getmtime(paths[0]) == stamp  # kept, not rewritten (resume)
    # A reused directory with more rows: the full first shard is kept, the short last one is rewritten.
    more = {k: np.concatenate([v, v[:3]]) for k, v in rows.items()}
    (tmp_path / "grown").mkdir()
    for p in paths:
        shutil.copy(p, tmp_path / "grown")
        os.utime(tmp_path / "grown" / os.path.basename(p), (1, 1))
    grown = features.write_shards(lm_t, more, str(tmp_path / "grown"), "train", taps=taps, batch=4, shard_rows=8)
    assert os.path.getmtime(grown[0]) == 1 and os.path.getmtime(grown[1]) > 1  # kept; rewritten with 6 rows
    assert len(features.ShardSource(grown)) == n + 3
    # Other tokens or other taps: nothing is kept.
    other = {**rows, "tokens": rows["tokens"][::-1].copy()}
    os.utime(paths[0], (1, 1))
    features.write_shards(lm_t, other, str(tmp_path), "train", taps=taps, batch=4, shard_rows=8)
    assert os.path.getmtime(paths[0]) > 1
    np.testing.assert_array_equal(features.ShardSource(paths)[0]["tokens"], other["tokens"][0])
    os.utime(paths[0], (1, 1))
    features.write_shards(lm_t, other, str(tmp_path), "train", taps=(1,), batch=4, shard_rows=8)
    assert os.path.getmtime(paths[0]) > 1 and features.ShardSource(paths)[0]["features"].shape[-1] == lm_t.cfg.d_model
    features.write_shards(lm_t, rows, str(tmp_path), "train", taps=taps, batch=4, shard_rows=8)  # back, for below
    src = features.ShardSource(paths)
    assert len(src) == n
    mask = layers.causal_mask(length, jnp.zeros((1,), jnp.int32))
    for i in (0, 9, 10):
        r, m = src[i], rows["lengths"][i]
        hidden, _, tapped = lm_t.forward(jnp.asarray(rows["tokens"][i: i + 1]), jnp.arange(length)[None], mask,
                                          taps=taps)
        np.testing.assert_array_equal(r["tokens"], rows["tokens"][i])
        assert r["features"].dtype == np.float16 and r["features"].shape == (length, 2 * lm_t.cfg.d_model)
        np.testing.assert_allclose(r["features"][:m], np.asarray(tapped[0, :m]), rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(r["hidden"][:m], np.asarray(hidden[0, :m]), rtol=2e-3, atol=2e-3)
        np.testing.assert_array_equal(r["top"][:m], np.asarray(jnp.argmax(lm_t.head(hidden)[0, :m], -1)))
        assert int(r["lengths"]) == m
    assert not np.any(src[0]["features"][32:])  # its batch ran at width 32
    got = data.batches(src, 4, seed=0)[0]
    assert got["features"].shape == (4, length, 2 * lm_t.cfg.d_model) and got["top"].shape == (4, length)


@pytest.mark.integration
def test_fused_recipe_trains_saves_and_decodes_losslessly(tmp_path):
    """The tiny recipe as an EAGLE-3-style head (taps, own head, no regression, 3 levels, hard CE): trained from
    feature shards, its acceptance rises, and its checkpoint drafts for the target with AR's output."""
    from configs.sage import tiny
    from sage_jax.training.recipe import DraftRecipe

    c = DraftRecipe.from_config(tiny.get_config())
    c = dataclasses.replace(
        c, kinds=("eagle",),
        eagle=dataclasses.replace(c.eagle, taps=(0, 1), own_head=True, train=dataclasses.replace(
            c.eagle.train, unroll=3, feature_weight=0.0, hard_weight=0.5)))
    summary = distillation.run(c, str(tmp_path), progress=False, log=print)
    e = summary["eagle"]
    assert e["acceptance"][40] > e["acceptance_initial"] + 0.1, e
    assert len(os.listdir(tmp_path / "shards")) >= 2
    target, _, _ = distillation.load_target(c)
    prompts = [[3, 4, 5, 6, 8], [9, 10, 11]]
    ref = Engine(target).generate(prompts, policy="ar", max_new_tokens=16).token_ids
    engine = load_engine(CausalLM(target), e["path"])
    assert engine.draft.taps == (0, 1)
    out = engine.generate(prompts, policy="sage", max_new_tokens=16)
    assert out.token_ids == ref and out.stats.mean_accepted > 0
    # a point of the acceptance-vs-training curve: the last training checkpoint, exported on its own
    path = distillation.export_head(c, str(tmp_path), None, log=print)
    assert path.endswith("eagle_head_step40")
    _, exported, ids, meta = lm_checkpoint.load_head(path)
    _, final, ids_final, _ = lm_checkpoint.load_head(e["path"])
    assert lm_checkpoint.head_taps(meta) == (0, 1) and np.array_equal(ids, ids_final)
    assert meta["provenance"]["step"] == 40
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), exported, final)
    with pytest.raises(ValueError, match="no training checkpoint 7"):
        distillation.export_head(c, str(tmp_path), 7)


def test_corpus_rows_are_chat_rows_without_held_out_text(smollm2):
    from sage_jax.prompts import COPY_PROMPTS, held_out_texts

    cfg, _, tok, _ = smollm2
    rows = features.corpus_rows(tok, "train", 24, 192, pad_id=cfg.pad_token_id, eos_id=cfg.eos_token_ids[0])
    assert rows["tokens"].shape == (24, 192) and np.all(rows["answer_start"] < rows["lengths"])
    assert set(rows["kind"].tolist()) == {data.ALL_KINDS.index("explanation"), data.ALL_KINDS.index("code")}
    held = " ".join([*held_out_texts(), *(t for _, t in COPY_PROMPTS)])
    for r in range(24):
        text = tok.decode(rows["tokens"][r, : rows["lengths"][r]])
        assert "<|im_start|>assistant" in text and text.count("<|im_start|>user") == 1
        answer = tok.decode(rows["tokens"][r, rows["answer_start"][r]: rows["lengths"][r]])
        assert not any(len(ln.strip()) > 40 and ln.strip() in held for ln in answer.split("\n"))
