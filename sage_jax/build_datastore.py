"""`python -m sage_jax.build_datastore`: the target answers training prompts; their n-grams become a datastore.

    python -m sage_jax.build_datastore [--answers 4096] [--workdir runs/datastore] [--out DIR] [--batch 32]
        [--max-new-tokens 96] [--length 8] [--prompts wordnet|self] [--temperature 0.8]

The default target (the shipped SmolLM2-135M-Instruct) answers the first N training-split WordNet prompts
(`training/wordnet.py`, the "extended" style; the held-out chat and benchmark prompts are kept out) greedily, in
batches of one compiled loop. With `--prompts self` the prompts are the target's own: user messages it samples
(at --temperature) from its chat template's empty user slot (`training/self_prompts.py`), kept in
WORKDIR/prompts.jsonl (resumable) and filtered (unfinished, not plain text, near a held-out prompt, repeats).
Answers are appended to WORKDIR/answers.jsonl as they come, so a rerun (or a larger
--answers) resumes where the last run stopped. Then `decoding/datastore.py` builds the datastore from them and it is
written to OUT/datastore.npz (default: WORKDIR). A draft checkpoint directory holding a datastore.npz lends it to
`load_engine` (the shipped one is `sage_jax/assets/smollm2_eagle/`; rewrite its SHA256SUMS with
`sage_jax.io.loader.write_manifest` after replacing it). Bad input: one line `error: ...`, exit code 2.
"""

from __future__ import annotations

import json
import os
import sys
import time

from configs import cli


def read_answers(path: str) -> list[tuple[list[int], list[int]]]:
    """The (prompt ids, answer ids) pairs of an answers.jsonl, in prompt order (a torn last line is dropped)."""
    return [(r["prompt"], r["answer"]) for r in read_answer_lines(path)]


def read_answer_lines(path: str) -> list[dict]:
    """The lines of an answers.jsonl as dicts, in prompt order (a torn last line is dropped); lines of `--prompts
    self` carry their prompt's "text" and "kind"."""
    rows = {}
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    break
                rows[r["i"]] = r
    return [rows[i] for i in sorted(rows)]


def self_prompts(engine, path: str, n: int, *, batch: int, temperature: float, max_tokens: int = 64,
                 progress: bool = True, deadline: float | None = None) -> list[str]:
    """The first `n` acceptable user messages the target samples, batch by batch (batch k at seed k, opening with
    `self_prompts.STARTERS[k]`), appended to `path` as they come so that a rerun resumes; fewer when a batch ends
    after `deadline` (a `time.monotonic()` value)."""
    from tqdm import tqdm

    from sage_jax import chat
    from sage_jax.training import self_prompts as sp

    texts, seen, seed = [], set(), 0
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    break
                seed = r["seed"] + 1
                for t in r["texts"]:
                    if t not in seen:
                        seen.add(t)
                        texts.append(t)
    if len(texts) >= n:
        return texts[:n]
    prefix, held = sp.user_prefix_ids(engine.tokenizer), sp.held_out_words()
    eos = set(engine.cfg.eos_token_ids)
    with open(path, "a") as f, tqdm(total=n, initial=len(texts), desc="prompts", unit="prompt",
                                    disable=not progress) as bar:
        while len(texts) < n and (deadline is None or time.monotonic() < deadline):
            start = sp.STARTERS[seed % len(sp.STARTERS)]
            opening = engine.tokenizer.encode(start, add_special_tokens=False) if start else []
            gen = engine.generate([prefix + opening] * batch, policy="ar", temperature=temperature,
                                  max_new_tokens=max_tokens, seed=seed)
            kept = []
            for ids in gen.token_ids:  # decoded with the opening, so the word boundary after it stays
                text = chat.decode(engine.tokenizer, opening + list(ids), eos).strip()
                if text not in seen and sp.acceptable(text, any(t in eos for t in ids), held):
                    seen.add(text)
                    kept.append(text)
            f.write(json.dumps({"seed": seed, "texts": kept}) + "\n")
            f.flush()
            texts += kept
            bar.update(min(len(kept), n - bar.n))
            seed += 1
    return texts[:n]


