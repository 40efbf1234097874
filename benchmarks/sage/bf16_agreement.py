"""How often SAGE's output equals plain decoding's, and what the exact mode costs (README, Exactness).

    python benchmarks/sage/bf16_agreement.py OUT.json [--prompts 24] [--max-new-tokens 96]
        [--modes bfloat16:xla,bfloat16:exact,float32:xla,bfloat16:exact:tp2]

The shipped SmolLM2-135M-Instruct and head, SAGE's full trees (`budget=None`, the policy's static sizes) against
AR, one prompt at a time, on the held-out chat prompts, in each mode DTYPE:MATMUL. With XLA's dot (`xla`: what TPUs
and GPUs run) a verify forward over k+1 rows can round a near-tie differently from a one-token step, most often in
bfloat16; the exact mode (`exact`, `LMConfig.matmul`) makes every row's bits independent of the row count and a
tree node compute as the same token decoded alone, so there the outputs must agree. Per mode: the share of
identical outputs, for each that differs the position of the first differing token, and the wall time of AR and of
SAGE over all prompts (after one warm-up prompt that compiles), as tokens/s and against the first mode's AR.
A mode with a third field `tpN` runs on an N-way tensor-parallel mesh of this machine's devices, and its row also
counts the prompts whose AR and SAGE outputs both equal the one-device run of the same DTYPE:MATMUL (listed
before it): the exact mode's promise extends to meshes. OUT.json records what produced it (`configs.provenance`).
"""

from __future__ import annotations

import argparse
import json
import time

import jax

from configs import provenance, sharding
from sage_jax.engine import load_engine
from sage_jax.io import loader
from sage_jax.prompts import EVAL_PROMPTS


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where `a` and `b` differ (one ending early counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(engine, prompts: list[str], max_new_tokens: int) -> dict:
    """AR and SAGE (full trees) on every prompt, after one warm-up: agreement and wall times."""
    gen = lambda p, **kw: engine.generate([p], max_new_tokens=max_new_tokens, **kw)  # noqa: E731
    gen(prompts[0], policy="ar"), gen(prompts[0], policy="sage", budget=None)  # compiles
    diffs, ar_s, sage_s, ar_n, sage_n, outputs = [], 0.0, 0.0, 0, 0, []
    for p in prompts:
        t0 = time.perf_counter()
        ar = gen(p, policy="ar").token_ids[0]
        t1 = time.perf_counter()
        sage = gen(p, policy="sage", budget=None).token_ids[0]
        t2 = time.perf_counter()
        ar_s, sage_s, ar_n, sage_n = ar_s + t1 - t0, sage_s + t2 - t1, ar_n + len(ar), sage_n + len(sage)
        diffs.append(first_difference(sage, ar))
        outputs.append((ar, sage))
    return {"identical": sum(d is None for d in diffs), "first_difference": diffs,
            "ar_tok_s": round(ar_n / ar_s, 2), "sage_tok_s": round(sage_n / sage_s, 2), "outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--modes", default="bfloat16:xla,bfloat16:exact,float32:xla")
    args = ap.parse_args(argv)
    prompts = [t for _, t in EVAL_PROMPTS[: args.prompts]]
    modes = [tuple(m.split(":")) for m in args.modes.split(",")]
    result = {"provenance": provenance.record("python benchmarks/sage/bf16_agreement.py", argv,
                                              {"draft": loader.default_draft()}),
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "rows": {}}
    base = None
    outputs = {}
    for dtype, matmul, *tp in modes:
        t0 = time.perf_counter()
        ways = int(tp[0].removeprefix("tp")) if tp else 1
        mesh = sharding.make_mesh(data=1, model=ways, devices=jax.devices()[:ways]) if tp else None
        row = compare(load_engine(dtype=dtype, matmul=matmul, mesh=mesh), prompts, args.max_new_tokens)
        outs = row.pop("outputs")
        if not tp:
            outputs[(dtype, matmul)] = outs
        elif (dtype, matmul) in outputs:
            one = outputs[(dtype, matmul)]
            row["same_as_one_device"] = sum(a == b == o[0] for (a, b), o in zip(outs, one, strict=True))
        base = base or row["ar_tok_s"]
        row["ar_vs_first_ar"] = round(row["ar_tok_s"] / base, 3)
        row["sage_vs_first_ar"] = round(row["sage_tok_s"] / base, 3)
        name = ":".join((dtype, matmul, *tp))
        result["rows"][name] = row
        same = f" ({row['same_as_one_device']} equal to one device's)" if "same_as_one_device" in row else ""
        print(f"{name}: {row['identical']} / {len(prompts)} identical to AR{same}; first differing token at "
              f"{sorted(d for d in row['first_difference'] if d is not None)}; AR {row['ar_tok_s']} tok/s "
              f"({row['ar_vs_first_ar']}x), SAGE {row['sage_tok_s']} tok/s ({row['sage_vs_first_ar']}x) "
              f"({time.perf_counter() - t0:.0f}s)", flush=True)
        with open(args.out, "w") as fh:  # after every mode: a run cut short keeps what it measured
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
