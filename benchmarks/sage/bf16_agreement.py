"""How often SAGE's output equals plain decoding's in bfloat16, where a verify forward over k+1 rows can round a
near-tie differently from a one-token step (README, Exactness).

    python benchmarks/sage/bf16_agreement.py OUT.json [--prompts 8] [--max-new-tokens 96] [--dtypes bfloat16,float32]

The shipped SmolLM2-135M-Instruct and head, SAGE's full trees (`budget=None`, the policy's static sizes) against
AR, one prompt at a time, on the held-out chat prompts, with XLA's dot (`matmul="xla"`: what TPUs and GPUs run; on
a CPU in float32 our skinny kernel makes every row's bits independent of the row count, so there the outputs always
agree). Per dtype: the share of identical outputs and, for each that differs, the position of the first differing
token. OUT.json records what produced it (`configs.provenance`).
"""

from __future__ import annotations

import argparse
import json
import time

from configs import provenance
from sage_jax.engine import load_engine
from sage_jax.io import loader
from sage_jax.prompts import EVAL_PROMPTS


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where `a` and `b` differ (one ending early counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args(argv)
    prompts = [t for _, t in EVAL_PROMPTS[: args.prompts]]
    result = {"provenance": provenance.record("python benchmarks/sage/bf16_agreement.py", argv,
                                              {"draft": loader.default_draft()}),
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "matmul": "xla", "rows": {}}
    for dtype in args.dtypes.split(","):
        t0 = time.perf_counter()
        engine = load_engine(dtype=dtype, matmul="xla")
        diffs = []
        for p in prompts:
            ar = engine.generate([p], policy="ar", max_new_tokens=args.max_new_tokens).token_ids[0]
            sage = engine.generate([p], policy="sage", budget=None, max_new_tokens=args.max_new_tokens)
            diffs.append(first_difference(sage.token_ids[0], ar))
        same = sum(d is None for d in diffs)
        result["rows"][dtype] = {"identical": same, "first_difference": diffs}
        print(f"{dtype}: {same} / {len(prompts)} identical to AR; first differing token at "
              f"{sorted(d for d in diffs if d is not None)} ({time.perf_counter() - t0:.0f}s)")
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
