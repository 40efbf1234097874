"""Draft training side: EAGLE head (cache consistency, reduced vocab), training raises held-out acceptance,
resumed training repeats the loss exactly, LM-draft export matches transformers, data splits, the CLI."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sage_jax.engine import Engine
from sage_jax.io import lm_checkpoint
from sage_jax.models import eagle_head, layers
from sage_jax.models.config import LMConfig
from sage_jax.models.decoder import Decoder
from sage_jax.models.draft_vocab import DraftVocab, top_ids
from sage_jax.prompts import EVAL_PROMPTS
from sage_jax.training import data, loop, objectives, rollout, wordnet
from sage_jax.training.recipe import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def target(tiny_lm):
    return tiny_lm(0, scale=2.5)


@pytest.fixture(scope="module")
def tiny_data(target):
    """Greedy answers of the tiny target to random letter prompts (byte-encoded), with target features."""
    rng = np.random.default_rng(0)
    texts = ["".join(chr(97 + int(c)) for c in rng.integers(0, 26, 24)) for _ in range(80)]
    ids = [data.encode(None, t, target.cfg.vocab_size) for t in texts]
    out = []
    for chunk in (ids[:64], ids[64:]):
        arrays = rollout.rollout(target.serving(), chunk, batch=16, max_new_tokens=40, prompt_len=24,
                                 eos_ids=target.cfg.eos_token_ids, pad_id=target.cfg.pad_token_id)
        arrays["kind"] = np.zeros((len(chunk),), np.int32)
        out.append(arrays)
    return out


def _tc(**kw):
    base = dict(steps=48, batch_size=8, lr=1e-2, warmup=5, eval_every=0, ckpt_every=1000, feature_weight=0.1)
    return TrainConfig(**{**base, **kw})


def test_features_are_the_decoder_hidden_states(target, tiny_data):
    tr, _ = tiny_data
    n = int(tr["lengths"][0])
    _, hidden, _ = target(jnp.asarray(tr["tokens"][:1, :n]))
    np.testing.assert_allclose(np.asarray(tr["features"][0, :n]), np.asarray(hidden[0]), rtol=1e-4, atol=1e-4)
    assert np.all(tr["features"][0, n:] == 0)
    assert np.all(tr["answer_start"] == 24) and np.all(tr["lengths"] > 24)


def test_eagle_forward_cache_matches_no_cache(target):
    cfg = eagle_head.head_config(target.cfg)
    hp = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, eagle_head.init_params(cfg, 1))
    lm_t = target.serving()
    b, t, cap = 2, 12, 20
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    feats = jnp.asarray(rng.normal(size=(b, t, cfg.d_model)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    args = (hp, cfg, lm_t.embed, lm_t.final_norm, lm_t.lm_head)
    fwd = jax.jit(eagle_head.eagle_forward, static_argnums=1)
    full_logits, full_f, none = fwd(*args, tokens, feats, pos, layers.causal_mask(t, jnp.zeros((b,), jnp.int32)))
    assert none is None and full_logits.shape == (b, t, cfg.vocab_size) and full_f.shape == (b, t, cfg.d_model)
    cache = eagle_head.init_cache(cfg, b, cap)
    slots = jnp.arange(cap)
    got_l, got_f = [], []
    for s, e in ((0, 5), (5, 6), (6, 9), (9, 12)):  # prefill, one step, a chunk, the rest
        q = jnp.arange(s, e)
        mask = jnp.broadcast_to(slots[None, :] <= q[:, None], (b, e - s, cap))
        lo, fo, cache = fwd(*args, tokens[:, s:e], feats[:, s:e], pos[:, s:e], mask, cache,
                            jnp.full((b,), s, jnp.int32))
        got_l.append(lo)
        got_f.append(fo)
    np.testing.assert_allclose(np.concatenate(got_l, 1), full_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.concatenate(got_f, 1), full_f, rtol=1e-5, atol=1e-5)


def test_rollout_matches_ar_decoding_and_teacher_forced_features(target, tiny_data):
    """One-pass generation (answers + features of the tokens it fed) == the engine's batched AR decoding + a
    teacher-forced forward, with left padding inside the batch."""
    tr, _ = tiny_data
    rows = [list(tr["tokens"][i, : tr["answer_start"][i]]) for i in range(4)]
    rows[1] = rows[1][5:]  # a shorter prompt: left padding inside the batch
    eos = target.cfg.eos_token_ids
    got = rollout.rollout(target.serving(), rows, batch=4, max_new_tokens=40, prompt_len=24, eos_ids=eos,
                          pad_id=target.cfg.pad_token_id)
    ref = Engine(target).generate(rows, policy="ar", max_new_tokens=40).token_ids
    lm_t = target.serving()
    for i, (q, answer) in enumerate(zip(rows, ref, strict=True)):
        n = int(got["lengths"][i])
        assert got["answer_start"][i] == len(q) and n == len(q) + len(answer)
        np.testing.assert_array_equal(got["tokens"][i, :n], q + answer)
        mask = layers.causal_mask(n, jnp.zeros((1,), jnp.int32))
        hidden, _ = lm_t.forward(jnp.asarray(got["tokens"][i: i + 1, :n]), jnp.arange(n)[None], mask)
        np.testing.assert_allclose(got["features"][i, :n], np.asarray(hidden[0]), rtol=1e-4, atol=1e-4)
    assert len(rows[1]) == 19 and any(len(a) == 40 for a in ref)


@pytest.mark.integration  # 25-40 s: the default tier sits near its 15-minute limit
def test_training_time_test_levels_equal_real_chain_drafting(target):
    """Level k of `eagle_unrolled` at position t == drafting k+1 tokens ahead from the true context up to t-k,
    feeding the head's own features back through its KV cache (what the engine does)."""
    cfg = eagle_head.head_config(target.cfg)
    hp = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, eagle_head.init_params(cfg, 2))
    fz = objectives.frozen_target(target.serving())
    b, length, levels = 2, 10, 3
    rng = np.random.default_rng(3)
    batch = {"tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (b, length)), jnp.int32),
             "features": jnp.asarray(rng.normal(size=(b, length, cfg.d_model)), jnp.float32),
             "lengths": jnp.full((b,), length, jnp.int32), "answer_start": jnp.full((b,), 2, jnp.int32)}
    f0, deeper, idx = objectives.eagle_unrolled(cfg, hp, fz, batch, levels, window=length - 1)
    np.testing.assert_array_equal(idx, np.broadcast_to(np.arange(1, length), (b, length - 1)))
    np.testing.assert_allclose(f0, objectives.eagle_teacher_forced(cfg, hp, fz, batch), rtol=1e-5, atol=1e-5)
    prev = eagle_head.shift_features(batch["features"])
    slots = jnp.arange(length + levels)
    for t0 in (0, 3, 6):
        cache = eagle_head.init_cache(cfg, b, length + levels)
        q = jnp.arange(t0 + 1)
        mask = jnp.broadcast_to(slots[None, :] <= q[:, None], (b, t0 + 1, length + levels))
        f, cache = eagle_head.eagle_features(hp, cfg, fz["embed"], batch["tokens"][:, : t0 + 1], prev[:, : t0 + 1],
                                        jnp.broadcast_to(q, (b, t0 + 1)), mask, cache, jnp.zeros((b,), jnp.int32))
        f = f[:, -1:]
        for k in range(1, levels):
            p = t0 + k
            step_mask = jnp.broadcast_to(slots[None, None, :] <= p, (b, 1, length + levels))
            f, cache = eagle_head.eagle_features(hp, cfg, fz["embed"], batch["tokens"][:, p: p + 1], f,
                                            jnp.full((b, 1), p), step_mask, cache, jnp.full((b,), p, jnp.int32))
            np.testing.assert_allclose(f[:, 0], deeper[k - 1][:, p - 1], rtol=1e-4, atol=1e-4)  # entry p-1 = p


