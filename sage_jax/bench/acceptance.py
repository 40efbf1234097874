"""A draft's acceptance on the held-out chat prompts, decoded for real (`python -m sage_jax.evaluate_draft`).

For every held-out prompt (`sage_jax/prompts.py` `EVAL_PROMPTS`, never in any training data): greedy AR, then each
policy with the draft; checks the speculative output is token-identical to AR and reports per policy the mean tokens
per target step (τ+1, over all steps of all prompts), its per-prompt spread, and decode tokens/s. The timing needs a
quiet machine; `python -m sage_jax.bench` is the speed benchmark, this is the acceptance check.
"""

from __future__ import annotations

import numpy as np
from tqdm.auto import tqdm

from sage_jax.decoding.budget import AcceptanceStats
from sage_jax.decoding.policies import TreePolicy


def evaluate(engine, prompt_ids: list, policies: list[str], max_new_tokens: int, *, batch: int = 1,
             progress: bool = True, images: list[list] | None = None, policy_kw: dict | None = None) -> dict:
    """{policy: {tokens_per_step, tau, per_prompt_min/max, identical, prompts, tokens_per_second, acceptance}}
    incl. "ar". Tree policies run at their static sizes; `acceptance` is their `budget.AcceptanceStats` (JSON).

    `batch` > 1 decodes that many prompts per request (faster on a CPU; the per-prompt spread is then over
    requests, τ+1 is still the mean over every row's steps: Σ tokens / Σ steps). A vision-language engine takes
    each prompt's images in `images` (one list per prompt; prompts are then strings or ids). `policy_kw`: fields
    every tree policy gets (`TreePolicy.named(name, **policy_kw)`, e.g. retrieval chains); results keep the names."""
    chunks = [prompt_ids[s: s + batch] for s in range(0, len(prompt_ids), batch)]
    ref: list[list[int]] = []
    acc: dict[str, dict[str, list]] = {p: {"steps": [], "tokens": [], "secs": [], "same": []}
                                       for p in ["ar", *policies]}
    named = {p: TreePolicy.named(p, **(policy_kw or {})) for p in policies}
    stats = {p: AcceptanceStats(pol.n_max, pol.d_cap) for p, pol in named.items()}
    runs = [(p, i) for p in ["ar", *policies] for i in range(len(chunks))]
    for policy, i in tqdm(runs, desc="evaluate", disable=not progress, dynamic_ncols=True):
        chunk = chunks[i]
        media = {} if images is None else {"images": images[i * batch: i * batch + len(chunk)]}
        gen = engine.generate(chunk, policy=named.get(policy, policy), max_new_tokens=max_new_tokens, **media)
        st = gen.stats
        if policy == "ar":
            ref.extend(gen.token_ids)
        else:
            stats[policy].update(st)
        a = acc[policy]
        loop_tokens = st.new_tokens - len(chunk)  # the first token of each row comes from the prefill
        a["tokens"].append(loop_tokens)
        a["steps"].append(st.row_steps if policy != "ar" else loop_tokens)  # AR: one token a step
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
        out[policy]["acceptance"] = stats[policy].to_json()
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
