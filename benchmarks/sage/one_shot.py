"""The main command as a user runs it once: `python -m sage_jax.generate --prompt P` with the defaults (SAGE,
`--budget auto`) against `--policy ar`, each answer in a fresh process, on a prompt set's first N prompts.

    python benchmarks/sage/one_shot.py [--prompt-set test-chat] [--prompts 8] [--max-new-tokens 128] [--out DIR]
                                       [--sage-args "--retrieval 7"]

Per prompt and policy: the whole command's wall time (imports, loading, compiling or loading the compiled
programs from the persistent cache, prefill, decode) and the decode rate the command reports; then the medians of
SAGE / AR. One warm-up run per policy first fills the compilation cache, as any earlier run on the machine would
(the first run ever compiles: tens of seconds for either). The two policies alternate per prompt, so that a noisy
machine affects both alike. Writes DIR/one_shot.json with what produced it (`configs.provenance`) and prints a
table; every SAGE answer is checked identical to AR's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from configs import provenance  # noqa: E402
from sage_jax.prompts import SETS, prompt_set  # noqa: E402


def one(prompt: str, policy: str, max_new: int, extra: list[str] = ()) -> dict:
    cmd = [sys.executable, "-m", "sage_jax.generate", "--prompt", prompt, "--policy", policy,
           "--max-new-tokens", str(max_new), "--json", *extra]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[1:4])} ... failed: {out.stderr.strip().splitlines()[-1:]}")
    res = json.loads(out.stdout)
    st = res["stats"]
    return {"wall_seconds": wall, "tokens_per_second": st["tokens_per_second"], "tokens": res["token_ids"],
            "compile_seconds": st["compile_seconds"], "decode_seconds": st["decode_seconds"],
            "budget": st["budget"], "tau_plus_1": st["mean_tokens_per_step"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-set", choices=SETS, default="test-chat")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/sage/results/readme/one_shot")
    ap.add_argument("--sage-args", default="", help="more flags for the SAGE runs (e.g. \"--retrieval 0\")")
    args = ap.parse_args(argv)
    extra = {"ar": [], "sage": shlex.split(args.sage_args)}
    texts = prompt_set(args.prompt_set)[: args.prompts]
    for policy in ("ar", "sage"):  # fills the compilation cache, as an earlier run would
        one(texts[0], policy, args.max_new_tokens, extra[policy])
    rows = []
    for i, text in enumerate(texts):
        order = ("ar", "sage") if i % 2 == 0 else ("sage", "ar")
        pair = {p: one(text, p, args.max_new_tokens, extra[p]) for p in order}
        ar, sage = pair["ar"], pair["sage"]
        rows.append({"prompt": text, "ar": ar, "sage": sage, "identical": ar["tokens"] == sage["tokens"],
                     "decode_ratio": sage["tokens_per_second"] / ar["tokens_per_second"],
                     "wall_ratio": sage["wall_seconds"] / ar["wall_seconds"]})
        print(f"{i + 1}/{len(texts)} decode {rows[-1]['decode_ratio']:.2f}x wall {rows[-1]['wall_ratio']:.2f}x "
              f"(SAGE {sage['wall_seconds']:.1f} s, AR {ar['wall_seconds']:.1f} s)", file=sys.stderr)
    summary = {"median_decode_ratio": statistics.median(r["decode_ratio"] for r in rows),
               "median_wall_ratio": statistics.median(r["wall_ratio"] for r in rows),
               "median_wall_seconds": {p: statistics.median(r[p]["wall_seconds"] for r in rows)
                                       for p in ("ar", "sage")},
               "identical": sum(r["identical"] for r in rows), "prompts": len(rows)}
    record = provenance.record("python benchmarks/sage/one_shot.py", argv, {"draft": _draft()})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "one_shot.json"), "w") as fh:
        json.dump({"provenance": record, "args": vars(args), "summary": summary, "rows": rows}, fh, indent=1)
    print("| prompt | SAGE/AR decode | SAGE/AR wall | SAGE wall s | AR wall s | budget | same |\n"
          "|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(f"| {i + 1} | {r['decode_ratio']:.2f}x | {r['wall_ratio']:.2f}x | {r['sage']['wall_seconds']:.1f} | "
              f"{r['ar']['wall_seconds']:.1f} | {r['sage']['budget']} | {'yes' if r['identical'] else 'NO'} |")
    print(f"\nmedian decode ratio {summary['median_decode_ratio']:.2f}x, median wall ratio "
          f"{summary['median_wall_ratio']:.2f}x, identical {summary['identical']}/{summary['prompts']}")
    return 0


def _draft():
    from sage_jax.io.loader import default_draft

    return default_draft()


if __name__ == "__main__":
    sys.exit(main())