def test_wordnet_prompts_split_and_avoid_benchmark_topics():
    if not wordnet.available():
        pytest.skip("wordnet-base not installed")
    tr, he = wordnet.entries("train"), wordnet.entries("heldout")
    assert len(tr) > 1000 and len(he) > 100 and not {e[0] for e in tr} & {e[0] for e in he}
    from sage_jax.prompts import BENCH_PROMPTS

    texts = [t for _, t in wordnet.build_prompts(400, "train")]
    assert len(set(texts)) > 350
    for _, text in (*EVAL_PROMPTS, *BENCH_PROMPTS):
        assert not any(text in t or t in text for t in texts)
    # The extended style: every kind the benchmark asks, no benchmark topic either, and kinds the data set can index.
    ext = wordnet.build_prompts(700, "train", style="extended")
    # ("chat" is the kind of the prompts the target writes itself, `self_prompts.KIND`, not a WordNet template's)
    assert {k for k, _ in ext} == set(data.ALL_KINDS) - {"chat"} and len({t for _, t in ext}) > 600
    bench_topics = {e[0] for e in tr} - {e[0] for e in wordnet.entries("train", ban_bench=True)}
    assert {"birthday", "car", "interview"} <= bench_topics
    for _, text in (*EVAL_PROMPTS, *BENCH_PROMPTS):
        assert not any(text in t or t in text for _, t in ext)
    with pytest.raises(ValueError, match="prompt style"):
        wordnet.build_prompts(1, "train", style="fancy")


