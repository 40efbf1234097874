"""The benchmark loop: load once, compile every method (timed apart), then prompts × methods with a progress bar,
aggregate per method, print a Markdown table, write JSON, the table and plots, each results file with what produced
it (`provenance`)."""

from __future__ import annotations

import json
import resource
import time

import numpy as np
from tqdm import tqdm

from configs import cli
from configs import provenance as provenance_lib
from sage_jax.bench.methods import Method


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_methods(runners: dict, methods: list[Method], prompts: list[list[int]], *, progress: bool = True,
                on_prompt=None) -> dict:
    """Per method: warm-up (compile) seconds, then per-prompt results. Methods are interleaved per prompt so
    that a noisy machine affects them alike. `on_prompt(results)` runs after every prompt (partial output)."""
    results: dict[str, dict] = {}
    for m in tqdm(methods, desc="compile", disable=not progress, leave=False):
        results[m.name] = {"method": m, "compile_seconds": runners[m.kind].warm_up(m, prompts[0]), "runs": [],
                           "peak_rss_mb": 0.0}
        results[m.name]["peak_rss_mb"] = peak_rss_mb()
    bar = tqdm(total=len(prompts) * len(methods), desc="prompts x methods", disable=not progress)
    for p in prompts:
        for m in methods:
            bar.set_postfix_str(m.name)
            results[m.name]["runs"].append(runners[m.kind].run(m, p))
            bar.update()
        if on_prompt is not None:
            on_prompt(results)
    bar.close()
    return results


def summarise(results: dict) -> list[dict]:
    """One row per method: tokens/s (prefill + decode, compile excluded), speedups, τ, forwards per token, tree
    shape per step, compile seconds, peak RSS, exactness vs our AR."""
    rows = []
    ref = results.get("ar", {}).get("runs")
    for name, r in results.items():
        runs = r["runs"]
        toks = sum(len(x["tokens"]) for x in runs)
        secs = sum(x["seconds"] for x in runs)
        loop = sum(x["loop_tokens"] for x in runs)
        steps = sum(x["steps"] for x in runs)
        mean = lambda k, runs=runs: (float(np.mean([x[k] for x in runs]))  # noqa: E731
                                     if runs and runs[0][k] is not None else None)
        rows.append({
            "method": name, "kind": r["method"].kind, "tokens": toks, "seconds": secs,
            "tokens_per_second": toks / secs if secs else 0.0,
            "tau": (loop / steps - 1.0) if steps else 0.0, "tau_plus_1": loop / steps if steps else 0.0,
            "target_forwards_per_token": sum(x["target_forwards"] for x in runs) / max(toks, 1),
            "draft_forwards_per_token": sum(x["draft_forwards"] for x in runs) / max(toks, 1),
            "nodes_per_step": mean("nodes"), "depth_per_step": mean("depth"), "width_per_step": mean("width"),
            "compile_seconds": r["compile_seconds"], "peak_rss_mb": r["peak_rss_mb"],
            "same_as_ar": None if ref is None else all(a["tokens"] == b["tokens"] for a, b in zip(runs, ref)),
            "identical_prompts": None if ref is None else sum(a["tokens"] == b["tokens"] for a, b in zip(runs, ref)),
            "prompts": len(runs),
            "budgets": sorted({tuple(x["budget"]) for x in runs if x["budget"]}),
        })
    by = {row["method"]: row["tokens_per_second"] for row in rows}
    for row in rows:
        row["speedup_vs_ar"] = row["tokens_per_second"] / by["ar"] if by.get("ar") else None
        row["speedup_vs_hf_ar"] = row["tokens_per_second"] / by["hf-ar"] if by.get("hf-ar") else None
    return rows


def markdown(rows: list[dict]) -> str:
    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    head = ("| method | tok/s | vs our AR | vs HF AR | τ | τ+1 | target fwd/tok | draft fwd/tok | nodes/step | "
            "depth/step | width/step | compile s | peak RSS MB | same as AR |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['method']} | {r['tokens_per_second']:.1f} | {f(r['speedup_vs_ar'])}x | "
                     f"{f(r['speedup_vs_hf_ar'])}x | {r['tau']:.2f} | {r['tau_plus_1']:.2f} | "
                     f"{r['target_forwards_per_token']:.2f} | {r['draft_forwards_per_token']:.2f} | "
                     f"{f(r['nodes_per_step'], '.1f')} | {f(r['depth_per_step'], '.1f')} | "
                     f"{f(r['width_per_step'], '.1f')} | {r['compile_seconds']:.1f} | {r['peak_rss_mb']:.0f} | "
                     f"{_same(r)} |")
    return "\n".join(lines)


def _same(row: dict) -> str:
    if row["same_as_ar"] is None:
        return "-"
    return "yes" if row["same_as_ar"] else f"NO ({row['identical_prompts']}/{row['prompts']})"


def by_kind(results: dict, kinds: list[str]) -> dict[str, list[dict]]:
    """`summarise` over the prompts of each kind (`kinds[i]`: prompt i's), for a set that mixes kinds."""
    out = {}
    for kind in dict.fromkeys(kinds):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        part = {name: dict(r, runs=[r["runs"][i] for i in idx if i < len(r["runs"])]) for name, r in results.items()}
        out[kind] = summarise(part)
    return out


def kind_markdown(per_kind: dict[str, list[dict]]) -> str:
    """One row per method, per kind: speed-up over our AR and τ+1."""
    kinds = list(per_kind)
    head = "| method | " + " | ".join(f"{k}: vs our AR | {k}: τ+1" for k in kinds) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(kinds))]
    for i, row in enumerate(per_kind[kinds[0]]):
        cells = []
        for k in kinds:
            r = per_kind[k][i]
            cells += ["-" if r["speedup_vs_ar"] is None else f"{r['speedup_vs_ar']:.2f}x", f"{r['tau_plus_1']:.2f}"]
        lines.append(f"| {row['method']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def provenance(argv: list[str] | None, draft: str | None) -> dict:
    """What produced this run's results files (`configs.provenance.record`): the commit, the command line, the main
    draft's checkpoint and its sha256 (None for a self-draft), the CPU, jax / jaxlib and the backend."""
    return provenance_lib.record("python -m sage_jax.bench", argv, {"draft": draft})


def write_table(path: str, title: str, record: dict, table: str) -> None:
    """`table.md`: the run's title, its provenance and the Markdown table."""
    with cli.written(path) as fh:
        fh.write(f"{title}\n\n{provenance_lib.markdown(record)}\n\n{table}\n")


def write_json(path: str, rows: list[dict], results: dict, meta: dict, per_kind: dict | None = None) -> None:
    per_method = {name: {"alpha_traces": [x["alpha_trace"] for x in r["runs"]],
                         "tau_traces": [x["tau_trace"] for x in r["runs"]]} for name, r in results.items()}
    with cli.written(path) as fh:  # rewritten after every prompt: never torn by Ctrl-C
        json.dump({"meta": meta, "rows": rows, "by_kind": per_kind, "traces": per_method,
                   "time": time.strftime("%Y-%m-%d %H:%M:%S")}, fh, indent=1, default=str)
