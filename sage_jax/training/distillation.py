"""The whole draft recipe behind `python -m sage_jax.train_draft`: target -> data -> drafts -> checkpoints.

Work directory layout (everything resumable: finished stages are skipped, training resumes from Orbax)::

    WORKDIR/data/train.{npz,features.npy}   heldout.{npz,features.npy}   self-distillation data
    WORKDIR/data/train.seedS.{npz,...}      extra training blocks (`data.extra_general_seeds`)
    WORKDIR/shards/{train,corpus,heldout}-NNNNN.array_record   teacher-forced features (`features.py`), when the
                                            recipe taps target layers or adds corpus rows
    WORKDIR/vocab.npy                       the reduced draft vocabulary (when `vocab_size` > 0)
    WORKDIR/eagle/ckpt/                      training checkpoints (params, optimizer state, step, data position)
    WORKDIR/eagle_head/                      final head: configs.checkpoint kind "eagle_head"
    WORKDIR/lm/ckpt/, WORKDIR/lm_draft/      the separate LM draft (kind "lm", loadable by `sage_jax.io.load_lm`)
    WORKDIR/summary.json                    acceptance, timings, sizes
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from configs import cli
from sage_jax.io import lm_checkpoint, loader
from sage_jax.models import eagle_head
from sage_jax.models.config import LMConfig
from sage_jax.models.decoder import Decoder
from sage_jax.models.draft_vocab import top_ids
from sage_jax.training import data as ddata
from sage_jax.training import loop, objectives
from sage_jax.training.recipe import DraftRecipe


def load_target(c: DraftRecipe) -> tuple[Decoder, Any, str]:
    """(target Decoder, tokenizer or None, description) from `c.target`: "default", "tiny" or a path/spec."""
    if c.target == "tiny":
        cfg = LMConfig.tiny()
        model = Decoder(cfg, rngs=nnx.Rngs(c.target_seed))
        scale = c.target_scale
        nnx.update(model, jax.tree.map(lambda x: x * scale if x.ndim > 1 else x, nnx.state(model, nnx.Param)))
        return model, None, f"tiny(seed={c.target_seed}, scale={scale})"
    from sage_jax.io import default_target, load_lm

    spec = default_target() if c.target == "default" else c.target
    _, model, tok = load_lm(spec)
    return model, tok, os.fspath(spec)


def _encoded(c: DraftRecipe, pairs: list[tuple[str, str]], tok, vocab_size: int, what: str
             ) -> tuple[list[list[int]], list[int]]:
    """Encoded (kind, text) prompts, longer ones dropped, sorted by length (similar lengths share a batch)."""
    dd = c.data
    ids, kinds = [], []
    for kind, text in pairs:
        t = ddata.encode(tok, text, vocab_size)
        if tok is None:
            t = t[: dd.max_prompt_tokens]
        if len(t) <= dd.max_prompt_tokens:
            ids.append(t)
            kinds.append(ddata.ALL_KINDS.index(kind))
    if not ids:
        raise ValueError(f"every {what} prompt is longer than max_prompt_tokens={dd.max_prompt_tokens}")
    order = np.argsort([len(t) for t in ids], kind="stable")
    return [ids[i] for i in order], [kinds[i] for i in order]


def _wordnet(c: DraftRecipe, split: str, seed: int) -> list[tuple[str, str]]:
    """The WordNet chat prompts of `split` drawn with `seed` (`n_general` / `n_heldout_general` of them)."""
    from sage_jax.training import wordnet

    dd = c.data
    n = dd.n_general if split == "train" else dd.n_heldout_general
    return wordnet.build_prompts(n, split, seed, dd.general_templates) if n else []


def _prompt_texts(c: DraftRecipe, split: str) -> list[tuple[str, str]]:
    """(kind, text) of the recipe's own `split`: corpus prompts + WordNet prompts."""
    n_corpus = c.data.n_train if split == "train" else c.data.n_heldout
    pairs = [(p.kind, p.text) for p in ddata.build_prompts(n_corpus, split, c.seed)] if n_corpus else []
    return pairs + _wordnet(c, split, c.seed)


