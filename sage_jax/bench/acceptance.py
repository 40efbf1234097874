"""`python -m sage_jax.draft.evaluate`: a draft's acceptance on the held-out chat prompts, decoded for real.

    python -m sage_jax.draft.evaluate [--draft SPEC | --draft-layers N] [--policies sage,eagle2,static,chain]
        [--max-new-tokens 128] [--prompts N] [--batch B] [--out results.json]

For every held-out prompt of `eval_prompts.py` (never in any training data), one request at a time: greedy AR,
then each policy with the draft; checks the speculative output is token-identical to AR and reports per policy the
mean tokens per target step (τ+1, over all steps of all prompts), its per-prompt spread, and decode tokens/s. The
timing needs a quiet machine; `python -m sage_jax.bench` is the speed benchmark, this is the acceptance check.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from tqdm.auto import tqdm

from sage_jax.draft.eval_prompts import EVAL_PROMPTS


def evaluate(engine, prompt_ids: list[list[int]], policies: list[str], max_new_tokens: int, *, batch: int = 1,
             progress: bool = True) -> dict:
    """{policy: {tokens_per_step, tau, per_prompt_min/max, identical, prompts, tokens_per_second}} incl. "ar".

    `batch` > 1 decodes that many prompts per request (faster on a CPU; the per-prompt spread is then over
    requests, τ+1 is still the mean over every row's steps: Σ tokens / Σ steps)."""
    chunks = [prompt_ids[s: s + batch] for s in range(0, len(prompt_ids), batch)]
    ref: list[list[int]] = []
    acc: dict[str, dict[str, list]] = {p: {"steps": [], "tokens": [], "secs": [], "same": []}
                                       for p in ["ar", *policies]}
    runs = [(p, i) for p in ["ar", *policies] for i in range(len(chunks))]
    for policy, i in tqdm(runs, desc="evaluate", disable=not progress, dynamic_ncols=True):
        chunk = chunks[i]
        gen = engine.generate(chunk, policy=policy, max_new_tokens=max_new_tokens)
        st = gen.stats
        if policy == "ar":
            ref.extend(gen.token_ids)
        a = acc[policy]
        loop_tokens = st.new_tokens - len(chunk)  # the first token of each row comes from the prefill
        a["tokens"].append(loop_tokens)
        a["steps"].append(loop_tokens / st.mean_tokens_per_step if policy != "ar" else loop_tokens)  # AR: 1/step
        a["secs"].append(st.decode_seconds)
        a["same"].extend(g == r for g, r in zip(gen.token_ids, ref[i * batch: i * batch + len(chunk)], strict=True))
    out: dict[str, dict] = {}
    for policy, a in acc.items():
        steps, toks = np.asarray(a["steps"], float), np.asarray(a["tokens"], float)
        per = toks / np.maximum(steps, 1)
        tps = float(toks.sum() / max(steps.sum(), 1))
        out[policy] = {"tokens_per_step": tps, "tau": tps - 1, "per_prompt_min": float(per.min()),
                       "per_prompt_max": float(per.max()), "identical": int(sum(a["same"])),
                       "prompts": len(a["same"]), "tokens_per_second": float(toks.sum() / max(sum(a["secs"]), 1e-9))}
    ar_tps = out["ar"]["tokens_per_second"]
    for policy in policies:
        out[policy]["speedup_vs_ar"] = out[policy]["tokens_per_second"] / ar_tps if ar_tps else None
    return out


def table(res: dict) -> str:
    lines = ["| policy | τ+1 (all steps) | per prompt min–max | identical to AR | tok/s | speedup |",
             "|---|---|---|---|---|---|"]
    for policy, r in res.items():
        sp = r.get("speedup_vs_ar")
        lines.append(f"| {policy} | {r['tokens_per_step']:.2f} | {r['per_prompt_min']:.2f}–{r['per_prompt_max']:.2f} "
                     f"| {r['identical']}/{r['prompts']} | {r['tokens_per_second']:.1f} | "
                     f"{'' if sp is None else f'{sp:.2f}x'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from sage_jax.generate import BadInput, _Parser

    ap = _Parser(prog="python -m sage_jax.draft.evaluate", description=__doc__.splitlines()[0].split(": ", 1)[1])
    ap.add_argument("--draft", metavar="SPEC", help="EAGLE head or LM draft (default: the shipped head)")
    ap.add_argument("--draft-layers", type=int, metavar="N", help="self-draft with the target's first N layers")
    ap.add_argument("--policies", default="sage,eagle2,static,chain")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=len(EVAL_PROMPTS), help="the first N held-out prompts")
    ap.add_argument("--batch", type=int, default=1, help="prompts per request (speed, not acceptance)")
    ap.add_argument("--out", metavar="JSON")
    try:
        args = ap.parse_args(argv)
        from sage_jax.decoding.policies import POLICIES

        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        bad = [p for p in policies if p not in POLICIES]
        if bad or not policies:
            raise BadInput(f"--policies: unknown {bad or args.policies!r}; choose from {', '.join(POLICIES)}")
        if not 1 <= args.prompts <= len(EVAL_PROMPTS):
            raise BadInput(f"--prompts must be in [1, {len(EVAL_PROMPTS)}]")
        if args.max_new_tokens < 1:
            raise BadInput("--max-new-tokens must be >= 1")
        if args.batch < 1:
            raise BadInput("--batch must be >= 1")
        from sage_jax import generate

        gargs = generate.parse_args([*(["--draft", args.draft] if args.draft else []),
                                     *(["--draft-layers", str(args.draft_layers)] if args.draft_layers else []),
                                     "--max-new-tokens", str(args.max_new_tokens)])
        generate.check_args(gargs)
        import jax

        if not jax.config.jax_compilation_cache_dir:  # as the generate CLI: repeated runs skip XLA compilation
            from sage_jax.io.load import cache_dir

            jax.config.update("jax_compilation_cache_dir", os.path.join(cache_dir(), "jax"))
        engine, _, tok, _ = generate.prepare(gargs)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from sage_jax.chat import prompt_ids

    ids = [prompt_ids(tok, text) for _, text in EVAL_PROMPTS[: args.prompts]]
    res = evaluate(engine, ids, policies, args.max_new_tokens, batch=args.batch)
    print(table(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"draft": gargs.draft or f"self({gargs.draft_layers})", "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
