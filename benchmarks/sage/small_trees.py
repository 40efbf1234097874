"""Small trees on CPU with the shipped head: how often its first draft token is right, and what small fixed budgets
cost and give, with the skinny matmul kernel and with XLA's dot.

1. The head's top-1 agreement with the target, teacher-forced on the target's own greedy answers (64 new tokens)
   to the 24 held-out `EVAL_PROMPTS`: every answer position, the target's features, as in training.
2. The same prompts decoded with a one-node tree (chain, budget (1, 1)): the share of steps whose draft token is
   accepted.
3. Plain decoding and SAGE at fixed budgets (1, 1), (3, 2), (7, 4) on the first `--prompts` bench prompts (64 new
   tokens), `LMConfig.matmul` "auto" and "xla": tok/s, τ+1, ms per step, every configuration interleaved per
   prompt and timed at its fastest of two rounds.

    python benchmarks/sage/small_trees.py [--prompts 3] [--out benchmarks/sage/results/small_trees.md]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

BUDGETS = (None, (1, 1), (3, 2), (7, 4))


def teacher_forced_agreement(engine) -> tuple[float, dict[str, float]]:
    from sage_jax.models import eagle_head
    from sage_jax.prompts import EVAL_PROMPTS

    t, d = engine.target_lm, engine.draft

    @jax.jit
    def argmaxes(t, d, ids):
        n = ids.shape[1]
        pos, mask = jnp.arange(n)[None], jnp.tril(jnp.ones((n, n), bool))[None]
        hidden, _ = t.forward(ids, pos, mask)
        logits, _, _ = eagle_head.eagle_forward(d.head, d.cfg, t.embed, t.final_norm, t.lm_head, ids,
                                                eagle_head.shift_features(hidden), pos, mask, vocab=d.vocab)
        drafted = jnp.argmax(logits, -1)
        return jnp.argmax(t.head(hidden), -1), d.vocab.ids[drafted] if d.vocab is not None else drafted

    hits, kinds = [], {}
    for kind, text in EVAL_PROMPTS:
        prompt = engine.encode(text)
        answer = list(engine.generate([prompt], policy="ar", max_new_tokens=64).token_ids[0])
        target, draft = map(np.asarray, argmaxes(t, d, jnp.asarray([prompt + answer], jnp.int32)))
        lo, hi = len(prompt), len(prompt) + len(answer) - 1  # position j predicts token j + 1 of the answer
        m = draft[0, lo:hi] == target[0, lo:hi]
        hits.append(m)
        kinds.setdefault(kind, []).append(m)
    return float(np.concatenate(hits).mean()), {k: float(np.concatenate(v).mean()) for k, v in kinds.items()}


def one_node_acceptance(engine) -> tuple[float, int]:
    import sage_jax
    from sage_jax.prompts import EVAL_PROMPTS

    accepted = steps = 0
    for _, text in EVAL_PROMPTS:
        s = engine.generate([engine.encode(text)], policy=sage_jax.TreePolicy.chain(), max_new_tokens=64,
                            budget=(1, 1)).stats
        accepted += s.mean_accepted * s.steps
        steps += s.steps
    return accepted / steps, steps


def budget_rows(engines: dict, prompts: list[list[int]], rounds: int = 2) -> dict[tuple, tuple]:
    """{(matmul, budget): (tok/s, τ+1, ms/step)}: every configuration run on every prompt in interleaved rounds,
    each (configuration, prompt) timed at its fastest round (the machine is shared)."""
    import sage_jax

    configs = [(m, b) for m in engines for b in BUDGETS]
    best: dict[tuple, list] = {}
    for m, budget in configs:  # compiles
        policy = "ar" if budget is None else sage_jax.TreePolicy.sage()
        engines[m].generate([prompts[0]], policy=policy, max_new_tokens=64, budget=budget)
    for _ in range(rounds):
        for i, p in enumerate(prompts):
            for m, budget in configs:
                policy = "ar" if budget is None else sage_jax.TreePolicy.sage()
                s = engines[m].generate([p], policy=policy, max_new_tokens=64, budget=budget).stats
                key = (m, budget, i)
                if key not in best or s.decode_seconds < best[key][1]:
                    best[key] = [s.new_tokens, s.decode_seconds, s.steps]
    out = {}
    for m, budget in configs:
        toks, secs, steps = (sum(best[(m, budget, i)][j] for i in range(len(prompts))) for j in range(3))
        out[(m, budget)] = (toks / secs, toks / steps, 1e3 * secs / steps)
    return out


def main() -> None:
    import sage_jax
    from sage_jax.prompts import bench_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/sage/results/small_trees.md")
    ap.add_argument("--speed-only", action="store_true", help="skip parts 1 and 2")
    args = ap.parse_args()
    engines = {m: sage_jax.load_engine(matmul=m) for m in ("auto", "xla")}
    tf, per_kind = teacher_forced_agreement(engines["auto"]) if not args.speed_only else (float("nan"), {})
    p1, n_steps = one_node_acceptance(engines["auto"]) if not args.speed_only else (float("nan"), 0)
    prompts = [engines["auto"].encode(t) for t in bench_prompts(args.prompts)]
    lines = [f"`python benchmarks/sage/small_trees.py --prompts {args.prompts}`; {jax.devices()[0].device_kind}, "
             f"jax {jax.__version__}; the shipped head.", "",
             f"Teacher-forced top-1 agreement on the target's answers to the 24 EVAL_PROMPTS: **{tf:.3f}** "
             f"({', '.join(f'{k} {v:.2f}' for k, v in per_kind.items())}).", "",
             f"Decoded with a one-node tree (budget (1, 1)): the draft token accepted in **{p1:.3f}** of "
             f"{n_steps} steps.", "",
             f"Fixed budgets on the first {args.prompts} bench prompts, 64 new tokens:", "",
             "| matmul | budget | tok/s | vs plain (same matmul) | τ+1 | ms/step |", "|---|---|---|---|---|---|"]
    rows = budget_rows(engines, prompts)
    for (m, budget), (tps, tau1, ms) in rows.items():
        lines.append(f"| {m} | {'plain' if budget is None else budget} | {tps:.1f} | "
                     f"{tps / rows[(m, None)][0]:.2f}× | {tau1:.2f} | {ms:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