def training_prompts(n: int) -> list[tuple[str, str]]:
    """The (kind, text) of the first `n` prompts the target answers: training-split WordNet prompts, "extended"."""
    from sage_jax.training import wordnet

    return wordnet.build_prompts(n, "train", style="extended")


def _main(argv: list[str] | None) -> int:
    ap = cli.Parser(prog="python -m sage_jax.build_datastore", description=__doc__.splitlines()[0].split(": ", 1)[1])
    ap.add_argument("--answers", type=int, default=4096, help="training prompts the target answers")
    ap.add_argument("--workdir", default="runs/datastore", help="answers.jsonl is kept here (resumable)")
    ap.add_argument("--out", metavar="DIR", help="where datastore.npz goes (default: WORKDIR)")
    ap.add_argument("--batch", type=int, default=32, help="prompts per compiled batch")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--length", type=int, default=8, help="continuation depth the most frequent branch is taken to")
    ap.add_argument("--prompts", choices=("wordnet", "self"), default="wordnet",
                    help="training-split WordNet prompts, or user messages the target samples itself")
    ap.add_argument("--temperature", type=float, default=0.8, help="sampling temperature of --prompts self")
    args = ap.parse_args(argv)
    if args.answers < 1 or args.batch < 1 or args.max_new_tokens < 1 or args.length < 1:
        raise cli.BadInput("--answers, --batch, --max-new-tokens and --length must be >= 1")
    if not 0 < args.temperature <= 2:
        raise cli.BadInput(f"--temperature must be in (0, 2], got {args.temperature}")
    out = args.out or args.workdir
    for d in (args.workdir, out):
        if os.path.exists(d) and not os.path.isdir(d):
            raise cli.BadInput(f"{d} exists and is not a directory")
    os.makedirs(args.workdir, exist_ok=True)
    os.makedirs(out, exist_ok=True)
    from tqdm import tqdm

    from sage_jax.decoding import datastore

    path = os.path.join(args.workdir, "answers.jsonl")
    lines = read_answer_lines(path)
    if lines and (args.prompts == "self") != ("text" in lines[0]):
        raise cli.BadInput(f"{path} holds answers to {'self' if 'text' in lines[0] else 'wordnet'} prompts, not "
                           f"--prompts {args.prompts}: use another --workdir")
    have = read_answers(path)
    engine = None
    if len(have) < args.answers:
        from sage_jax.engine import load_engine
        from sage_jax.io import loader

        cli.use_compilation_cache(os.path.join(loader.cache_dir(), "jax"))
        with cli.reported(OSError, ValueError):
            engine = load_engine()
    if args.prompts == "self":
        prompts = ([r["text"] for r in lines][: args.answers] if engine is None else
                   self_prompts(engine, os.path.join(args.workdir, "prompts.jsonl"), args.answers, batch=args.batch,
                                temperature=args.temperature))
        kind = {"kind": "chat"}
    else:
        prompts, kind = [t for _, t in training_prompts(args.answers)], {}
    todo = list(range(len(have), len(prompts)))
    if todo:
        with open(path, "a") as f, tqdm(total=len(prompts), initial=len(have), desc="answers", unit="prompt") as bar:
            for s in range(0, len(todo), args.batch):
                idx = todo[s: s + args.batch]
                gen = engine.generate([prompts[i] for i in idx], policy="ar", max_new_tokens=args.max_new_tokens)
                for i, ids in zip(idx, gen.token_ids, strict=True):
                    text = {"text": prompts[i], **kind} if kind else {}
                    f.write(json.dumps({"i": i, "prompt": engine.encode(prompts[i]), "answer": ids, **text}) + "\n")
                f.flush()
                bar.update(len(idx))
        have = read_answers(path)
    t0 = time.perf_counter()
    store = datastore.build(have[: len(prompts)], length=args.length)
    file = datastore.save(store, out)
    print(f"{store.describe()}; built in {time.perf_counter() - t0:.0f} s, {os.path.getsize(file) / 2**20:.1f} MiB "
          f"-> {file}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
