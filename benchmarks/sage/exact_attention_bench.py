"""The exact mode's fixed-order attention on an accelerator: the kernel against its jnp reference, time and bits.

    python benchmarks/sage/exact_attention_bench.py --out DIR [--seconds 100]   # GPU machine or TPU VM
    python benchmarks/sage/exact_attention_bench.py --out DIR --quick          # CPU smoke run (interpret mode)

One attention layer of a 72B-class target (64 query / 8 kv heads, head dim 128, bf16, batch 1), a speculative
verify (overlay mode: a random tree of W nodes over a cache of S slots, 7/8 committed) and a plain decode step
(written mode, W = 1): the median ms of `pallas_kernels.exact_attention` with `impl="auto"` (Mosaic on TPU, Triton
on GPU) and with `impl="reference"` (the jnp path XLA compiles), the largest difference between them (the kernel
and the reference are different programs on a device: their bits agree only where the compiler keeps the same
sums), and the two properties the exact mode needs from the kernel on this device, bit for bit: a query's row is
the same computed alone and among W - 1 others, and a tree node's row in the verify equals the decode step of its
path written into the cache.

Writes DIR/exact_attention.json (date, device, jax version, every row) and prints a Markdown table. Rows stop
starting once --seconds have passed; a row that fails is recorded with its error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

FULL = dict(heads=(64, 8), head_dim=128, caches=(2048, 8192, 32768), widths=(16, 64), repeats=20)
QUICK = dict(heads=(4, 2), head_dim=64, caches=(300,), widths=(7,), repeats=2)


def _ms(fn, *args, repeats: int) -> float:
    from sage_jax.decoding.budget import time_ms  # the same timer as the cost profile of --budget auto

    return time_ms(fn, *args, repeats=repeats)


def _tree(w: int, seed: int) -> np.ndarray:
    """[W, W] ancestor mask of a random tree, node 0 the root."""
    rng = np.random.default_rng(seed)
    anc = np.eye(w, dtype=bool)
    for i in range(1, w):
        anc[i] |= anc[rng.integers(max(0, i - 4), i)]
    return anc


def row(n: int, k: int, h: int, s: int, w: int, repeats: int, interpret: bool) -> dict:
    from pallas_kernels.exact_attention import exact_attention

    rng = np.random.default_rng(s + w)
    dt = jnp.bfloat16
    start = 7 * s // 8
    q = jnp.asarray(rng.standard_normal((1, w, n, h)), dt)
    kc, vc = (jnp.asarray(rng.standard_normal((1, s, k, h)), dt) for _ in range(2))
    kn, vn = (jnp.asarray(rng.standard_normal((1, w, k, h)), dt) for _ in range(2))
    anc = _tree(w, s)
    pad, st = jnp.zeros((1,), jnp.int32), jnp.full((1,), start, jnp.int32)
    win = jnp.asarray(anc)[None]
    impl = "tpu" if interpret else "auto"
    kern = jax.jit(lambda *a: exact_attention(*a, impl=impl, interpret=interpret))
    ref = jax.jit(lambda *a: exact_attention(*a, impl="reference"))
    args = (q, kc, vc, pad, st, win, kn, vn)
    out, want = np.asarray(kern(*args), np.float32), np.asarray(ref(*args), np.float32)
    r = {"heads": [n, k], "head_dim": h, "cache": s, "width": w,
         "verify_kernel_ms": _ms(kern, *args, repeats=repeats), "verify_reference_ms": _ms(ref, *args, repeats=repeats),
         "max_abs_diff": float(np.max(np.abs(out - want))), "bit_identical": bool(np.array_equal(out, want))}
    alone = np.asarray(kern(q[:, :1], kc, vc, pad, st, win[:, :1, :1], kn[:, :1], vn[:, :1]), np.float32)
    r["row_alone_equals_row_among_others"] = bool(np.array_equal(alone[0, 0], out[0, 0]))
    node = w - 1  # the deepest-numbered node: its path written into the cache, decoded as one query
    path = np.flatnonzero(anc[node])
    kw_, vw_ = kc.at[0, start:start + len(path)].set(kn[0, path]), vc.at[0, start:start + len(path)].set(vn[0, path])
    chain = jnp.asarray(np.arange(len(path)) <= len(path) - 1)[None, None]
    step = np.asarray(kern(q[:, node:node + 1], kw_, vw_, pad, st, chain), np.float32)
    r["verify_node_equals_decode_step"] = bool(np.array_equal(step[0, 0], out[0, node]))
    one = (q[:, :1], kw_, vw_, pad, st, chain)
    r["decode_kernel_ms"] = _ms(kern, *one, repeats=repeats)
    r["decode_reference_ms"] = _ms(ref, *one, repeats=repeats)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out/device_bench"))
    ap.add_argument("--seconds", type=float, default=100.0)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, kernels interpreted (a CPU smoke run)")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    os.makedirs(args.out, exist_ok=True)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": str(jax.devices()[0]),
              "jax": jax.__version__, "rows": []}
    t0 = time.perf_counter()
    print("| cache | W | verify kernel / reference ms | decode kernel / reference ms | max diff | alone = among | "
          "node = decode |\n|---|---|---|---|---|---|---|")
    for s in cfg["caches"]:
        for w in cfg["widths"]:
            if time.perf_counter() - t0 > args.seconds:
                break
            try:
                r = row(*cfg["heads"], cfg["head_dim"], s, w, cfg["repeats"], args.quick)
                print(f"| {s} | {w} | {r['verify_kernel_ms']:.3f} / {r['verify_reference_ms']:.3f} | "
                      f"{r['decode_kernel_ms']:.3f} / {r['decode_reference_ms']:.3f} | {r['max_abs_diff']:.2e} | "
                      f"{r['row_alone_equals_row_among_others']} | {r['verify_node_equals_decode_step']} |", flush=True)
            except Exception as e:  # noqa: BLE001 - a kernel that does not lower here is a result too
                r = {"cache": s, "width": w, "error": f"{type(e).__name__}: {e}"[:500]}
                print(f"| {s} | {w} | error: {r['error'][:120]} |", flush=True)
            result["rows"].append(r)
            with open(os.path.join(args.out, "exact_attention.json"), "w") as fh:
                json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
