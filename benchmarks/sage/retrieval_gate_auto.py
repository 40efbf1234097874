"""Retrieval gate under `--budget auto`: our AR, SAGE, and SAGE + a 7-token prompt-lookup chain at each gate, on the
bench's first 16 chat prompts and the 8 copy-heavy prompts, 128 new tokens, batch 1, greedy, the shipped head.

    .venv/bin/python benchmarks/sage/retrieval_gate_auto.py [GATES]    # GATES default 0,0.5; ~15 min on 2 cores

Per prompt every method runs once, interleaved (one engine: each policy's budget chooser learns across the set as
the bench's does); prints tokens/s relative to AR per set and the budgets the chooser took. Every output is
checked against AR's.
"""

import sys
import time

import sage_jax
from sage_jax.decoding.policies import TreePolicy
from sage_jax.prompts import COPY_PROMPTS, bench_prompts


def main(argv: list[str]) -> None:
    gates = [float(g) for g in (argv[0] if argv else "0,0.5").split(",")]
    e = sage_jax.load_engine()
    pols = {"ar": "ar", "sage": "sage"}
    pols.update({f"gate {g}": TreePolicy.sage(retrieval=7, retrieval_gate=g) for g in gates})
    for set_name, texts in (("chat", bench_prompts(16)), ("copy", [t for _, t in COPY_PROMPTS])):
        prompts = [e.encode(t) for t in texts]
        secs, toks, ref, budgets = dict.fromkeys(pols, 0.0), dict.fromkeys(pols, 0), {}, {k: set() for k in pols}
        for k, pol in pols.items():  # compile outside the timing
            e.generate([prompts[0]], policy=pol, max_new_tokens=128, budget=None if k == "ar" else "auto")
        for i, p in enumerate(prompts):
            for k, pol in pols.items():
                t0 = time.perf_counter()
                g = e.generate([p], policy=pol, max_new_tokens=128, budget=None if k == "ar" else "auto")
                secs[k] += time.perf_counter() - t0
                ids = list(g.token_ids[0])
                toks[k] += len(ids)
                if ref.setdefault(i, ids) != ids:
                    raise SystemExit(f"{k} differs from AR on {set_name} prompt {i}")
                if k != "ar":
                    budgets[k].add(tuple(int(x) for x in g.stats.budget))
        ar = toks["ar"] / secs["ar"]
        print(set_name, " | ".join(f"{k}: {toks[k] / secs[k] / ar:.2f}x" for k in pols), flush=True)
        for k in pols:
            if k != "ar":
                print(f"   {k} budgets {sorted(budgets[k])}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