def test_reduced_vocab_maps_ids_back(target):
    seqs = [[5, 5, 5, 9, 9, 3], [9, 7, 7, 7, 7, 42]]
    ids = top_ids(seqs, 4, 128, always=(1,))
    assert ids.tolist() == [1, 5, 7, 9]  # 7 x5, 9 x3, 5 x3, then the forced EOS
    cfg = eagle_head.head_config(target.cfg)
    lm_t = target.serving()
    voc = DraftVocab.build(ids, lm_t.embed, lm_t.lm_head)
    hp = eagle_head.init_params(cfg, 0)
    b, t = 1, 6
    tokens = jnp.asarray(seqs[:1], jnp.int32)
    feats = jnp.ones((b, t, cfg.d_model))
    pos = jnp.arange(t)[None]
    mask = layers.causal_mask(t, jnp.zeros((b,), jnp.int32))
    full, _, _ = eagle_head.eagle_forward(hp, cfg, lm_t.embed, lm_t.final_norm, lm_t.lm_head, tokens, feats, pos, mask)
    sub, _, _ = eagle_head.eagle_forward(hp, cfg, lm_t.embed, lm_t.final_norm, lm_t.lm_head, tokens, feats, pos, mask,
                                    vocab=voc)
    assert sub.shape == (b, t, 4)
    np.testing.assert_allclose(sub, full[..., ids], rtol=1e-6, atol=1e-6)
    back = voc.to_full(sub)
    assert back.shape == full.shape and np.all(np.isneginf(np.delete(np.asarray(back), ids, axis=-1)))
    np.testing.assert_array_equal(back[..., ids], sub)
    lp = voc.log_probs_full(sub)
    np.testing.assert_allclose(jnp.sum(jnp.exp(lp), -1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(jnp.take(voc.ids, jnp.argmax(sub, -1)), jnp.argmax(back, -1))


@pytest.mark.integration
def test_training_raises_heldout_acceptance(target, tiny_data, tmp_path):
    tr, he = tiny_data
    cfg = eagle_head.head_config(target.cfg)
    tc = _tc(eval_every=24)
    task = objectives.eagle_task(cfg, tc)
    fz = objectives.frozen_target(target.serving())
    p0 = eagle_head.init_params(cfg, 0)
    acc0 = loop.initial_acceptance(task, p0, fz, he, 8)
    res = loop.train(task, p0, fz, tr, he, tc, str(tmp_path), progress=False, log=print)
    print(f"held-out teacher-forced acceptance {acc0:.3f} -> {res.evals}")
    assert res.evals[48] >= acc0 + 0.15, (acc0, res.evals)
    assert res.losses[47] < res.losses[0]
    # Chains: depth 1 is the teacher-forced top-1 at that position; deeper chains accept at most `depth`.
    batch = {k: np.asarray(v[:8]) for k, v in he.items()}
    starts = batch["answer_start"] + 3
    one = np.asarray(objectives.chain_acceptance(cfg, res.params, fz, batch, starts, 1))
    f_hat = objectives.eagle_teacher_forced(cfg, res.params, fz, {k: jnp.asarray(v) for k, v in batch.items()})
    top = np.asarray(jnp.argmax(objectives._draft_head(cfg, fz, f_hat), -1))
    rows = np.arange(8)
    expect = (top[rows, starts] == batch["tokens"][rows, starts + 1]) & (starts + 1 < batch["lengths"])
    np.testing.assert_array_equal(one, expect.astype(np.int32))
    deep = np.asarray(objectives.chain_acceptance(cfg, res.params, fz, batch, starts, 4))
    assert np.all((deep >= one) & (deep <= 4)) and np.all((deep > 0) == (one > 0))
    path = lm_checkpoint.save_head(str(tmp_path / "head"), cfg, res.params, target_cfg=target.cfg, dtype="bfloat16")
    cfg2, p2, ids, meta = lm_checkpoint.load_head(path)
    assert cfg2 == cfg and ids is None and meta["kind"] == "eagle_head"
    assert jax.tree.structure(p2) == jax.tree.structure(res.params)


@pytest.mark.integration  # resumption: a training run twice over
def test_resume_repeats_loss_exactly(target, tiny_data, tmp_path):
    tr, he = tiny_data
    ids = top_ids([r[:n] for r, n in zip(tr["tokens"], tr["lengths"], strict=True)], 48, 128, always=(1,))
    cfg = eagle_head.head_config(target.cfg)
    tc = _tc(steps=12, ckpt_every=4, eval_every=0, head_window=41)
    task = objectives.eagle_task(cfg, tc)
    fz = objectives.frozen_target(target.serving(), ids)
    p0 = eagle_head.init_params(cfg, 0)
    whole = loop.train(task, p0, fz, tr, he, tc, str(tmp_path / "a"), progress=False)
    first = loop.train(task, p0, fz, tr, he, tc, str(tmp_path / "b"), stop_at=6, progress=False)
    assert sorted(first.losses) == list(range(6))
    rest = loop.train(task, p0, fz, tr, he, tc, str(tmp_path / "b"), progress=False)  # resumes at 6 (ckpt @ 6)
    assert sorted(rest.losses) == list(range(6, 12))
    assert all(os.path.isfile(tmp_path / "b" / "ckpt" / s / "SHA256SUMS") for s in ("8", "12"))  # sealed steps
    for s in range(12):
        got = first.losses[s] if s < 6 else rest.losses[s]
        assert abs(got - whole.losses[s]) <= 1e-6 * max(1.0, abs(whole.losses[s])), (s, got, whole.losses[s])
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), rest.params, whole.params)


