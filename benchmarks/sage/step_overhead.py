"""How much of a speculative step is *not* model forwards (tree building, verification, KV compaction, switches).

    python benchmarks/sage/step_overhead.py [--policies chain,static,eagle2,sage] [--new-tokens 128]
        [--bench out/bench/bench.json]

Runs the policy on a "hollow" SmolLM2: the same vocabulary (49,152), layer count (30), KV-cache shape (3 kv heads
x 64) and draft depth as the real target, but d_model 64 and a 64-wide MLP, so the matmuls cost almost nothing and
what remains is the step's own work at the real sizes. Prints ms per step for AR and each tree policy; with
--bench, also that overhead as a share of the real model's measured ms per step.

An upper bound, not the split: the hollow model keeps the vocabulary-wide LM heads (and 30 layers' dispatch), so
their cost counts as overhead here. `step_profile.py` measures the split on the real model from an XLA profile.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np
from flax import nnx

from sage_jax.decoding.drafters import DraftSpec
from sage_jax.decoding.policies import TreePolicy
from sage_jax.engine import Engine
from sage_jax.models import Decoder, LMConfig


def hollow_smollm2() -> Decoder:
    cfg = LMConfig(vocab_size=49152, d_model=64, n_layers=30, n_heads=3, n_kv_heads=3, head_dim=64, mlp_dim=64,
                   tie_embeddings=True, eos_token_ids=(), pad_token_id=0)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    nnx.update(model, jax.tree.map(lambda x: x * 8.0 if x.ndim > 1 else x, nnx.state(model, nnx.Param)))
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="chain,static,eagle2,sage")
    ap.add_argument("--bench", help="bench.json of a real run: report overhead / real ms per step")
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    engine = Engine(hollow_smollm2(), draft_spec=DraftSpec(kind="self", n_layers=10))
    prompt = list(range(100, 160))
    rows = {}
    for name in ["ar"] + args.policies.split(","):
        policy = "ar" if name == "ar" else TreePolicy.named(name)
        engine.generate([prompt], policy=policy, max_new_tokens=args.new_tokens)  # compile
        g = [engine.generate([prompt], policy=policy, max_new_tokens=args.new_tokens) for _ in range(3)]
        ms = float(np.median([x.stats.decode_seconds / max(x.stats.steps, 1) for x in g]) * 1e3)
        rows[name] = ms
    real = {}
    if args.bench:
        with open(args.bench) as fh:
            for r in json.load(fh)["rows"]:
                if r["method"] in rows and r["kind"] == "ours":
                    steps = r["tokens"] / max(r["tau_plus_1"], 1e-9)
                    real[r["method"]] = r["seconds"] / steps * 1e3
    print("| policy | hollow-model ms/step (step's own work) | real ms/step | share |")
    print("|---|---|---|---|")
    for name, ms in rows.items():
        r = real.get(name)
        print(f"| {name} | {ms:.1f} | {'-' if r is None else f'{r:.1f}'} | "
              f"{'-' if r is None else f'{100 * ms / r:.0f}%'} |")


if __name__ == "__main__":
    main()
