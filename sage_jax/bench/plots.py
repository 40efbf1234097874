"""The benchmark's PNG plots: speedup bars, acceptance vs α calibration, lag-k autocorrelation of the draft
entropy (the paper's Fig. 2), verify cost vs node count."""

from __future__ import annotations

import math
import os
import textwrap

import numpy as np


def _fig():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def speedup_bars(rows: list[dict], path: str, title: str) -> str:
    plt = _fig()
    rows = [r for r in rows if r["speedup_vs_ar"] is not None]
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(rows)), 3.6))
    colors = ["#4c72b0" if r["kind"] == "ours" else "#dd8452" for r in rows]
    ax.bar([r["method"] for r in rows], [r["speedup_vs_ar"] for r in rows], color=colors)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("tokens/s vs our AR")
    ax.set_title(textwrap.fill(title, 90), fontsize=8)
    ax.tick_params(axis="x", rotation=60, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pairs(traces: dict, methods) -> tuple[np.ndarray, np.ndarray]:
    alpha, tau = [], []
    for m in methods:
        for a, t in zip(traces[m]["alpha_traces"], traces[m]["tau_traces"]):
            n = min(len(a), len(t))
            alpha += list(a[:n])
            tau += list(t[:n])
    return np.asarray(alpha, float), np.asarray(tau, float)


def calibration(traces: dict, path: str, methods=("sage",), bins: int = 10) -> str:
    """Mean accepted length τ of a step against the α that shaped its tree (binned)."""
    plt = _fig()
    fig, ax = plt.subplots(figsize=(4.5, 3.4))
    for m in methods:
        if m not in traces:
            continue
        a, t = _pairs(traces, [m])
        ok = np.isfinite(a)
        a, t = a[ok], t[ok]
        edges = np.linspace(0, 1, bins + 1)
        idx = np.clip(np.digitize(a, edges) - 1, 0, bins - 1)
        centers = [(edges[i] + edges[i + 1]) / 2 for i in range(bins) if np.any(idx == i)]
        means = [t[idx == i].mean() for i in range(bins) if np.any(idx == i)]
        ax.plot(centers, means, "o-", label=m)
    ax.set_xlabel("α (draft confidence)")
    ax.set_ylabel("mean τ of the step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def autocorrelation(traces: dict, path: str, method: str = "sage", max_lag: int = 10, k: int = 10) -> str:
    """Lag-k Pearson autocorrelation of the entropy sequence H = (1 − α)·log k, per prompt, averaged."""
    plt = _fig()
    seqs = [(1 - np.asarray(a, float)) * math.log(k) for a in traces.get(method, {}).get("alpha_traces", [])]
    seqs = [s[np.isfinite(s)] for s in seqs]
    lags, vals, band = [], [], []
    for lag in range(1, max_lag + 1):
        pairs = [(np.corrcoef(s[:-lag], s[lag:])[0, 1], len(s) - lag) for s in seqs
                 if len(s) > lag + 2 and np.std(s) > 0]
        pairs = [(r, n) for r, n in pairs if np.isfinite(r)]
        if pairs:
            lags.append(lag)
            vals.append(float(np.mean([r for r, _ in pairs])))
            # 95% band of that mean when entropy is uncorrelated: each prompt's r has variance ≈ 1/n.
            band.append(1.96 * math.sqrt(sum(1.0 / n for _, n in pairs)) / len(pairs))
    fig, ax = plt.subplots(figsize=(4.5, 3.4))
    ax.bar(lags, vals, color="#55a868")
    if band:
        ax.plot(lags, band, "k:", lw=1, label="95% band, no correlation")
        ax.plot(lags, [-b for b in band], "k:", lw=1)
        ax.legend(fontsize=7)
    ax.axhline(0.0, color="k", lw=0.5)
    ax.set_xlabel("lag k (steps)")
    ax.set_ylabel("autocorrelation (mean over prompts)")
    ax.set_title(f"{method}: draft entropy, lag-k autocorrelation", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def verify_cost(profile: dict, path: str) -> str:
    """Target verify forward (ms) vs tree width, and the draft's per-level forward vs frontier width."""
    plt = _fig()
    fig, ax = plt.subplots(figsize=(4.5, 3.4))
    ws, ms = list(profile["verify_widths"]), list(profile["verify_ms"])
    if profile.get("ar_ms"):
        ws, ms = [1] + ws, [profile["ar_ms"]] + ms
    ax.plot(ws, ms, "o-", label="target verify (1 = plain decoding step)")
    ax.plot(profile["draft_widths"], profile["draft_ms"], "s--", label="draft level")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in the forward (tree nodes + root)")
    ax.set_ylabel("ms")
    ax.set_title(profile.get("device", ""), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _tree_steps(traces: dict, m: str) -> int:
    """Steps of method m that built a tree (a finite α)."""
    return sum(int(np.isfinite(np.asarray(a, float)).sum()) for a in traces.get(m, {}).get("alpha_traces", []))


def alpha_methods(traces: dict) -> tuple[str, list[str]]:
    """(the SAGE run to plot α and entropy of, the methods of the calibration plot).

    Under --budget auto a method may build trees only now and then (the chooser decoding plainly in between): the
    SAGE run with the most tree steps (sage or a fixed-budget sage@N) is plotted, and EAGLE-2 / static only where
    they built at least half as many trees.
    """
    steps = {m: _tree_steps(traces, m) for m in traces}
    sage = max((m for m in steps if m == "sage" or m.startswith("sage@")), key=steps.get, default="sage")
    enough = steps.get(sage, 0) / 2
    return sage, [sage] + [m for m in ("eagle2", "static") if steps.get(m, 0) > enough]


def all_plots(rows, traces, profile, out: str, title: str) -> list[str]:
    os.makedirs(out, exist_ok=True)
    sage, calibrated = alpha_methods(traces)
    paths = [speedup_bars(rows, os.path.join(out, "speedup.png"), title),
             calibration(traces, os.path.join(out, "calibration.png"), calibrated),
             autocorrelation(traces, os.path.join(out, "entropy_autocorrelation.png"), sage)]
    if profile:
        paths.append(verify_cost(profile, os.path.join(out, "verify_cost.png")))
    return paths
