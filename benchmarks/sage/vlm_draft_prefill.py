"""What draft-side visual-token pruning saves in the draft's prefill, at an image prompt's real proportions.

    python benchmarks/sage/vlm_draft_prefill.py [--ratios 0,0.3,0.6,0.8,0.9,0.95] [--repeats 7] [--out FILE.md]

A random Qwen2.5-VL-architecture pair wider than the tests' (target 4 layers, draft 2 layers, width 256; SAGE's
losslessness does not depend on the weights, the prefill's cost only on the shapes) and two images of 256 visual
tokens each against a one-line question. For each pruning ratio, `Engine.time_prefill` compiles the target's and
the draft's prefills apart and times each (median of `--repeats`), next to XLA's FLOP count of the draft's. The
table opens with what produced it (commit, command line, CPU, jax: `configs.provenance`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratios", default="0,0.3,0.6,0.8,0.9,0.95")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    from PIL import Image

    from configs import provenance
    from sage_jax.bench.tiny_vlm import tiny_vlm
    from sage_jax.engine import Engine

    kw = dict(max_pixels=448 * 448, max_position=4096, d_model=256)
    target = tiny_vlm("qwen2_5_vl", 0, tempfile.mkdtemp(), n_layers=4, **kw)
    draft = tiny_vlm("qwen2_5_vl", 1, tempfile.mkdtemp(), n_layers=2, like=target, noise=0.05, **kw)
    engine = Engine(target, draft)
    rng = np.random.default_rng(0)
    images = [[Image.fromarray(rng.integers(0, 256, (448, 448, 3), dtype=np.uint8)) for _ in range(2)]]
    rows = []
    for r in (float(x) for x in args.ratios.split(",")):
        t = engine.time_prefill(["Describe these two pictures."], images=images, prune_ratio=r, repeats=args.repeats)
        rows.append((r, t))
    base = rows[0][1]["draft_prefill_seconds"]
    record = provenance.record("python benchmarks/sage/vlm_draft_prefill.py", argv)
    lines = [f"# Draft prefill vs visual-token pruning ({time.strftime('%Y-%m-%d')})", "",
             provenance.markdown(record), "",
             f"{provenance.machine(record)}; random Qwen2.5-VL-architecture pair "
             f"(target 4 layers, draft 2 layers, width 256), one prompt with two 448x448 images, median of "
             f"{args.repeats}.", "",
             "| pruning ratio | draft prompt tokens | target prefill ms | draft prefill ms | vs no pruning | "
             "draft prefill MFLOP |", "|---|---|---|---|---|---|"]
    for r, t in rows:
        lines.append(f"| {r:g} | {t['draft_prompt_tokens']} / {t['prompt_tokens']} | "
                     f"{t['target_prefill_seconds'] * 1e3:.2f} | {t['draft_prefill_seconds'] * 1e3:.2f} | "
                     f"{t['draft_prefill_seconds'] / base:.2f}x | {t['draft_prefill_flops'] / 1e6:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