def _blocks(c: DraftRecipe) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(name, split, prompts) of every data block. "train" and "heldout" are the recipe's prompts; each seed of
    `data.extra_general_seeds` adds a training block "train.seedS" of `n_general` more WordNet prompts built with
    that seed (texts already in an earlier block dropped), so a bigger recipe reuses a smaller one's data."""
    blocks = [(split, split, _prompt_texts(c, split)) for split in ("train", "heldout")]
    seen = {text for _, text in blocks[0][2]}
    for seed in c.data.extra_general_seeds:  # (the recipe checks they differ from its own seed)
        pairs = [(k, t) for k, t in _wordnet(c, "train", seed) if t not in seen]
        seen.update(t for _, t in pairs)
        blocks.append((f"train.seed{seed}", "train", pairs))
    return blocks


def make_data(c: DraftRecipe, target: Decoder, tok, workdir: str, log=loop.log_line) -> tuple[dict, dict]:
    """The self-distillation data: the target's greedy answers with its features, per block (`_blocks`), generated
    in shards of `shard_rows` (finished shards and blocks are kept, so an interrupted run resumes), then merged.
    Returns (train, heldout); the training blocks are concatenated (train is None with `data.rollouts` off)."""
    lm_t = None
    out: dict[str, list[dict]] = {"train": [], "heldout": []}
    for name, split, pairs in _blocks(c):
        if split == "train" and not c.data.rollouts:
            continue
        prefix = os.path.join(workdir, "data", name)
        if not ddata.exists(prefix):
            lm_t = lm_t or target.serving()
            ids, kinds = _encoded(c, pairs, tok, target.cfg.vocab_size, name)
            _generate(c, lm_t, target.cfg, workdir, name, ids, kinds, log)
        else:
            log(f"[data] {name}: reusing {prefix}")
        out[split].append(ddata.load(prefix))
    if not out["train"]:
        log(f"[data] no rollouts to train on (data.rollouts=False), {len(out['heldout'][0]['tokens'])} held-out rows")
        return None, out["heldout"][0]
    train_data = out["train"][0] if len(out["train"]) == 1 else {
        k: np.concatenate([d[k] for d in out["train"]]) for k in out["train"][0]}
    log(f"[data] {len(train_data['tokens'])} training rows, {len(out['heldout'][0]['tokens'])} held-out rows")
    return train_data, out["heldout"][0]


