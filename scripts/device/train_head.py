"""Train the shipped EAGLE head on a GPU or TPU machine in one run: the target writes chat prompts, answers them
in large batches, and the head is trained on the answers online. Every phase ends at its deadline, and what it
made is written to OUT as soon as it exists, so a run stopped early still returns its data.

    python scripts/device/train_head.py --out OUT [--seconds 470] [--workdir .dev_run/wd]
        [--config smollm2_eagle] [--init-from HEAD] [--prompt-batch 512] [--answer-batch 512]
        [--max-prompts 131072] [--steps N] [--lr LR] [--answers OUT1/answers.jsonl.gz]
    python scripts/device/train_head.py --probe --out OUT    # random weights of the real shapes: times a training
                                                             # step and a batched decode, checks the toolchain

Phases (fractions of --seconds): the target samples user messages from its chat template's empty user slot
(`training.self_prompts.sample`, filtered: held-out prompts and their relatives, repeats, unfinished ones) until
22%; answers them greedily in float32 (`Engine.generate`, policy "ar"), appended to WORKDIR/answers.jsonl in
`build_datastore`'s format, until 50%; then trains the recipe's head (`configs/sage/smollm2_eagle.py`, its last
stage: the CPU stages' head continued) on those rows, the target's features computed in the step
(`training/online.py`), until --seconds less a reserve for writing. The step count is the recipe's, or fewer: the
number of steps that fit, from the probe's measured step time when WORKDIR/../probe.json (a `--probe` run on the
same machine) exists. Give the probe and the run the same --workdir so the probe's timings and compilation cache
carry over.

With --answers (an earlier run's answers.jsonl.gz) it skips both and trains on those rows; --init-from, --lr and
--steps then e.g. anneal an earlier run's head. The same held-out rows are kept out either way (a fixed split).

OUT receives answers.jsonl.gz (split in parts under 15 MiB), head.tar (the head checkpoint with SHA256SUMS),
summary.json and run.log. Measure a head on the CPU before shipping it (`evaluate_draft`, the bench's chat
prompts); docs/drafts.md has the runs that made the shipped head, benchmarks/sage/results/device_head/ their logs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import json
import os
import sys
import tarfile
import time

T0 = time.monotonic()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _log_to(path: str):
    f = open(path, "a", buffering=1)  # kept open for the whole run, line-buffered

    def log(msg: str) -> None:
        line = f"[{time.monotonic() - T0:6.1f}s] {msg}"
        print(line, flush=True)
        f.write(line + "\n")
    return log


def _write_parts(src: str, out_dir: str, name: str, limit: int = 15 << 20, parts: int = 3) -> list[str]:
    """gzip `src` (JSON lines) into OUT/name.gz, or name.gz.NN parts each under `limit` bytes (the device's return
    limit), at most `parts` of them: beyond that only the first lines that fit."""
    with open(src, "rb") as f:
        lines = f.readlines()
    blob = gzip.compress(b"".join(lines), compresslevel=6)
    while len(blob) > parts * limit:
        lines = lines[: int(len(lines) * parts * limit / len(blob) * 0.97)]
        blob = gzip.compress(b"".join(lines), compresslevel=6)
    if len(blob) <= limit:
        paths = [os.path.join(out_dir, name + ".gz")]
        chunks = [blob]
    else:
        chunks = [blob[i: i + limit] for i in range(0, len(blob), limit)]
        paths = [os.path.join(out_dir, f"{name}.gz.{k:02d}") for k in range(len(chunks))]
    for p, c in zip(paths, chunks, strict=True):
        with open(p, "wb") as f:
            f.write(c)
    return paths


def probe(out: str, workdir: str, log, *, decode_batch: int = 512, batch_size: int = 0, steps: int = 40) -> dict:
    """Random weights of the real target's shapes: a batched greedy decode and training steps of the recipe's
    batch, timed, and one head checkpoint written (the toolchain of the real run, on this machine's versions)."""
    import jax
    import numpy as np
    from flax import nnx

    from configs.sage import smollm2_eagle
    from sage_jax.engine import Engine
    from sage_jax.io import lm_checkpoint
    from sage_jax.models import eagle_head
    from sage_jax.models.config import LMConfig
    from sage_jax.models.decoder import Decoder
    from sage_jax.training import loop, objectives, online
    from sage_jax.training.recipe import DraftRecipe

    log(f"jax {jax.__version__}, devices {jax.devices()}")
    cfg = LMConfig.smollm2_135m()
    target = Decoder(cfg, rngs=nnx.Rngs(0))
    engine = Engine(target, matmul="xla")
    res = {"jax": jax.__version__, "device": str(jax.devices()[0])}
    ids = [[1 + (i * 7 + j) % 1000 for j in range(40)] for i in range(decode_batch)]
    for rep in range(2):  # the first call compiles
        t = time.monotonic()
        gen = engine.generate(ids, policy="ar", max_new_tokens=128, temperature=[0.8] * decode_batch, seed=rep)
        dt = time.monotonic() - t
        log(f"decode batch {decode_batch} x 128 (rep {rep}): {dt:.2f}s, {sum(map(len, gen.token_ids)) / dt:.0f} tok/s")
    res[f"decode_{decode_batch}_s"] = dt
    c = DraftRecipe.from_config(smollm2_eagle.get_config())
    tc = dataclasses.replace(c.eagle.train, steps=steps, eval_every=0, ckpt_every=1000,
                             batch_size=batch_size or c.eagle.train.batch_size)
    lm_t = target.serving()
    vocab = np.arange(c.vocab_size, dtype=np.int32)
    hcfg = eagle_head.head_config(cfg)
    p0 = eagle_head.init_params(hcfg, 0)
    rng = np.random.default_rng(0)
    n, length = max(64, 2 * tc.batch_size), 256
    rows = {"tokens": rng.integers(1, cfg.vocab_size, (n, length)).astype(np.int32),
            "lengths": rng.integers(160, length + 1, n).astype(np.int32),
            "answer_start": rng.integers(40, 100, n).astype(np.int32), "kind": np.zeros((n,), np.int32)}
    task = online.task(objectives.eagle_task(hcfg, tc))
    fz = online.frozen(lm_t, vocab)
    r = loop.train(task, p0, fz, rows, rows, tc, os.path.join(workdir, "probe_eagle"), progress=False, log=log)
    first, steady = r.first_step_seconds, r.step_seconds
    log(f"train: first step {first:.1f}s (compile); {steady * 1000:.1f} ms/step of {tc.batch_size} rows x {length}")
    res.update(train_compile_s=first, train_step_s=steady, batch_size=tc.batch_size, row_length=length)
    path = lm_checkpoint.save_head(os.path.join(workdir, "probe_head"), hcfg, r.params, target_cfg=cfg, vocab_ids=vocab,
                           overwrite=True, dtype="bfloat16")
    log(f"head written: {path}")
    with open(os.path.join(out, "probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(os.path.dirname(workdir.rstrip("/")), "probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def generate_answers(engine, prompts: list[str], path: str, *, batch: int, max_new_tokens: int, deadline: float,
                     log) -> int:
    """Greedy answers in float32 to `prompts` (resuming after the lines in `path`), appended in `build_datastore`'s
    format until `deadline`. Returns the answers in the file."""
    import jax

    from sage_jax.training.answers import read_answer_lines

    have = len(read_answer_lines(path))
    t = time.monotonic()
    try:  # float32 answers, as the CPU makes them (an accelerator's default may round matmul inputs to TF32)
        exact = jax.default_matmul_precision("highest")
    except AttributeError:
        exact = contextlib.nullcontext()
    with open(path, "a") as f, exact:
        for s in range(have, len(prompts), batch):
            if time.monotonic() >= deadline:
                break
            chunk = prompts[s: s + batch]
            gen = engine.generate(chunk, policy="ar", max_new_tokens=max_new_tokens)
            for i, (text, ids) in enumerate(zip(chunk, gen.token_ids, strict=True)):
                f.write(json.dumps({"i": s + i, "prompt": engine.encode(text), "answer": [int(x) for x in ids],
                                    "text": text, "kind": "chat"}) + "\n")
            f.flush()
            done = s + len(chunk)
            log(f"answers: {done}/{len(prompts)} ({(done - have) / (time.monotonic() - t):.0f}/s)")
    return len(read_answer_lines(path))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where the returned files go")
    ap.add_argument("--workdir", default=".dev_run/wd",
                    help="its parent also holds the probe's timings and the compilation cache")
    ap.add_argument("--seconds", type=float, default=470.0, help="the whole run, from the script's start")
    ap.add_argument("--config", default="smollm2_eagle", help="a draft recipe, NAME[:ARG] (configs/sage) or a .py "
                    "file; default: the shipped head's last stage")
    ap.add_argument("--prompt-batch", type=int, default=512)
    ap.add_argument("--answer-batch", type=int, default=512)
    ap.add_argument("--max-prompts", type=int, default=131072)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64, help="longest sampled user message")
    ap.add_argument("--heldout", type=int, default=256, help="answer rows held out of training")
    ap.add_argument("--reserve", type=float, default=45.0, help="seconds kept for writing the results")
    ap.add_argument("--steps", type=int, default=0, help="at most this many training steps (0: the recipe's)")
    ap.add_argument("--batch-size", type=int, default=0, help="training rows per step (0: the recipe's)")
    ap.add_argument("--answers", metavar="FILE", help="train on this answers.jsonl[.gz] (an earlier run's) instead "
                    "of making new answers")
    ap.add_argument("--init-from", metavar="HEAD", help="the head to continue (default: the recipe's)")
    ap.add_argument("--lr", type=float, default=0.0, help="peak learning rate (0: the recipe's)")
    ap.add_argument("--probe", action="store_true")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.workdir, exist_ok=True)
    log = _log_to(os.path.join(args.out, "run.log"))
    cache = os.path.join(os.path.dirname(args.workdir.rstrip("/")), "jax_cache")

    import jax

    jax.config.update("jax_compilation_cache_dir", cache)
    if args.probe:
        probe(args.out, args.workdir, log, decode_batch=args.answer_batch, batch_size=args.batch_size,
              steps=args.steps or 40)
        return 0

    import numpy as np

    from configs import cli
    from sage_jax.engine import load_engine
    from sage_jax.io import lm_checkpoint, loader
    from sage_jax.training import distillation, loop, objectives, online
    from sage_jax.training.recipe import DraftRecipe
    from sage_jax.training.self_prompts import sample as self_prompts

    end = T0 + args.seconds
    summary: dict = {"args": vars(args), "jax": jax.__version__, "device": str(jax.devices()[0])}

    def save_summary():
        summary["elapsed_s"] = round(time.monotonic() - T0, 1)
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)

    engine = load_engine(matmul="xla")
    log(f"engine: {engine.description}; jax {jax.__version__} on {jax.devices()[0]}")
    answers = os.path.join(args.workdir, "answers.jsonl")
    if args.answers:  # an earlier run's answers: straight to training
        with (gzip.open if args.answers.endswith(".gz") else open)(args.answers, "rb") as f, open(answers, "wb") as g:
            g.write(f.read())
        with open(answers) as f:
            summary["prompts"] = summary["answers"] = sum(1 for _ in f)
        log(f"answers: {summary['answers']} from {args.answers}")
    else:
        # 1. Prompts the target writes itself.
        t = time.monotonic()
        prompts = self_prompts(engine, os.path.join(args.workdir, "prompts.jsonl"), args.max_prompts,
                               batch=args.prompt_batch, temperature=0.8, max_tokens=args.prompt_tokens,
                               progress=False, deadline=T0 + 0.22 * args.seconds)
        summary["prompts"] = len(prompts)
        summary["prompt_seconds"] = round(time.monotonic() - t, 1)
        log(f"prompts: {len(prompts)} in {summary['prompt_seconds']}s")
        save_summary()
        # 2. Their greedy answers.
        t = time.monotonic()
        n = generate_answers(engine, prompts, answers, batch=args.answer_batch, max_new_tokens=args.max_new_tokens,
                             deadline=T0 + 0.5 * args.seconds, log=log)
        summary["answers"], summary["answer_seconds"] = n, round(time.monotonic() - t, 1)
        summary["answer_files"] = _write_parts(answers, args.out, "answers.jsonl")
        save_summary()
    # 3. The head, trained online on them.
    c = cli.load_config(args.config, "configs.sage", DraftRecipe)
    c = dataclasses.replace(c, data=dataclasses.replace(c.data, answers=answers, n_answers=0))
    if args.init_from:
        c = dataclasses.replace(c, eagle=dataclasses.replace(c.eagle, init_from=os.path.abspath(args.init_from)))
    if c.eagle.init_from and not os.path.isabs(c.eagle.init_from):
        c = dataclasses.replace(c, eagle=dataclasses.replace(c.eagle, init_from=os.path.join(ROOT,
                                                                                              c.eagle.init_from)))
    tc = c.eagle.train
    if args.batch_size:
        tc = dataclasses.replace(tc, batch_size=args.batch_size)
    if args.lr:
        tc = dataclasses.replace(tc, lr=args.lr)
    lm_t = engine.target_lm
    rows = distillation.answer_rows(c, engine.tokenizer, lm_t.cfg.pad_token_id)
    order = np.random.default_rng(0).permutation(len(rows["tokens"]))
    held_idx, train_idx = np.sort(order[: args.heldout]), np.sort(order[args.heldout:])
    held = {k: v[held_idx] for k, v in rows.items()}
    rows = {k: v[train_idx] for k, v in rows.items()}
    summary["train_rows"], summary["heldout_rows"] = len(train_idx), len(held_idx)
    summary["train_answer_tokens"] = int(np.sum(rows["lengths"] - rows["answer_start"]))
    summary["row_length"] = int(rows["tokens"].shape[1])
    log(f"rows: {len(train_idx)} training ({summary['train_answer_tokens']} answer tokens), {len(held_idx)} held out, "
        f"length {summary['row_length']}")
    vocab_ids = np.asarray(lm_checkpoint.load_head(c.eagle.init_from, dtype=None)[2], np.int32)
    tcfg = lm_t.cfg
    hcfg, p0 = distillation.eagle_init(c, tcfg, lm_t, vocab_ids)
    taps = tuple(c.eagle.taps)
    steps = args.steps or tc.steps
    probe_file = os.path.join(os.path.dirname(args.workdir.rstrip("/")), "probe.json")
    budget = end - args.reserve - time.monotonic()
    if os.path.isfile(probe_file):
        with open(probe_file) as f:
            p = json.load(f)
        per_step = p["train_step_s"] * (tc.batch_size / p["batch_size"]) * (summary["row_length"] / p["row_length"])
        fit = int((budget - p["train_compile_s"] - 20) / per_step)
        log(f"probe: {per_step * 1000:.1f} ms/step expected; {fit} steps fit in {budget:.0f}s")
        steps = max(100, min(steps, fit))
    tc = dataclasses.replace(tc, steps=steps, eval_every=max(steps // 4, 1), ckpt_every=max(steps // 8, 1))
    summary["train"] = dataclasses.asdict(tc)
    task = online.task(objectives.eagle_task(hcfg, tc), taps)
    fz = online.frozen(lm_t, vocab_ids)
    acc0 = loop.initial_acceptance(task, p0, fz, held, tc.batch_size)
    log(f"held-out teacher-forced top-1 before training: {acc0:.4f}")
    summary["acceptance_initial"] = acc0
    save_summary()
    res = loop.train(task, p0, fz, rows, held, tc, os.path.join(args.workdir, "eagle"), progress=False, log=log,
                      deadline=end - args.reserve)
    summary.update(steps_done=res.step, acceptance=res.evals, train_seconds=round(res.seconds, 1),
                   last_losses={k: res.losses[k] for k in sorted(res.losses)[-5:]})
    # The recipe as it ran: the flags' learning rate, batch and step count, the schedule cut to what fitted.
    c = dataclasses.replace(c, eagle=dataclasses.replace(c.eagle, train=tc))
    prov = {"recipe": c.to_json(), "command": " ".join(["python scripts/device/train_head.py", *sys.argv[1:]]),
            "target": loader.default_target(), "device_run": {
        k: summary[k] for k in ("device", "jax", "prompts", "answers", "train_rows", "train_answer_tokens")},
        "steps_done": res.step}
    path = lm_checkpoint.save_head(os.path.join(args.workdir, "eagle_head"), hcfg, res.params, target_cfg=tcfg,
                           vocab_ids=vocab_ids, provenance=prov, overwrite=True, dtype=c.out_dtype, taps=taps)
    loader.write_manifest(path)
    with tarfile.open(os.path.join(args.out, "head.tar"), "w") as tar:
        tar.add(path, arcname="eagle_head")
    log(f"head: step {res.step}, held-out top-1 {res.evals} -> {args.out}/head.tar")
    save_summary()
    # 4. What the head does on held-out rows: greedy chains of 5 from several answer offsets (τ, bonus excluded).
    if time.monotonic() < end - 10:
        feats = jax.jit(online.target_features, static_argnums=2)
        hf = {k: [] for k in ("features", "hidden", "top")}
        for s in range(0, len(held["tokens"]), 64):
            out = jax.device_get(feats(lm_t, held["tokens"][s: s + 64], taps))
            for k, v in zip(hf, out, strict=True):
                hf[k].append(np.asarray(v))
        held_f = {**held, **{k: np.concatenate(v) for k, v in hf.items()}}
        fzh = objectives.frozen_target(lm_t, vocab_ids)
        for name, params in (("initial", p0), ("trained", res.params)):
            tau = objectives.mean_chain_acceptance(hcfg, params, fzh, held_f, depth=c.eagle.chain_depth,
                                              batch_size=min(16, len(held_idx)))
            summary[f"chain{c.eagle.chain_depth}_tau_{name}"] = tau
            log(f"held-out greedy chain of {c.eagle.chain_depth}, {name} head: τ {tau:.3f}")
        save_summary()
    return 0


if __name__ == "__main__":
    sys.exit(main())