def test_lm_draft_distillation_step(target, tiny_data, tmp_path):
    tr, he = tiny_data
    dcfg = target.cfg.replace(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, mlp_dim=32,
                              tie_embeddings=True)
    tc = _tc(steps=24, eval_every=24, feature_weight=0.0)
    task = objectives.lm_task(dcfg, tc)
    fz = objectives.frozen_target(target.serving())
    p0 = Decoder(dcfg, rngs=nnx.Rngs(0)).params()
    acc0 = loop.initial_acceptance(task, p0, fz, he, 8)
    res = loop.train(task, p0, fz, tr, he, tc, str(tmp_path), progress=False)
    assert res.losses[23] < res.losses[0] and res.evals[24] > acc0


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_export_matches_transformers(tmp_path, qkv_bias, rel_err):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from sage_jax.io.hf import write_hf

    cfg = LMConfig.tiny(qkv_bias=qkv_bias, tie_embeddings=not qkv_bias, n_layers=2)
    model = Decoder(cfg, rngs=nnx.Rngs(3))
    nnx.update(model, jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape),
                                   nnx.state(model, nnx.Param)))
    out = write_hf(tmp_path / "hf", cfg, jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32),
                                                        model.params()))
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    toks = np.random.default_rng(0).integers(0, 128, size=(2, 40)).astype(np.int32)
    with torch.no_grad():
        ref_logits = ref(torch.tensor(toks, dtype=torch.long)).logits.numpy()
    ours_model = Decoder(cfg, rngs=nnx.Rngs(0))
    nnx.update(ours_model, jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32),
                                        nnx.state(model, nnx.Param)))
    ours = np.asarray(ours_model(jnp.asarray(toks))[0])
    err = rel_err(ours, ref_logits)
    print(f"exported draft (qkv_bias={qkv_bias}) rel err {err:.2e}")
    assert err <= 1e-4


