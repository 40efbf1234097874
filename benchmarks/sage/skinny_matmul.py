"""What the skinny CPU matmul kernel (`cpu_kernels/skinny_matmul`) does to the cost of a decode / verify step.

Two tables, each timed in interleaved rounds (median ms; the machine is shared, so read the ratios):

1. One forward's worth of SmolLM2-135M's matmuls (30 layers of qkv / o / gate|up / down, then the tied 49,152-row
   LM head) through the kernel alone, for M = 1..8, 12 and 16 columns (XLA's dot backends on the same shapes:
   `cpu_small_m.py`; on a fresh [D, M] input outside a model XLA's GEMM is far slower than inside one, so the
   like-for-like comparison is the second table).
2. The real target (shipped SmolLM2-135M-Instruct): a plain decoding step and the speculative verify forward at
   widths 1..8, 12 and 16 (cache-reading, as the decoding loop runs it), and a draft level of the shipped EAGLE
   head, with `LMConfig.matmul` "auto" (the kernel up to `MAX_COLUMNS` rows) against "xla".

    python benchmarks/sage/skinny_matmul.py [--rounds 15] [--out benchmarks/sage/results/skinny_matmul]

Writes table.md and cost.png under --out.
"""

from __future__ import annotations

import argparse
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np

WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)
# SmolLM2-135M serving matrices [out, in]: fused qkv, o, fused gate|up, down; 30 layers; the tied head.
_LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def matmul_rows(rounds: int) -> list[float]:
    from cpu_kernels.skinny_matmul import prepare, skinny_matmul
    from sage_jax.decoding.budget import time_all

    if not prepare():  # built and loaded before anything is traced
        raise SystemExit("the skinny_matmul kernel is unavailable on this machine")
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal(s, np.float32) * 0.02) for _ in range(30) for s in _LAYER]
    embed = jnp.asarray(rng.standard_normal((49152, 576), np.float32) * 0.02)

    def forward(impl):
        @jax.jit
        def f(ws, embed, x, x_mlp):
            # Each matmul reads an input of its width, after the previous one (as in a forward: XLA would
            # otherwise run the independent matmuls side by side); every product is returned.
            outs, prev = [], jnp.float32(0)
            for w in ws:
                xi = (x if w.shape[1] == x.shape[0] else x_mlp) + 0 * prev
                outs.append(skinny_matmul(w, xi, impl=impl))
                prev = outs[-1][0, 0]
            return outs + [skinny_matmul(embed, (x + 0 * prev).T, x_tokens_major=True, y_tokens_major=True,
                                         impl=impl)]
        return f

    fk = forward("kernel")
    calls = []
    for m in WIDTHS:
        x, x_mlp = (jnp.asarray(rng.standard_normal((d, m), np.float32)) for d in (576, 1536))
        calls.append((fk, ws, embed, x, x_mlp))
    return time_all(calls, rounds)


def model_rows(rounds: int, capacity: int = 274) -> dict[str, list[float]]:
    """{variant: [ar step, verify at each width..., draft level at width 1, at width 4]} in ms."""
    import sage_jax
    from sage_jax.decoding.budget import LOOP_STEPS, profile_calls, time_all

    engine = sage_jax.load_engine()
    calls = []
    for m in ("auto", "xla"):  # the chooser's own timed calls, both variants in the same interleaved rounds
        calls += profile_calls(engine.target_lm.with_matmul(m), engine.draft.with_matmul(m), engine.draft_spec,
                               capacity, WIDTHS, (1, 4))
    ms = [m / LOOP_STEPS for m in time_all(calls, rounds)]  # ms per step
    n = len(calls) // 2
    return {"auto": ms[:n], "xla": ms[n:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default="benchmarks/sage/results/skinny_matmul")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    mm = matmul_rows(args.rounds)
    md = model_rows(args.rounds)
    cpu = platform.processor() or platform.machine()
    lines = [f"`python benchmarks/sage/skinny_matmul.py --rounds {args.rounds}`; {os.cpu_count()} cores ({cpu}), "
             f"jax {jax.__version__}; median ms of interleaved rounds.", "",
             "**SmolLM2-135M's matmuls through the kernel, one forward** (ms; × = ratio to one column)", "",
             "| M | " + " | ".join(map(str, WIDTHS)) + " |", "|---" * (len(WIDTHS) + 1) + "|",
             "| kernel | " + " | ".join(f"{k:.1f} ({k / mm[0]:.2f}×)" for k in mm) + " |",
             "", "**The real target and head** (ms; in brackets: ratio to the same variant's plain decoding step)", "",
             "| matmul | AR step | " + " | ".join(f"verify {w}" for w in WIDTHS) + " | draft level 1 | draft level 4 |",
             "|---" * (len(WIDTHS) + 4) + "|"]
    for name, row in md.items():
        ar = row[0]
        cells = [f"{ar:.1f}"] + [f"{v:.1f} ({v / ar:.2f})" for v in row[1:1 + len(WIDTHS)]]
        cells += [f"{v:.1f}" for v in row[1 + len(WIDTHS):]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ratio = md["auto"][0] / md["xla"][0]
    lines += ["", f"Plain decoding step with the kernel: {ratio:.2f}× the XLA one."]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text)
    _plot(mm, md, os.path.join(args.out, "cost.png"))


def _plot(mm, md, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    axes[0].plot(WIDTHS, mm, "o-", label="skinny kernel")
    axes[0].set(title="SmolLM2-135M matmuls through the kernel", xlabel="columns M", ylabel="ms")
    for name, style in (("xla", "o--"), ("auto", "o-")):
        row = md[name]
        axes[1].plot(WIDTHS, row[1:1 + len(WIDTHS)], style, label=f"verify, matmul={name}")
        axes[1].axhline(row[0], ls=":" if name == "xla" else "-", lw=0.8, color="gray")
    axes[1].set(title="real target: verify forward (gray: AR step)", xlabel="tree slots verified", ylabel="ms")
    for ax in axes:
        ax.legend()
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