def _generate(c: DraftRecipe, lm_t, cfg: LMConfig, workdir: str, name: str, ids: list[list[int]], kinds: list[int],
              log) -> None:
    """Rolls out the answers of one block in shards, then merges them into WORKDIR/data/NAME.{npz,features.npy}."""
    from sage_jax.training.rollout import rollout

    dd = c.data
    prefix = os.path.join(workdir, "data", name)
    batch = dd.gen_batch
    rows = max(batch, dd.shard_rows // batch * batch)
    max_prompt, max_new = dd.max_prompt_tokens, dd.max_new_tokens
    length = max_prompt + max_new
    shards = []
    t0 = time.perf_counter()
    for k, s in enumerate(range(0, len(ids), rows)):
        shard = os.path.join(workdir, "data", f"{name}.shard{k:03d}")
        if not ddata.exists(shard):
            chunk = ids[s: s + rows]
            bucket = min(max_prompt, -(-max(len(t) for t in chunk) // 32) * 32)
            arrays = rollout(lm_t, chunk, batch=batch, max_new_tokens=max_new, prompt_len=bucket,
                             eos_ids=cfg.eos_token_ids, pad_id=cfg.pad_token_id)
            arrays["kind"] = np.asarray(kinds[s: s + rows], np.int32)
            ddata.save(shard, arrays)
        shards.append(shard)
        done = min(s + rows, len(ids))
        log(f"[data] {name}: {done}/{len(ids)} answers with features, {time.perf_counter() - t0:.0f}s")
    merged = {"tokens": np.full((len(ids), length), cfg.pad_token_id, np.int32)}
    with cli.replacing(prefix + ".features.npy") as staged:
        merged["features"] = np.lib.format.open_memmap(staged, mode="w+", dtype=np.float32,
                                                      shape=(len(ids), length, cfg.d_model))
        for key in ("lengths", "answer_start", "kind"):
            merged[key] = np.zeros((len(ids),), np.int32)
        r = 0
        for shard in shards:
            part = ddata.load(shard)
            n, w = part["tokens"].shape
            merged["tokens"][r: r + n, :w] = part["tokens"]
            merged["features"][r: r + n, :w] = part["features"]
            merged["features"][r: r + n, w:] = 0.0
            for key in ("lengths", "answer_start", "kind"):
                merged[key][r: r + n] = part[key]
            r += n
        merged["features"].flush()
    ddata.save(prefix, {k: v for k, v in merged.items() if k != "features"})
    for shard in shards:
        for suffix in (".npz", ".features.npy"):
            os.remove(shard + suffix)


def _row_meta(data) -> dict[str, np.ndarray]:
    """tokens / lengths / answer_start of every training row, from arrays or from feature shards."""
    if isinstance(data, dict):
        return data
    return data.arrays(("tokens", "lengths", "answer_start"))


def answer_rows(c: DraftRecipe, tok, pad_id: int) -> dict[str, np.ndarray]:
    """`data.answers` (an answers.jsonl of `build_datastore`; its first `data.n_answers`) as rows in the `data.py`
    layout, sorted by length: prompt ids + the target's greedy answer. Prompts of the recipe's own blocks (which a
    head continued by `eagle.init_from` already learned) and prompts longer than `max_prompt_tokens` are dropped.
    Each line's prompt ids are checked against its text (`--prompts self` lines carry it, and those near a held-out
    prompt are dropped) or else against `answers.training_prompts`, so the rows' kinds and texts are
    known."""
    from sage_jax.training.answers import read_answer_lines, training_prompts

    have, n = read_answer_lines(c.data.answers), c.data.n_answers
    if not have or len(have) < n:
        raise ValueError(f"{c.data.answers} holds {len(have)} answers, the recipe reads {n or 'any'} (make them with "
                         f"python -m sage_jax.build_datastore --answers {n or 4096})")
    have = have[:n] if n else have
    own = {t for _, _, pairs in _blocks(c) for _, t in pairs}
    if "text" in have[0]:
        from sage_jax.training.self_prompts import held_out_words, near_held_out

        held = held_out_words()  # checked again: the file may come from an older filter
        have = [r for r in have if not near_held_out(r["text"], held)]
        kinds_texts = [(r["kind"], r["text"]) for r in have]
    else:
        kinds_texts = training_prompts(len(have))
    rows = []
    for (kind, text), line in zip(kinds_texts, have, strict=True):
        p, a = line["prompt"], line["answer"]
        if ddata.encode(tok, text, 0) != p:
            raise ValueError(f"{c.data.answers}: a prompt differs from build_datastore's training prompts")
        if text not in own and len(p) <= c.data.max_prompt_tokens:
            rows.append((ddata.ALL_KINDS.index(kind), p + a, len(p)))
    if not rows:
        raise ValueError(f"every answer of {c.data.answers} is to one of the recipe's own prompts")
    rows.sort(key=lambda r: len(r[1]))
    length = -(-max(len(ids) for _, ids, _ in rows) // 32) * 32
    out = {"tokens": np.full((len(rows), length), pad_id, np.int32)}
    out.update({k: np.zeros((len(rows),), np.int32) for k in ("lengths", "answer_start", "kind")})
    for r, (kind, ids, n_prompt) in enumerate(rows):
        out["tokens"][r, : len(ids)] = ids
        out["lengths"][r], out["answer_start"][r], out["kind"][r] = len(ids), n_prompt, kind
    return out


def feature_shards(c: DraftRecipe, target: Decoder, tok, train_data: dict | None, heldout: dict, workdir: str,
                   log=loop.log_line):
    """The self-distillation rows (and `data.corpus_rows` teacher-forced corpus rows, and `data.answers`' rows)
    through the target once more, for the features the head reads (`eagle.taps`), into WORKDIR/shards/
    (`features.py`; resumable). Returns (training rows as a `ShardSource`, held-out rows as arrays)."""
    from sage_jax.training import features

    lm_t = target.serving()
    directory = os.path.join(workdir, "shards")
    taps, dd = tuple(c.eagle.taps), c.data
    strip = lambda d: {k: np.asarray(v) for k, v in d.items() if k != "features"}  # noqa: E731
    kw = dict(taps=taps, batch=dd.feature_batch, log=log)
    paths = [] if train_data is None else features.write_shards(lm_t, strip(train_data), directory, "train", **kw)
    if (dd.corpus_rows or dd.answers) and tok is None:
        raise ValueError("data.corpus_rows and data.answers need a target with a tokenizer")
    if dd.answers:
        rows = answer_rows(c, tok, target.cfg.pad_token_id)
        log(f"[data] {dd.answers}: {len(rows['tokens'])} answers to train on, "
            f"{int(np.sum(rows['lengths'] - rows['answer_start']))} answer tokens")
        paths += features.write_shards(lm_t, rows, directory, "answers", **kw)
    if dd.corpus_rows:
        length = (heldout if train_data is None else train_data)["tokens"].shape[1]
        rows = features.corpus_rows(tok, "train", dd.corpus_rows, length, seed=c.seed,
                                    pad_id=target.cfg.pad_token_id, eos_id=target.cfg.eos_token_ids[0])
        paths += features.write_shards(lm_t, rows, directory, "corpus", **kw)
    held = features.write_shards(lm_t, strip(heldout), directory, "heldout", **kw)
    src = features.ShardSource(paths)
    log(f"[data] feature shards: {len(src)} training rows, taps {taps or 'none (last hidden state)'}")
    return src, features.ShardSource(held).arrays()


def lm_draft_config(c: DraftRecipe, target_cfg: LMConfig) -> LMConfig:
    d = c.lm
    return target_cfg.replace(n_layers=d.n_layers, d_model=d.d_model, n_heads=d.n_heads, n_kv_heads=d.n_kv_heads,
                              head_dim=d.head_dim, mlp_dim=d.mlp_dim, tie_embeddings=True, param_dtype="float32",
                              dtype="float32")


def run(c: DraftRecipe, workdir: str, *, progress: bool = True, log=loop.log_line) -> dict:
    """Runs (or resumes) recipe `c` in `workdir`; returns the summary (also in summary.json)."""
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    t0 = time.perf_counter()
    target, tok, source = load_target(c)
    tcfg = target.cfg.replace(param_dtype="float32", dtype="float32")
    log(f"[target] {source}: {tcfg.n_layers} layers, d={tcfg.d_model}, vocab {tcfg.vocab_size}")
    train_data, heldout = make_data(c, target, tok, workdir, log)
    if c.sharded:
        train_data, heldout = feature_shards(c, target, tok, train_data, heldout, workdir, log)
    t_data = time.perf_counter() - t0
    meta = _row_meta(train_data)
    summary: dict[str, Any] = {"target": source, "workdir": workdir, "data_seconds": round(t_data, 1),
                               "train_rows": int(len(meta["tokens"])),
                               "heldout_rows": int(len(heldout["tokens"])),
                               "train_answer_tokens": int(np.sum(meta["lengths"] - meta["answer_start"]))}
    vocab_ids = None
    if c.vocab_size > 0:
        vpath = os.path.join(workdir, "vocab.npy")
        if os.path.exists(vpath):
            vocab_ids = np.load(vpath)
        elif c.eagle.init_from:  # a continued head keeps its vocabulary (`eagle_init` checks its size)
            vocab_ids = np.asarray(lm_checkpoint.load_head(c.eagle.init_from, dtype=None)[2], np.int32)
            np.save(vpath, vocab_ids)
        else:
            rows = [r[: n] for r, n in zip(meta["tokens"], meta["lengths"], strict=True)]
            vocab_ids = top_ids(rows, c.vocab_size, tcfg.vocab_size, always=tcfg.eos_token_ids)
            np.save(vpath, vocab_ids)
        summary["vocab_size"] = int(len(vocab_ids))
    lm_t = target.serving()
    fz = objectives.frozen_target(lm_t, vocab_ids)
    prov = {"recipe": c.to_json(), "target": source}
    if "eagle" in c.kinds:
        hcfg, p0 = eagle_init(c, tcfg, lm_t, vocab_ids)
        tc, taps = c.eagle.train, tuple(c.eagle.taps)
        task = objectives.eagle_task(hcfg, tc)
        log(f"[eagle] head: {_describe(p0)}")
        acc0 = loop.initial_acceptance(task, p0, fz, heldout, tc.batch_size)
        log(f"[eagle] held-out acceptance before training {acc0:.4f}")
        res = loop.train(task, p0, fz, train_data, heldout, tc, os.path.join(workdir, "eagle"), progress=progress,
                          log=log)
        path = lm_checkpoint.save_head(os.path.join(workdir, "eagle_head"), hcfg, res.params, target_cfg=tcfg,
                               vocab_ids=vocab_ids, provenance=prov, overwrite=True, dtype=c.out_dtype, taps=taps)
        loader.write_manifest(path)  # what `default_draft` checks when the head is shipped
        tau = objectives.mean_chain_acceptance(hcfg, res.params, fz, heldout, depth=c.eagle.chain_depth,
                                          batch_size=min(16, len(heldout["tokens"])))
        log(f"[eagle] held-out greedy chain of {c.eagle.chain_depth}: mean accepted τ {tau:.3f} (τ+1 {tau + 1:.3f})")
        summary["eagle"] = {"path": path, "acceptance_initial": acc0, "acceptance": res.evals,
                            f"chain{c.eagle.chain_depth}_tau": tau,
                            "train_seconds": round(res.seconds, 1), "size_bytes": _size(path)}
    if "lm" in c.kinds:
        dcfg = lm_draft_config(c, tcfg)
        tc = c.lm.train
        task = objectives.lm_task(dcfg, tc)
        p0 = Decoder(dcfg, rngs=nnx.Rngs(tc.seed)).params()
        log(f"[lm] draft: {dcfg.n_layers} layers, d={dcfg.d_model}, {_describe(p0)}")
        acc0 = loop.initial_acceptance(task, p0, fz, heldout, tc.batch_size)
        res = loop.train(task, p0, fz, train_data, heldout, tc, os.path.join(workdir, "lm"), progress=progress,
                          log=log)
        out_cfg = dcfg.replace(param_dtype=c.out_dtype)
        params = jax.tree.map(lambda x: np.asarray(x, np.dtype(jax.numpy.dtype(c.out_dtype))), res.params)
        path = lm_checkpoint.save_lm(os.path.join(workdir, "lm_draft"), out_cfg, params, tok, provenance=prov,
                                     overwrite=True)
        summary["lm"] = {"path": path, "acceptance_initial": acc0, "acceptance": res.evals,
                         "train_seconds": round(res.seconds, 1), "size_bytes": _size(path)}
    summary["total_seconds"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return summary


def eagle_init(c: DraftRecipe, tcfg: LMConfig, lm_t, vocab_ids) -> tuple[LMConfig, dict]:
    """The head's config and its parameters before training (an own LM head warm-started from the target's), or
    those of `eagle.init_from`, checked against the recipe. A head continued without an own LM head may gain one
    (`eagle.own_head`): warm-started from the target's rows, it starts as exactly the head it continues, so what
    training the LM head adds is measured on its own; dropping an own head is refused (it would lose training)."""
    if c.eagle.init_from:
        hcfg, p0, ids, meta = lm_checkpoint.load_head(c.eagle.init_from, dtype="float32")
        problems = [what for what, bad in (
            ("taps", lm_checkpoint.head_taps(meta) != tuple(c.eagle.taps)),
            ("vocabulary", (0 if ids is None else len(ids)) != (0 if vocab_ids is None else len(vocab_ids))
             or (ids is not None and not np.array_equal(ids, vocab_ids))),
            ("own LM head", "lm_head" in p0 and not c.eagle.own_head),
            ("target width", hcfg.d_model != tcfg.d_model)) if bad]
        if problems:
            raise ValueError(f"eagle.init_from {c.eagle.init_from}: its {', '.join(problems)} differ from the recipe's")
        if c.eagle.own_head and "lm_head" not in p0:
            p0 = eagle_head.warm_start(p0, vocab_ids, lm_t.embed, lm_t.final_norm, lm_t.lm_head)
        return hcfg, jax.tree.map(np.asarray, p0)
    hcfg = eagle_head.head_config(tcfg, **({"mlp_dim": c.eagle.mlp_dim} if c.eagle.mlp_dim else {}))
    own = len(vocab_ids) if c.eagle.own_head else 0
    p0 = eagle_head.init_params(hcfg, c.eagle.train.seed, n_taps=len(c.eagle.taps), head_vocab=own)
    if own:
        p0 = eagle_head.warm_start(p0, vocab_ids, lm_t.embed, lm_t.final_norm, lm_t.lm_head)
    return hcfg, p0


def export_head(c: DraftRecipe, workdir: str, step: int | None = None, log=loop.log_line) -> str:
    """Writes the EAGLE head of training checkpoint `step` (None: the latest) of a run in `workdir` as
    WORKDIR/eagle_head_stepN (a head checkpoint with its SHA256SUMS), while or after the run trains: the points
    of an acceptance-vs-training curve. Returns the path."""
    workdir = os.path.abspath(workdir)
    run_dir = os.path.join(workdir, "eagle")
    steps = loop.saved_steps(run_dir)
    step = max(steps) if step is None and steps else step
    if step is None or step not in steps:
        raise ValueError(f"no training checkpoint {'yet' if step is None else step} in {run_dir}/ckpt (have {steps})")
    target, _, source = load_target(c)
    tcfg = target.cfg.replace(param_dtype="float32", dtype="float32")
    lm_t = target.serving()
    vpath = os.path.join(workdir, "vocab.npy")
    vocab_ids = np.load(vpath) if c.vocab_size > 0 else None
    hcfg, p0 = eagle_init(c, tcfg, lm_t, vocab_ids)
    params = loop.saved_params(run_dir, step, p0, loop.optimizer(c.eagle.train), data_position=True)
    prov = {"recipe": c.to_json(), "target": source, "step": int(step)}
    path = lm_checkpoint.save_head(os.path.join(workdir, f"eagle_head_step{step}"), hcfg, params, target_cfg=tcfg,
                                   vocab_ids=vocab_ids, provenance=prov, overwrite=True, dtype=c.out_dtype,
                                   taps=tuple(c.eagle.taps))
    loader.write_manifest(path)
    log(f"[export] step {step} -> {path}")
    return path


def _describe(tree: Any) -> str:
    return f"{sum(int(np.size(v)) for v in jax.tree.leaves(tree)):,} params"


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
