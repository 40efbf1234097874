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
from sage_jax.training.answers import read_answer_lines, read_answers, training_prompts
from sage_jax.training.self_prompts import sample as self_prompts


def _main(argv: list[str] | None) -> int:
    ap = cli.Parser(prog="python -m sage_jax.build_datastore", description=__doc__.splitlines()[0].split(": ", 1)[1])
    ap.add_argument("--answers", type=cli.integer(1, 10**7), default=4096, help="training prompts the target answers")
    ap.add_argument("--workdir", default="runs/datastore", help="answers.jsonl is kept here (resumable)")
    ap.add_argument("--out", metavar="DIR", help="where datastore.npz goes (default: WORKDIR)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing datastore.npz")
    ap.add_argument("--restart", action="store_true",
                    help="empty WORKDIR and answer again (a rerun with other settings is refused without it)")
    ap.add_argument("--batch", type=cli.integer(1, 4096), default=32, help="prompts per compiled batch")
    ap.add_argument("--max-new-tokens", type=cli.integer(1, cli.MAX_TOKENS), default=96)
    ap.add_argument("--length", type=cli.integer(1, 1024), default=8,
                    help="continuation depth the most frequent branch is taken to")
    ap.add_argument("--prompts", choices=("wordnet", "self"), default="wordnet",
                    help="training-split WordNet prompts, or user messages the target samples itself")
    ap.add_argument("--temperature", type=cli.number(0.0, 2.0), default=0.8,
                    help="sampling temperature of --prompts self")
    args = ap.parse_args(argv)
    if args.temperature == 0.0:  # the flag's type checks [0, 2]
        raise cli.BadInput(f"--temperature must be in (0, 2], got {args.temperature}")
    out = args.out or args.workdir
    cli.work_folder(args.workdir)
    cli.output_dir(out, "--out", args.force, ("datastore.npz",))
    from tqdm import tqdm

    from sage_jax.decoding import datastore

    path = os.path.join(args.workdir, "answers.jsonl")
    lines = read_answer_lines(path)
    if lines and (args.prompts == "self") != ("text" in lines[0]) and not args.restart:
        raise cli.BadInput(f"{path} holds answers to {'self' if 'text' in lines[0] else 'wordnet'} prompts, not "
                           f"--prompts {args.prompts}: use another --workdir")
    # The answers in WORKDIR are reused: only answers made the same way (more of them is fine).
    cli.settled(args.workdir, {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                               "temperature": args.temperature if args.prompts == "self" else None},
                restart=args.restart)
    os.makedirs(out, exist_ok=True)
    lines = read_answer_lines(path)  # none after --restart
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
    return cli.run(_main, argv, resumable=True)


if __name__ == "__main__":
    sys.exit(main())
