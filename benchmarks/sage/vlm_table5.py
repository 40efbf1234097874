"""The paper's Table 5 for the home VLM's drafts: acceptance and the draft's prefill against the pruning ratio.

    python benchmarks/sage/vlm_table5.py OUT_DIR LABEL=RUN/vlm_bench.json [LABEL=RUN/vlm_bench.json ...]

Each input is a `python -m sage_jax.bench --vlm [--clips] ... --ratios 0,0.3,0.6,0.8,0.9,0.95` run (one draft, one
selection method: `--prune attention` or `uniform`; held-out images, or clips with `--clips`). Writes
OUT_DIR/table5.md (per run and ratio: τ, τ+1, the draft's prompt tokens, its prefill GFLOPs (XLA's count) and
seconds, each also against ratio 0, and whether every output equalled
AR's; with the runs' provenance) and OUT_DIR/table5.png (τ and the relative prefill FLOPs against the ratio).
"""

from __future__ import annotations

import json
import os
import sys


def rows(run: dict) -> list[dict]:
    sweep = sorted(run["sweep"], key=lambda r: r["ratio"])
    base = next((r for r in sweep if r["ratio"] == 0.0), sweep[0])
    return [{**r, "tau_rel": r["tau"] / base["tau"] if base["tau"] else float("nan"),
             "flops_rel": r["draft_prefill_gflops"] / base["draft_prefill_gflops"],
             "seconds_rel": r["draft_prefill_seconds"] / base["draft_prefill_seconds"]} for r in sweep]


def markdown(runs: dict[str, dict]) -> str:
    out = []
    for label, run in runs.items():
        prov = run.get("provenance", {})
        n = run.get("args", {}).get("prompts")
        what = "held-out clips" if run.get("args", {}).get("clips") else "held-out images"
        out += [f"### {label}", "",
                f"{run['title']}; {n} {what}; `{prov.get('command', '?')}` at commit "
                f"`{prov.get('commit', '?')}`, draft sha256 `{prov.get('draft_sha256')}`; {run['machine']}", "",
                "| ratio | τ | τ+1 | τ vs ratio 0 | draft prompt tokens | draft prefill GFLOPs | vs ratio 0 | "
                "draft prefill ms | vs ratio 0 | same as AR |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows(run):
            out.append(f"| {r['ratio']:g} | {r['tau']:.2f} | {r['tau_plus_1']:.2f} | {r['tau_rel']:.0%} | "
                       f"{r['draft_prompt_tokens']} / {r['prompt_tokens']} | {r['draft_prefill_gflops']:.3f} | "
                       f"{r['flops_rel']:.0%} | {r['draft_prefill_seconds'] * 1e3:.1f} | {r['seconds_rel']:.0%} | "
                       f"{'yes' if r['same_as_ar'] else 'NO'} |")
        out.append("")
    return "\n".join(out)


def plot(runs: dict[str, dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.6))
    for label, run in runs.items():
        rs = rows(run)
        x = [r["ratio"] for r in rs]
        a.plot(x, [r["tau"] for r in rs], "o-", label=label)
        b.plot(x, [r["flops_rel"] for r in rs], "o-", label=label)
    a.set(xlabel="draft pruning ratio", ylabel="τ (accepted tokens per step)", title="acceptance")
    b.set(xlabel="draft pruning ratio", ylabel="draft prefill FLOPs / ratio 0", title="draft prefill (XLA's count)",
          ylim=(0, 1.05))
    handles, labels = a.get_legend_handles_labels()  # below both panels: no line hidden behind it
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    fig.tight_layout(rect=(0, 0.06 * ((len(labels) + 3) // 4), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = argv[0]
    runs = {}
    for spec in argv[1:]:
        label, path = spec.split("=", 1)
        with open(path) as f:
            runs[label] = json.load(f)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "table5.md"), "w") as f:
        f.write(markdown(runs))
    print(markdown(runs))
    print(f"wrote {os.path.join(out, 'table5.md')} and {plot(runs, os.path.join(out, 'table5.png'))}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
