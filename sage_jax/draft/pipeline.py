"""The whole draft recipe behind `python -m sage_jax.train_draft`: target -> data -> drafts -> checkpoints.

Work directory layout (everything resumable: finished stages are skipped, training resumes from Orbax)::

    WORKDIR/data/train.{npz,features.npy}   heldout.{npz,features.npy}   self-distillation data
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

from sage_jax.draft import data as ddata
from sage_jax.draft import eagle, train
from sage_jax.draft.vocab import top_ids
from sage_jax.models.config import LMConfig
from sage_jax.models.decoder import Decoder


def load_target(c) -> tuple[Decoder, Any, str]:
    """(target Decoder, tokenizer or None, description) from `c.target`: "default", "tiny" or a path/spec."""
    if c.target == "tiny":
        cfg = LMConfig.tiny()
        model = Decoder(cfg, rngs=nnx.Rngs(int(c.target_seed)))
        scale = float(c.target_scale)
        nnx.update(model, jax.tree.map(lambda x: x * scale if x.ndim > 1 else x, nnx.state(model, nnx.Param)))
        return model, None, f"tiny(seed={c.target_seed}, scale={scale})"
    from sage_jax.io import default_target, load_lm

    spec = default_target() if c.target == "default" else c.target
    _, model, tok = load_lm(spec)
    return model, tok, os.fspath(spec)


def train_config(d) -> train.TrainConfig:
    return train.TrainConfig(**{k: d[k] for k in d})


def _log(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(msg)


def make_data(c, target: Decoder, tok, workdir: str, log=_log) -> tuple[dict, dict]:
    dd = c.data
    out = {}
    lm_t = None
    for split, n in (("train", dd.n_train), ("heldout", dd.n_heldout)):
        prefix = os.path.join(workdir, "data", split)
        if ddata.exists(prefix):
            out[split] = ddata.load(prefix)
            log(f"[data] {split}: reusing {prefix} ({len(out[split]['tokens'])} rows)")
            continue
        prompts = ddata.build_prompts(int(n), split, int(c.seed))

        total = len(prompts)

        def gen_progress(k, secs, split=split, total=total):
            log(f"[data] {split}: {k}/{total} answers generated, {secs:.0f}s")

        arrays = ddata.generate(target, tok, prompts, batch=int(dd.gen_batch), max_new_tokens=int(dd.max_new_tokens),
                                max_prompt_tokens=int(dd.max_prompt_tokens), progress=gen_progress)
        ddata.save(prefix, arrays)  # tokens first: generation is the expensive part
        lm_t = lm_t or target.serving()

        total = len(arrays["tokens"])

        def feat_progress(k, secs, split=split, total=total):
            if k % (4 * int(dd.gen_batch)) == 0 or k == total:
                log(f"[data] {split}: features {k}/{total}, {secs:.0f}s")

        arrays["features"] = ddata.compute_features(lm_t, arrays["tokens"], arrays["lengths"],
                                                    batch=int(dd.gen_batch), progress=feat_progress)
        ddata.save(prefix, arrays)
        out[split] = ddata.load(prefix)
    return out["train"], out["heldout"]


def lm_draft_config(c, target_cfg: LMConfig) -> LMConfig:
    d = c.lm
    return target_cfg.replace(n_layers=int(d.n_layers), d_model=int(d.d_model), n_heads=int(d.n_heads),
                              n_kv_heads=int(d.n_kv_heads), head_dim=int(d.head_dim), mlp_dim=int(d.mlp_dim),
                              tie_embeddings=True, param_dtype="float32", dtype="float32")


def run(c, workdir: str, *, progress: bool = True, log=_log) -> dict:
    """Runs (or resumes) the recipe of config `c` in `workdir`; returns the summary (also in summary.json)."""
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    kinds = [k.strip() for k in str(c.kinds).split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("eagle", "lm")]
    if bad or not kinds:
        raise ValueError(f"kinds must be a comma list of 'eagle' and 'lm', got {c.kinds!r}")
    t0 = time.perf_counter()
    target, tok, source = load_target(c)
    tcfg = target.cfg.replace(param_dtype="float32", dtype="float32")
    log(f"[target] {source}: {tcfg.n_layers} layers, d={tcfg.d_model}, vocab {tcfg.vocab_size}")
    train_data, heldout = make_data(c, target, tok, workdir, log)
    t_data = time.perf_counter() - t0
    summary: dict[str, Any] = {"target": source, "workdir": workdir, "data_seconds": round(t_data, 1),
                               "train_rows": int(len(train_data["tokens"])),
                               "heldout_rows": int(len(heldout["tokens"])),
                               "train_answer_tokens": int(np.sum(train_data["lengths"] - train_data["answer_start"]))}
    vocab_ids = None
    if int(c.vocab_size) > 0:
        vpath = os.path.join(workdir, "vocab.npy")
        if os.path.exists(vpath):
            vocab_ids = np.load(vpath)
        else:
            rows = [r[: n] for r, n in zip(train_data["tokens"], train_data["lengths"], strict=True)]
            vocab_ids = top_ids(rows, int(c.vocab_size), tcfg.vocab_size, always=tcfg.eos_token_ids)
            np.save(vpath, vocab_ids)
        summary["vocab_size"] = int(len(vocab_ids))
    lm_t = target.serving()
    fz = train.frozen_target(lm_t, vocab_ids)
    prov = {"recipe": dict(c.to_dict()) if hasattr(c, "to_dict") else str(c), "target": source}
    if "eagle" in kinds:
        hcfg = eagle.head_config(tcfg, **({"mlp_dim": int(c.eagle.mlp_dim)} if int(c.eagle.mlp_dim) else {}))
        tc = train_config(c.eagle.train)
        task = train.eagle_task(hcfg, tc)
        p0 = eagle.init_params(hcfg, tc.seed)
        log(f"[eagle] head: {train.describe(p0)}")
        acc0 = train.initial_acceptance(task, p0, fz, heldout, tc.batch_size)
        log(f"[eagle] held-out acceptance before training {acc0:.4f}")
        res = train.train(task, p0, fz, train_data, heldout, tc, os.path.join(workdir, "eagle"), progress=progress,
                          log=log)
        path = eagle.save_head(os.path.join(workdir, "eagle_head"), hcfg, res.params, target_cfg=tcfg,
                               vocab_ids=vocab_ids, provenance=prov, overwrite=True, dtype=str(c.out_dtype))
        tau = train.mean_chain_acceptance(hcfg, res.params, fz, heldout, depth=int(c.eagle.chain_depth),
                                          batch_size=min(16, len(heldout["tokens"])))
        log(f"[eagle] held-out greedy chain of {c.eagle.chain_depth}: mean accepted τ {tau:.3f} (τ+1 {tau + 1:.3f})")
        summary["eagle"] = {"path": path, "acceptance_initial": acc0, "acceptance": res.evals,
                            f"chain{int(c.eagle.chain_depth)}_tau": tau,
                            "train_seconds": round(res.seconds, 1), "size_bytes": _size(path)}
    if "lm" in kinds:
        from sage_jax.io import save_lm

        dcfg = lm_draft_config(c, tcfg)
        tc = train_config(c.lm.train)
        task = train.lm_task(dcfg, tc)
        p0 = Decoder(dcfg, rngs=nnx.Rngs(tc.seed)).params()
        log(f"[lm] draft: {dcfg.n_layers} layers, d={dcfg.d_model}, {train.describe(p0)}")
        acc0 = train.initial_acceptance(task, p0, fz, heldout, tc.batch_size)
        res = train.train(task, p0, fz, train_data, heldout, tc, os.path.join(workdir, "lm"), progress=progress,
                          log=log)
        out_cfg = dcfg.replace(param_dtype=str(c.out_dtype))
        params = jax.tree.map(lambda x: np.asarray(x, np.dtype(jax.numpy.dtype(str(c.out_dtype)))), res.params)
        path = save_lm(os.path.join(workdir, "lm_draft"), out_cfg, params, tok, provenance=prov, overwrite=True)
        summary["lm"] = {"path": path, "acceptance_initial": acc0, "acceptance": res.evals,
                         "train_seconds": round(res.seconds, 1), "size_bytes": _size(path)}
    summary["total_seconds"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return summary


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