def test_splits_and_eval_prompts_are_disjoint_from_training():
    py_tr, rst_tr = data.corpus_files("train")
    py_he, rst_he = data.corpus_files("heldout")
    assert py_he and rst_he and py_tr and rst_tr
    assert not set(py_tr) & set(py_he) and not set(rst_tr) & set(rst_he)
    assert len(EVAL_PROMPTS) >= 20 and {k for k, _ in EVAL_PROMPTS} == set(data.KINDS)
    train_texts = [p.text for p in data.build_prompts(64, "train", 0)]
    held = data.build_prompts(16, "heldout", 0)
    assert {p.kind for p in held} == set(data.KINDS)
    assert not set(train_texts) & {p.text for p in held}
    for _, text in EVAL_PROMPTS:
        assert not any(text in t for t in train_texts)


def test_extra_prompt_blocks_add_new_rows_and_reuse_the_first(target, tmp_path):
    if not wordnet.available():
        pytest.skip("wordnet-base not installed")
    from configs.sage import tiny
    from sage_jax.training import distillation
    from sage_jax.training.recipe import DraftRecipe

    c = DraftRecipe.from_config(tiny.get_config())
    c = dataclasses.replace(c, data=dataclasses.replace(
        c.data, n_train=0, n_heldout=0, n_general=12, n_heldout_general=4, general_templates="extended",
        max_prompt_tokens=160, max_new_tokens=4))
    logs = []
    tr0, he0 = distillation.make_data(c, target, None, str(tmp_path), log=logs.append)
    c = dataclasses.replace(c, data=dataclasses.replace(c.data, extra_general_seeds=(1,)))
    blocks = distillation._blocks(c)
    assert [b[0] for b in blocks] == ["train", "heldout", "train.seed1"]
    texts = [[t for _, t in b[2]] for b in blocks]
    assert texts[2] and not set(texts[2]) & set(texts[0]) and not set(texts[2]) & set(texts[1])
    logs.clear()
    tr, he = distillation.make_data(c, target, None, str(tmp_path), log=logs.append)
    assert any("train: reusing" in m for m in logs) and any("train.seed1: " in m and "answers" in m for m in logs)
    assert len(tr["tokens"]) == len(tr0["tokens"]) + len(texts[2]) and len(he["tokens"]) == len(he0["tokens"])
    np.testing.assert_array_equal(tr["tokens"][: len(tr0["tokens"])], tr0["tokens"])
    assert tr["features"].shape[0] == len(tr["tokens"]) and np.abs(tr["features"][-1]).sum() > 0
    with pytest.raises(ValueError, match="repeats the recipe's own seed"):
        dataclasses.replace(c, data=dataclasses.replace(c.data, extra_general_seeds=(0,)))
    with pytest.raises(ValueError, match="needs data.n_general"):
        dataclasses.replace(c, data=dataclasses.replace(c.data, n_general=0))


