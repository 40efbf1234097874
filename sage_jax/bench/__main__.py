"""`python -m sage_jax.bench`: our AR and speculative decoders vs transformers on the same weights, one process.

    python -m sage_jax.bench [--prompts N] [--prompt-set SET | --prompts-file FILE] [--max-new-tokens 128]
                             [--budget auto|static|N,D] [--methods a,b] [--sweep 7,31,64] [--no-hf] [--no-ablations]
                             [--attention xla|pallas] [--matmul auto|xla|exact] [--out DIR] [--quick]

`--prompt-set`: a split of `sage_jax/prompts.py`, whole or one kind: `test` (frozen: what the README quotes),
`test-chat` (the default), `test-copy`, `test-code`, and the same of `dev` (where settings are chosen).
`--prompts-file FILE` measures on your own prompts (one per line, or JSONL with a "prompt" field). Prints a Markdown
table; writes DIR/bench.json, DIR/table.md and DIR/*.png, the first two with what produced them
(commit, command line, the draft's sha256, CPU, jax; `configs.provenance`). `--quick`: tiny random target, CI smoke
run.

    python -m sage_jax.bench --vlm --target VLM [--draft VLM] [--image PATH ...] [--video PATH ...] [--ratios R,...]

measures a vision-language pair instead: AR vs every tree policy, and the draft visual-token pruning sweep
(`sage_jax/bench/vlm.py`). Without --target it asks the shipped VLM about held-out Fashion-MNIST test images (or
clips, `--clips`); a dev `--prompt-set` reads dev ones instead, where a draft is chosen.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from configs import cli, provenance
from sage_jax.models.config import MATMULS
from sage_jax.prompts import SETS


def _sweep(text: str) -> tuple[int, ...]:
    """--sweep: comma-separated node budgets, each in [1, 4096]."""
    parse = cli.integer(1, 4096)
    return tuple(parse(t.strip()) for t in text.split(",") if t.strip())


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = cli.Parser(prog="python -m sage_jax.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="target LM (default: the shipped SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--draft", help="main draft: an EAGLE-style head or an LM checkpoint (default: the shipped "
                                    "head, else the self-draft)")
    ap.add_argument("--draft-layers", type=cli.integer(1, 1000), default=10,
                    help="layers of the self-draft / truncated LM draft")
    ap.add_argument("--draft-lm", help="LM draft for chain-lm and transformers' assisted generation (default: the "
                                       "target truncated to --draft-layers)")
    ap.add_argument("--prompts", type=cli.integer(0, 10**6), default=0,
                    help="use the first N prompts (default: all of the set)")
    ap.add_argument("--prompt-set", choices=SETS, default="test-chat", help="a prompt split, whole or one kind "
                    "(chat; copy: the answer repeats the prompt, where retrieval chains pay; code): test is frozen "
                    "and quoted, dev is where settings are chosen")
    ap.add_argument("--prompts-file", metavar="FILE", help="your own prompts instead of a set: one per line, or JSONL "
                    "(.jsonl) with a \"prompt\" field per line")
    ap.add_argument("--max-new-tokens", type=cli.integer(1, cli.MAX_TOKENS), default=128)
    ap.add_argument("--budget", default="auto", help="tree budget: auto (measured cost profile), static, or N,D")
    ap.add_argument("--methods", help="comma-separated subset of methods (ar is always included)")
    ap.add_argument("--sweep", type=_sweep, default=(), help="also run SAGE at these fixed node budgets, e.g. 7,31,64")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    ap.add_argument("--no-ablations", action="store_true", help="skip the SAGE ablations")
    ap.add_argument("--attention", choices=("xla", "pallas"), default="xla", help="attention of our decoding "
                    "loops' forwards: XLA einsums, or the Pallas tree-attention kernel (interpreted on CPU)")
    ap.add_argument("--matmul", choices=MATMULS, default="auto", help="our models' matmuls: auto (on CPU "
                    "the few rows of a decode / verify step through the skinny kernel), XLA's dot throughout, or "
                    "exact (shape-invariant: SAGE equals AR bit for bit)")
    ap.add_argument("--out", default="out/bench", help="folder for bench.json and the plots")
    ap.add_argument("--force", action="store_true", help="overwrite the results of an earlier run in --out")
    ap.add_argument("--quick", action="store_true", help="tiny random target, 3 prompts, 32 tokens (CI smoke)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--vlm", action="store_true", help="benchmark a vision-language target (bench/vlm.py)")
    ap.add_argument("--image", action="append", default=[], help="--vlm: an image to ask about (repeatable; "
                    "default: scikit-image's sample photos)")
    ap.add_argument("--video", action="append", default=[], help="--vlm: a video (animated image, frame folder "
                    "or .npy; repeatable)")
    ap.add_argument("--clips", action="store_true", help="--vlm on the shipped VLM: ask which items appear in "
                    "held-out clips of Fashion-MNIST items (sage_jax.training.vlm_data.heldout_clips) instead of "
                    "about held-out images; both from the test split, or dev with a dev --prompt-set")
    ap.add_argument("--ratios", default="", help="--vlm: the pruning ratios to sweep (default: the paper's "
                    "0,0.3,0.6,0.8,0.9,0.95)")
    ap.add_argument("--prune", choices=("attention", "uniform"), default="attention",
                    help="--vlm: how the draft's visual tokens are chosen")
    args = ap.parse_args(argv)
    if args.quick:
        args.max_new_tokens = min(args.max_new_tokens, 32)
    return args


#: The results files a run writes into --out whatever its settings (the plots vary: `cli.end_outputs` lists them).
OUTPUTS = ("bench.json", "table.md", "vlm_bench.json")


def _main(argv: list[str] | None) -> int:
    args = parse(argv)
    from sage_jax.bench import suite

    cli.output_dir(args.out, "--out", args.force, OUTPUTS)
    if args.clips and not args.vlm:
        raise cli.BadInput("--clips goes with --vlm")
    if args.vlm:
        from sage_jax.bench import vlm

        if args.prompts_file:
            raise cli.BadInput("--prompts-file takes text prompts; --vlm asks about --image / --video")
        if args.clips and (args.target or args.quick or args.image or args.video):
            raise cli.BadInput("--clips asks the shipped VLM about held-out clips; it takes no --target, --quick, "
                               "--image or --video")
        if args.budget == "auto" and "--budget" not in (argv or sys.argv[1:]):
            args.budget = "static"  # the trees themselves are measured (auto may decode plainly on a CPU)
        vlm.settings(args)
        cli.begin_outputs(args.out, OUTPUTS)
        return vlm.run(args, argv)
    s = suite.build(args)
    try:
        return _measure(s, args, argv)
    finally:
        s.close()  # transformers' export of the target, on every exit path


def _measure(s, args, argv) -> int:
    from sage_jax.bench import plots, run

    # After every check: a refused run leaves no empty folder behind; a forced one removes the earlier run's files.
    cli.begin_outputs(args.out, OUTPUTS)
    record = run.provenance(argv, s.draft_path)
    meta = {"title": s.title, "machine": provenance.machine(record), "provenance": record, "profile": s.profile,
            "args": vars(args)}

    def partial(results):  # an interrupted long run still leaves every finished prompt in bench.json
        run.write_json(os.path.join(args.out, "bench.json"), run.summarise(results), results, meta)

    results = run.run_methods(s.runners, s.methods, s.prompts, progress=not args.no_progress, on_prompt=partial)
    rows = run.summarise(results)
    table = run.markdown(rows)
    per_kind = run.by_kind(results, s.kinds) if s.kinds and len(set(s.kinds)) > 1 else None
    if per_kind:
        table += "\n\nBy kind of prompt:\n\n" + run.kind_markdown(per_kind)
    run.write_json(os.path.join(args.out, "bench.json"), rows, results, meta, per_kind)
    run.write_table(os.path.join(args.out, "table.md"), s.title, record, table)
    with open(os.path.join(args.out, "bench.json")) as fh:
        traces = json.load(fh)["traces"]
    pngs = plots.all_plots(rows, traces, s.profile, args.out, s.title)
    cli.end_outputs(args.out, ["bench.json", "table.md", *pngs])
    print(f"\n{s.title}\n{meta['machine']}\n\n{table}\n")
    print(f"wrote {os.path.join(args.out, 'bench.json')}, table.md and {', '.join(pngs)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
