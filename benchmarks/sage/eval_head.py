"""Decoded τ+1 of an EAGLE head on chat prompts: SAGE alone (the paper's settings), `ds` (SAGE + an 8-token
prompt-lookup chain + the datastore chain) and `ds0` (the same at θ = 0), 128 new tokens, batches of 8, every
output checked against AR. Readings of the paper's ambiguities, SAGE alone: `cumulative` (θ_l on the path's
probability, the formal statement), `no-history` (no D_max hysteresis), `cumulative-no-history` (both),
`theta0` (no threshold).

    python benchmarks/sage/eval_head.py HEAD PROMPTS OUT.json [alone,ds,ds0,cumulative,no-history,...]

HEAD: a head checkpoint directory (its datastore.npz lends the datastore chain) or "shipped". PROMPTS: `held`, the
24 `EVAL_PROMPTS`; `bench`, the bench's 32 chat prompts; or a set of `sage_jax.prompts.SETS` (`dev-chat`,
`test-chat`, ...), optionally its first N (`dev-chat:48`). Settings are chosen on `dev` sets; `test` only reports.
OUT.json records what produced it (commit, command line, the head's sha256, CPU, jax: `configs.provenance`).
"""

import json
import sys

from configs import provenance
from sage_jax.bench.acceptance import evaluate
from sage_jax.engine import load_engine
from sage_jax.io import loader
from sage_jax.prompts import EVAL_PROMPTS, SETS, bench_prompts, prompt_set

# Every chain merged (retrieval_gate 0): acceptance, the figure these rows report, not the speed-tuned default gate.
KW = {"alone": {}, "ds": {"retrieval": 8, "datastore": True, "retrieval_gate": 0.0},
      "ds0": {"retrieval": 8, "datastore": True, "theta": 0.0, "retrieval_gate": 0.0},
      "cumulative": {"threshold_prob": "cumulative"}, "no-history": {"history": False},
      "cumulative-no-history": {"threshold_prob": "cumulative", "history": False}, "theta0": {"theta": 0.0}}


def main(argv: list[str]) -> int:
    which, _, count = argv[1].partition(":") if len(argv) in (3, 4) else ("", "", "")
    if which not in ("held", "bench", *SETS) or (count and not count.isdigit()):
        print(next(ln.strip() for ln in __doc__.splitlines() if ln.strip().startswith("python")), file=sys.stderr)
        return 2
    head, out = argv[0], argv[2]
    keys = argv[3].split(",") if len(argv) == 4 else ["alone", "ds0"]
    if unknown := [k for k in keys if k not in KW]:
        print(f"unknown row {unknown[0]!r}; expected some of {','.join(KW)}", file=sys.stderr)
        return 2
    engine = load_engine(None, None if head == "shipped" else head)
    texts = (bench_prompts() if which == "bench" else [t for _, t in EVAL_PROMPTS] if which == "held"
             else prompt_set(which))[:int(count) if count else None]
    ids = [engine.encode(t) for t in texts]
    res = {"head": head, "prompts": argv[1], "n": len(ids), "max_new_tokens": 128, "batch": 8,
           "provenance": provenance.record("python benchmarks/sage/eval_head.py", argv,
                                           {"draft": loader.DEFAULT_DRAFT if head == "shipped" else head})}
    for k in keys:
        r = evaluate(engine, ids, ["sage"], 128, batch=8, policy_kw=KW[k], progress=False)["sage"]
        res[k] = {f: r.get(f) for f in ("tau", "tokens_per_step", "identical", "per_prompt_min", "per_prompt_max")}
        print(k, res[k], flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
