"""`python -m sage_jax.build_datastore`: the target answers training prompts; their n-grams become a datastore.

    python -m sage_jax.build_datastore [--answers 4096] [--workdir runs/datastore] [--out DIR] [--batch 32]
        [--max-new-tokens 96] [--length 8]

The default target (the shipped SmolLM2-135M-Instruct) answers the first N training-split WordNet prompts
(`training/wordnet.py`, the "extended" style; the held-out chat and benchmark prompts are kept out) greedily, in
batches of one compiled loop. Answers are appended to WORKDIR/answers.jsonl as they come, so a rerun (or a larger
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
    rows = {}
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    break
                rows[r["i"]] = (r["prompt"], r["answer"])
    return [rows[i] for i in sorted(rows)]


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
    args = ap.parse_args(argv)
    if args.answers < 1 or args.batch < 1 or args.max_new_tokens < 1 or args.length < 1:
        raise cli.BadInput("--answers, --batch, --max-new-tokens and --length must be >= 1")
    out = args.out or args.workdir
    for d in (args.workdir, out):
        if os.path.exists(d) and not os.path.isdir(d):
            raise cli.BadInput(f"{d} exists and is not a directory")
    os.makedirs(args.workdir, exist_ok=True)
    os.makedirs(out, exist_ok=True)
    from tqdm import tqdm

    from sage_jax.decoding import datastore

    path = os.path.join(args.workdir, "answers.jsonl")
    have = read_answers(path)
    prompts = [t for _, t in training_prompts(args.answers)]
    todo = list(range(len(have), len(prompts)))
    if todo:
        from sage_jax.engine import load_engine
        from sage_jax.io import loader

        cli.use_compilation_cache(os.path.join(loader.cache_dir(), "jax"))
        with cli.reported(OSError, ValueError):
            engine = load_engine()
        with open(path, "a") as f, tqdm(total=len(prompts), initial=len(have), desc="answers", unit="prompt") as bar:
            for s in range(0, len(todo), args.batch):
                idx = todo[s: s + args.batch]
                gen = engine.generate([prompts[i] for i in idx], policy="ar", max_new_tokens=args.max_new_tokens)
                for i, ids in zip(idx, gen.token_ids, strict=True):
                    f.write(json.dumps({"i": i, "prompt": engine.encode(prompts[i]), "answer": ids}) + "\n")
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