def test_answer_rows_are_the_datastore_answers_to_prompts_the_recipe_lacks(smollm2, tmp_path):
    """`data.answers`: build_datastore's answers become rows (prompt ids + answer), the recipe's own prompts are
    dropped, kinds come from the prompts, and an answers file of other prompts is refused."""
    if not wordnet.available():
        pytest.skip("wordnet-base not installed")
    import json

    from configs.sage import smollm2_eagle
    from sage_jax.training import distillation
    from sage_jax.training.answers import training_prompts
    from sage_jax.training.recipe import DraftRecipe

    cfg, _, tok, _ = smollm2
    prompts = training_prompts(6)
    path = tmp_path / "answers.jsonl"
    lines = [{"i": i, "prompt": data.encode(tok, t, 0), "answer": [100 + i, 7, 2]} for i, (_, t) in enumerate(prompts)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    c = DraftRecipe.from_config(smollm2_eagle.get_config("answers4k"))
    c = dataclasses.replace(c, data=dataclasses.replace(c.data, answers=str(path), n_train=0, n_general=2,
                                                        extra_general_seeds=(), n_answers=0))
    own = {t for _, t in distillation._blocks(c)[0][2]}
    assert own == {t for _, t in prompts[:2]}  # the recipe's first WordNet prompts are build_datastore's first
    rows = distillation.answer_rows(c, tok, cfg.pad_token_id)
    assert len(rows["tokens"]) == 4
    for r in range(4):
        n, a = rows["lengths"][r], rows["answer_start"][r]
        i = rows["tokens"][r, a] - 100
        assert 2 <= i < 6 and list(rows["tokens"][r, :n]) == lines[i]["prompt"] + lines[i]["answer"]
        assert data.ALL_KINDS[rows["kind"][r]] == prompts[i][0] and np.all(rows["tokens"][r, n:] == cfg.pad_token_id)
    first5 = distillation.answer_rows(dataclasses.replace(c, data=dataclasses.replace(c.data, n_answers=5)), tok,
                                  cfg.pad_token_id)  # a grown file gives a recipe the same rows
    firsts = sorted(int(first5["tokens"][r, first5["answer_start"][r]]) for r in range(len(first5["tokens"])))
    assert firsts == [102, 103, 104]
    with pytest.raises(ValueError, match="holds 6 answers, the recipe reads 7"):
        distillation.answer_rows(dataclasses.replace(c, data=dataclasses.replace(c.data, n_answers=7)), tok,
                             cfg.pad_token_id)
    lines[3]["prompt"] = lines[3]["prompt"][:-1]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(ValueError, match="differs from build_datastore's training prompts"):
        distillation.answer_rows(c, tok, cfg.pad_token_id)
    with pytest.raises(ValueError, match="needs training rows"):
        dataclasses.replace(c, data=dataclasses.replace(c.data, answers=""))


def test_init_from_continues_a_head_gains_an_own_lm_head_and_refuses_one_that_does_not_fit(target, tmp_path):
    from configs.sage import tiny
    from sage_jax.training import distillation
    from sage_jax.training.recipe import DraftRecipe

    c = DraftRecipe.from_config(tiny.get_config())
    tcfg = target.cfg
    vocab = np.arange(2, 2 + 40, dtype=np.int32)
    c = dataclasses.replace(c, vocab_size=40)
    hcfg, p0 = distillation.eagle_init(c, tcfg, target.serving(), vocab)
    p0 = jax.tree.map(lambda x: np.asarray(x) + 0.5, p0)  # not what a fresh init gives
    path = lm_checkpoint.save_head(str(tmp_path / "head"), hcfg, p0, target_cfg=tcfg, vocab_ids=vocab)
    cont = dataclasses.replace(c, eagle=dataclasses.replace(c.eagle, init_from=path))
    hcfg2, p1 = distillation.eagle_init(cont, tcfg, target.serving(), vocab)
    assert hcfg2 == hcfg
    jax.tree.map(np.testing.assert_array_equal, p1, p0)
    with pytest.raises(ValueError, match="vocabulary differ"):
        distillation.eagle_init(cont, tcfg, target.serving(), vocab[::-1])
    with pytest.raises(ValueError, match="taps differ"):
        distillation.eagle_init(dataclasses.replace(cont, eagle=dataclasses.replace(cont.eagle, taps=(0,))), tcfg,
                             target.serving(), vocab)

    # Gaining an own LM head: warm-started from the target's rows, so the continued head computes what it did.
    own = dataclasses.replace(cont, eagle=dataclasses.replace(cont.eagle, own_head=True))
    _, p2 = distillation.eagle_init(own, tcfg, target.serving(), vocab)
    voc = DraftVocab.build(vocab, target.serving().embed, target.serving().lm_head)
    np.testing.assert_array_equal(p2["lm_head"], voc.head)
    np.testing.assert_array_equal(p2["final_norm"], target.serving().final_norm)
    jax.tree.map(np.testing.assert_array_equal, {k: v for k, v in p2.items() if k not in ("lm_head", "final_norm")},
                 p0)
    feats, tokens = jnp.ones((1, 5, tcfg.d_model)), jnp.asarray([[2, 3, 4, 5, 6]], jnp.int32)
    pos, mask = jnp.arange(5)[None], layers.causal_mask(5, jnp.zeros((1,), jnp.int32))
    lm_t = target.serving()
    before, _, _ = eagle_head.eagle_forward(p0, hcfg, lm_t.embed, lm_t.final_norm, lm_t.lm_head, tokens, feats, pos,
                                            mask, vocab=voc)
    after, _, _ = eagle_head.eagle_forward(p2, hcfg, lm_t.embed, lm_t.final_norm, lm_t.lm_head, tokens, feats, pos,
                                           mask, vocab=voc.replace(head=jnp.asarray(p2["lm_head"])))
    np.testing.assert_array_equal(after, before)
    # ... but dropping one is refused: its training would be lost.
    path2 = lm_checkpoint.save_head(str(tmp_path / "own"), hcfg, p2, target_cfg=tcfg, vocab_ids=vocab)
    with pytest.raises(ValueError, match="own LM head differ"):
        distillation.eagle_init(dataclasses.replace(cont, eagle=dataclasses.replace(cont.eagle, init_from=path2)), tcfg,
                             target.serving(), vocab)


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "sage_jax.train_draft", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, **kw)


