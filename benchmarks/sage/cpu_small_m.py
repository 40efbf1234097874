"""Why a two-token verify costs ~1.7× a one-token step on this CPU: the matrix multiplies of SmolLM2-135M alone.

Times one forward's worth of the target's matmuls (30 layers of q/k/v/o and gate/up/down projections, then the
49,152-row LM head) for M = 1, 2, 4, 8, 16 rows, under each dot backend XLA:CPU offers (its default YNNPACK, plain
Eigen, XNNPACK, oneDNN; each in a fresh process, as XLA reads its flags once), and numpy's BLAS for comparison.
Prints a Markdown table of milliseconds and of the ratio to M = 1.

    python benchmarks/sage/cpu_small_m.py [--rounds 15] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROWS = (1, 2, 4, 8, 16)
_NO_YNN = "--xla_cpu_experimental_ynn_fusion_type="
BACKENDS = {
    "XLA default (YNNPACK)": "",
    "XLA Eigen": _NO_YNN,
    "XLA XNNPACK": f"{_NO_YNN} --xla_cpu_use_xnnpack=true "
                   "--xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    "XLA oneDNN": f"{_NO_YNN} --xla_cpu_use_onednn=true "
                  "--xla_cpu_experimental_onednn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
}
# SmolLM2-135M: d_model 576, 9 query / 3 key-value heads of 64, MLP 1536, 30 layers, vocab 49,152.
_LAYER = ((576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576))
_HEAD = (576, 49152)


def _shapes():
    return [s for _ in range(30) for s in _LAYER] + [_HEAD]


def _median_ms(fn, rounds: int) -> float:
    import time

    import numpy as np

    fn()  # compiles (XLA) / warms up
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def _worker(backend: str, rounds: int) -> dict[int, float]:
    import numpy as np

    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(s, np.float32) * 0.02 for s in _shapes()]
    if backend == "numpy":
        def numpy_forward(m):
            xs = {k: np.ones((m, k), np.float32) for k in (576, 1536)}
            return lambda: [xs[w.shape[0]] @ w for w in weights]

        return {m: _median_ms(numpy_forward(m), rounds) for m in ROWS}
    import jax
    import jax.numpy as jnp

    ws = [jnp.asarray(w) for w in weights]

    @jax.jit
    def run(x576, x1536, ws):
        # Each product feeds a sum, so none is dead code; the inputs stay fixed so all run independently.
        return sum(((x576 if w.shape[0] == 576 else x1536) @ w).sum() for w in ws)

    def xla_forward(m):
        a, b = jnp.ones((m, 576)), jnp.ones((m, 1536))
        return lambda: run(a, b, ws).block_until_ready()

    return {m: _median_ms(xla_forward(m), rounds) for m in ROWS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", help="also write the table to this Markdown file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.worker, args.rounds)))
        return 0
    results = {}
    for name, flags in [*BACKENDS.items(), ("numpy (OpenBLAS)", None)]:
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags or ''}".strip())
        proc = subprocess.run([sys.executable, __file__, "--worker", "numpy" if flags is None else "xla",
                               "--rounds", str(args.rounds)], env=env, capture_output=True, text=True, check=True)
        results[name] = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
        print(f"{name}: done", file=sys.stderr)
    head = "| backend | " + " | ".join(f"M={m}" for m in ROWS) + " |"
    lines = [head, "|---|" + "---|" * len(ROWS)]
    for name, r in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{r[m]:.1f} ms ({r[m] / r[1]:.2f}×)" for m in ROWS) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
