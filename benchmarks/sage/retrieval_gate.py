"""Retrieval gate sweep: SAGE + an 8-token retrieval chain at its full tree (gate 0 / 0.3 / 0.5) against SAGE and
AR, on 8 held-out chat prompts (64 new tokens) and the 8 copy-heavy prompts (96), batch 1, greedy, the shipped head.

    .venv/bin/python benchmarks/sage/retrieval_gate.py   # about 15 min on a 2-core CPU

τ+1 here is new tokens per loop step (the prefill's first token included); "chain steps": steps that merged a
chain. Every row checks its output against AR's.
"""

import time

import sage_jax
from sage_jax.decoding.policies import TreePolicy
from sage_jax.prompts import COPY_PROMPTS, EVAL_PROMPTS


def main() -> None:
    e = sage_jax.load_engine()
    sets = {"chat": ([e.encode(t) for _, t in EVAL_PROMPTS[:8]], 64),
            "copy": ([e.encode(t) for _, t in COPY_PROMPTS], 96)}
    pols = {"ar": "ar", "sage": TreePolicy.sage()}
    pols.update({f"gate{g}": TreePolicy.sage(retrieval=8, retrieval_gate=g) for g in (0.0, 0.3, 0.5)})
    for name, (prompts, n) in sets.items():
        ref = {}
        for pn, pol in pols.items():
            e.generate([prompts[0]], policy=pol, max_new_tokens=n)  # compile
            t0, toks, steps, chain, same = time.perf_counter(), 0, 0, 0, True
            for i, p in enumerate(prompts):
                g = e.generate([p], policy=pol, max_new_tokens=n)
                ref.setdefault(i, g.token_ids)
                same &= g.token_ids == ref[i]
                toks += len(g.token_ids[0])
                steps += g.stats.steps
                chain += g.stats.retrieval_steps
            dt = time.perf_counter() - t0
            print(f"{name:5s} {pn:8s} tok/s {toks / dt:6.1f}  tau+1 {toks / max(steps, 1):.2f}  "
                  f"chain steps {chain}/{steps}  same as AR {same}", flush=True)


if __name__ == "__main__":
    main()