@pytest.fixture(scope="module")
def not_a_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "broken.py"
    path.write_text("import no_such_module\n")
    return str(path)


CLI_BAD = [
    (("--config", "no_such_config"), "unknown config"),
    (("--config", "{broken}"), "cannot load config"),
    (("--config", "configs/pgla/mnist_lenet.py"), "expected DraftRecipe"),
    (("--config", "tiny", "--set", "eagle.train.nope=1"), "unknown config key"),
    (("--config", "tiny", "--set", "eagle.train.steps=abc"), "expected int"),
    (("--config", "tiny", "--set", "kinds=medusa"), "not one of"),
    (("--config", "tiny", "--set", "eagle.train.steps=-5"), "must be ≥ 1"),
    (("--config", "tiny", "--set", "eagle.train.lr=nan"), "eagle.train.lr"),
]


@pytest.mark.integration
@pytest.mark.parametrize("args,needle", CLI_BAD)
def test_cli_bad_input_exits_2(args, needle, not_a_config, tmp_path):
    r = _cli(*[a.format(broken=not_a_config) for a in args], "--workdir", str(tmp_path / "w"))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr[-2000:]
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("args,needle", CLI_BAD)
def test_cli_bad_input_in_process_exits_2(args, needle, not_a_config, tmp_path, capsys, monkeypatch):
    """`train_draft.main(argv)` in this process (the command as a process: the test above, -m integration)."""
    from sage_jax import train_draft

    monkeypatch.chdir(ROOT)
    assert train_draft.main([*[a.format(broken=not_a_config) for a in args], "--workdir", str(tmp_path / "w")]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_cli_tiny_recipe_end_to_end(tmp_path):
    import json

    r = _cli("--config", "configs/sage/tiny.py", "--workdir", str(tmp_path), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["eagle"]["acceptance"]["40"] > summary["eagle"]["acceptance_initial"] + 0.1
    from sage_jax.io import load_lm

    cfg, model, _ = load_lm(summary["lm"]["path"])
    assert cfg.vocab_size == 128 and cfg.n_layers == 2


def test_shipped_draft_is_small_and_matches_the_default_target():
    from sage_jax.io.loader import default_draft

    path = default_draft()
    if path is None:
        pytest.skip("no shipped draft in this checkout")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    assert size <= 25 * 2**20
    cfg, params, vocab_ids, meta = lm_checkpoint.load_head(path)
    target = LMConfig.from_json(meta["config"]["target"])
    assert (target.d_model, target.vocab_size, target.n_layers) == (576, 49152, 30)  # SmolLM2-135M
    assert cfg.n_layers == 1 and cfg.d_model == 576 and sum(x.size for x in jax.tree.leaves(params)) > 1_000_000
    assert vocab_ids is not None and len(np.unique(vocab_ids)) == len(vocab_ids) == meta["config"]["vocab_size"]
    assert set(target.eos_token_ids) <= set(np.asarray(vocab_ids).tolist())


def test_a_rerun_with_other_data_settings_is_refused(tmp_path, capsys, monkeypatch):
    """The work folder records its recipe: a rerun with more training prompts would train on the old rows (and
    record the new setting in the head's provenance); it is refused in one line, the folder untouched. A longer
    schedule is not a different recipe."""
    from configs import cli
    from sage_jax import train_draft
    from sage_jax.training.recipe import DraftRecipe

    monkeypatch.chdir(ROOT)
    work = tmp_path / "w"
    recipe = cli.load_config("tiny", "configs.sage", DraftRecipe)
    cli.settled(str(work), {"recipe": recipe.to_json()})
    (work / "data").mkdir()  # the work a first run left
    assert train_draft.main(["--config", "tiny", "--set", f"data.n_train={recipe.data.n_train * 2}", "--workdir",
                             str(work)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"recipe.data.n_train={recipe.data.n_train}, this run asks" in err
    assert sorted(p.name for p in work.iterdir()) == ["data", cli.SETTINGS_FILE]
    free = [f"recipe.{k}.train.{f}" for k in ("eagle", "lm") for f in train_draft.FREE_TRAIN]
    longer = cli.load_config("tiny", "configs.sage", DraftRecipe, overrides=["eagle.train.steps=999"])
    cli.settled(str(work), {"recipe": longer.to_json()}, free=free)  # resumes: no error


def test_export_step_is_checked_like_a_run(tmp_path, capsys, caplog, monkeypatch):
    """`--export-step` exports a head of the recipe the folder holds: another vocabulary (a head of the old one
    recorded as the new) or --restart (which would delete the run) is refused in one line; asking for a step that
    is not there is one line too, without Orbax's warnings about its read-only manager before it."""
    import logging

    from configs import cli
    from sage_jax import train_draft
    from sage_jax.training.recipe import DraftRecipe

    monkeypatch.chdir(ROOT)
    work = tmp_path / "w"
    cli.settled(str(work), {"recipe": cli.load_config("tiny", "configs.sage", DraftRecipe).to_json()})
    (work / "eagle" / "ckpt").mkdir(parents=True)
    base = ["--config", "tiny", "--workdir", str(work), "--export-step"]
    for argv, needle in (([*base, "latest", "--set", "vocab_size=48"], "recipe.vocab_size=64, this run asks 48"),
                         ([*base, "latest", "--restart"], "--restart would delete it"),
                         ([*base, "99"], "no training checkpoint 99")):
        with caplog.at_level(logging.WARNING):
            assert train_draft.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, err
        assert not [r for r in caplog.records if r.name == "absl"], caplog.records
    assert sorted(p.name for p in work.iterdir()) == ["eagle", cli.SETTINGS_FILE]
