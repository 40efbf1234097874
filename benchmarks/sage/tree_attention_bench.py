"""Tree attention on an accelerator: the Pallas kernel against the XLA path at serving shapes, one prepared run.

    python benchmarks/sage/tree_attention_bench.py --out DIR [--seconds 220]    # GPU machine or TPU VM
    python benchmarks/sage/tree_attention_bench.py --out DIR --quick            # CPU smoke run (interpret mode)

1. The device's copy bandwidth: one jitted x + 1 over a 1 GiB bf16 array (read + write).
2. One attention layer of a 72B-class target (64 query / 8 KV heads, head dim 128, bf16; batch 1 and 4): W = 16,
   32, 64, 96 tree nodes (a random tree's ancestor mask) over caches of 2k / 8k / 32k slots, 7/8 of them
   committed. Median ms of the kernel (`impl="auto"`: Mosaic on TPU, Triton on GPU) and of what `--attention
   xla` runs (`layers.attention_with_new` over the dense masks, built outside the timing), the bytes the kernel
   must move (the visible K/V, the queries, the new tokens, the output), its achieved bandwidth and that as a share
   of the copy bandwidth, and the largest difference between the two outputs.
3. The end-to-end verify forward (cache read only, + LM head + argmax, as the speculative step runs it) of a
   random-weight 7B-shaped target (28 layers, 28 / 4 heads, head dim 128, bf16) at W = 16 / 64 over 4k / 16k
   caches, `--attention xla` against `--attention pallas`.

Writes DIR/tree_attention.json (date, device, jax version, every row) and prints Markdown tables. A row that
fails (a kernel that does not lower on this device) is recorded with its error and the run goes on; rows stop
starting once --seconds have passed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

FULL = dict(heads=(64, 8), head_dim=128, batches=(1, 4), caches=(2048, 8192, 32768), widths=(16, 32, 64, 96),
            lm="7b", lm_caches=(4096, 16384), lm_widths=(16, 64), copy_bytes=1 << 30, repeats=20)
QUICK = dict(heads=(4, 2), head_dim=64, batches=(2,), caches=(200,), widths=(5, 16), lm="tiny64",
             lm_caches=(96,), lm_widths=(8,), copy_bytes=1 << 22, repeats=3)


def _ms(fn, *args, repeats: int) -> float:
    from sage_jax.decoding.budget import time_ms  # the same timer as the cost profile of --budget auto

    return time_ms(fn, *args, repeats=repeats)


def copy_bandwidth(n_bytes: int, repeats: int) -> float:
    """Bytes per second of a jitted elementwise pass (every byte read once and written once)."""
    x = jnp.ones((n_bytes // 2,), jnp.bfloat16)
    ms = _ms(jax.jit(lambda a: a + 1), x, repeats=repeats)
    return 2 * n_bytes / (ms * 1e-3)


def random_tree(w: int, batch: int, seed: int) -> np.ndarray:
    """[B, W, W] ancestor masks of random trees (node i's parent drawn from the nodes before it, recent ones
    likelier, as a draft tree grows level by level), node 0 the root."""
    rng = np.random.default_rng(seed)
    anc = np.zeros((batch, w, w), bool)
    for b in range(batch):
        for i in range(w):
            anc[b, i, i] = True
            if i:
                parent = int(rng.integers(max(0, i - 8), i))
                anc[b, i] |= anc[b, parent]
    return anc


def attention_rows(cfg: dict, interpret: bool, deadline: float, save=lambda rows: None) -> list[dict]:
    from pallas_kernels.tree_attention import tree_attention
    from sage_jax.models import layers
    from sage_jax.models.serving_lm import split_mask
    from sage_jax.models.visibility import Visibility

    n, kh = cfg["heads"]
    h, dt = cfg["head_dim"], jnp.bfloat16
    kernel = jax.jit(lambda *a: tree_attention(*a, interpret=interpret))
    xla = jax.jit(layers.attention_with_new)
    rows = []
    for b in cfg["batches"]:
        for s in cfg["caches"]:
            for w in cfg["widths"]:
                if time.perf_counter() > deadline:
                    rows.append({"batch": b, "cache": s, "nodes": w, "error": "skipped: time budget spent"})
                    continue
                keys = jax.random.split(jax.random.key(b * 1_000_003 + s * 101 + w), 5)
                q = jax.random.normal(keys[0], (b, w, n, h), dt)
                k_c, v_c = (jax.random.normal(k, (b, s, kh, h), dt) for k in keys[1:3])
                k_n, v_n = (jax.random.normal(k, (b, w, kh, h), dt) for k in keys[3:5])
                # Rows of different lengths: the longest commits 7/8 of the cache, the others a little less.
                length = jnp.asarray([s * 7 // 8 - 37 * i for i in range(b)], jnp.int32)
                pad = jnp.asarray([3 * i for i in range(b)], jnp.int32)
                window = jnp.asarray(random_tree(w, b, seed=w))
                dense, dense_new = split_mask(Visibility(pad=pad, start=length, window=window).dense(s), length)
                row = {"batch": b, "cache": s, "nodes": w}
                try:
                    row["kernel_ms"] = _ms(kernel, q, k_c, v_c, length, pad, k_n, v_n, window, repeats=cfg["repeats"])
                    row["xla_ms"] = _ms(xla, q, k_c, v_c, dense, k_n, v_n, dense_new, repeats=cfg["repeats"])
                    got = kernel(q, k_c, v_c, length, pad, k_n, v_n, window).astype(jnp.float32)
                    want = xla(q, k_c, v_c, dense, k_n, v_n, dense_new).astype(jnp.float32)
                    row["max_abs_diff"] = float(jnp.max(jnp.abs(got - want)))
                    item = jnp.dtype(dt).itemsize
                    visible = int(jnp.sum(length - pad))
                    row["kernel_bytes"] = item * (2 * visible * kh * h + 2 * b * w * n * h + 2 * b * w * kh * h)
                except Exception as e:  # noqa: BLE001 - a kernel that fails on this device is a result too
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                rows.append(row)
                save(rows)
                print(_attention_line(row, None), file=sys.stderr, flush=True)
    return rows


@jax.jit
def _verify(lm, cache, tokens, vis):
    """The speculative step's target forward: the cache only read, every node's argmax."""
    pos = vis.start[:, None] + jnp.sum(vis.window, -1) - 1  # a node's position: the root's plus its depth
    hidden, kv = lm.forward(tokens, pos, vis, cache, vis.start, write=False)
    return jnp.argmax(lm.head(hidden), -1), kv


def verify_rows(cfg: dict, deadline: float, save=lambda rows: None) -> list[dict]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from device_bench import random_lm

    from sage_jax.models.visibility import Visibility

    base = random_lm(cfg["lm"])
    rows = []
    for s in cfg["lm_caches"]:
        for w in cfg["lm_widths"]:
            if time.perf_counter() > deadline:
                rows.append({"cache": s, "nodes": w, "error": "skipped: time budget spent"})
                continue
            row = {"cache": s, "nodes": w, "model": cfg["lm"]}
            cache = base.init_cache(1, s)
            vis = Visibility(pad=jnp.zeros((1,), jnp.int32), start=jnp.full((1,), s * 7 // 8, jnp.int32),
                             window=jnp.asarray(random_tree(w, 1, seed=w)))

            tokens = jnp.full((1, w), 7, jnp.int32)
            for att in ("xla", "pallas"):
                try:
                    row[f"{att}_ms"] = _ms(_verify, base.with_attention(att), cache, tokens, vis,
                                           repeats=cfg["repeats"])
                except Exception as e:  # noqa: BLE001
                    row[f"{att}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            save(rows)
            print(f"verify {row}", file=sys.stderr, flush=True)
    return rows


def _attention_line(r: dict, copy_bw: float | None) -> str:
    if "error" in r:
        return f"| {r['batch']} | {r['cache']} | {r['nodes']} | {r['error']} | | | | |"
    bw = r["kernel_bytes"] / (r["kernel_ms"] * 1e-3)
    share = f" ({bw / copy_bw:.0%})" if copy_bw else ""
    return (f"| {r['batch']} | {r['cache']} | {r['nodes']} | {r['kernel_ms']:.3f} | {r['xla_ms']:.3f} | "
            f"{r['xla_ms'] / r['kernel_ms']:.2f} | {bw / 1e9:.1f} GB/s{share} | {r['max_abs_diff']:.2g} |")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out/tree_attention"))
    ap.add_argument("--seconds", type=float, default=220.0, help="start no new row after this many seconds")
    ap.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (a CPU smoke run)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cfg = QUICK if args.quick else FULL
    t0 = time.perf_counter()
    dev = jax.devices()[0]
    interpret = dev.platform == "cpu"  # no Mosaic or Triton there
    out = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "device": f"{dev.platform} {dev.device_kind}", "jax": jax.__version__, "interpret": interpret,
           "shapes": {k: v for k, v in cfg.items()}}
    path = os.path.join(args.out, "tree_attention.json")

    def save(part):  # after every row: a run cut short by its timeout keeps what it measured
        def write(rows):
            out[part] = rows
            with open(path, "w") as fh:
                json.dump(out, fh, indent=1)
        return write

    out["copy_bandwidth"] = copy_bandwidth(cfg["copy_bytes"], cfg["repeats"])
    deadline = t0 + args.seconds
    out["attention"] = attention_rows(cfg, interpret, deadline - args.seconds * 0.35, save("attention"))
    out["verify"] = verify_rows(cfg, deadline, save("verify"))
    save("verify")(out["verify"])
    n, kh = cfg["heads"]
    print(f"# Tree attention, {out['device']}, jax {out['jax']}, {out['date']}"
          f"{' (interpret mode: not a speed measurement)' if interpret else ''}\n")
    print(f"copy bandwidth {out['copy_bandwidth'] / 1e9:.0f} GB/s\n")
    print(f"## one layer: {n} query / {kh} KV heads, head dim {cfg['head_dim']}, bf16, 7/8 of the cache committed\n")
    print("| batch | cache | nodes | kernel ms | XLA ms | XLA / kernel | kernel bandwidth (share of copy) | max diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out["attention"]:
        print(_attention_line(r, out["copy_bandwidth"]))
    print(f"\n## verify forward, random {cfg['lm']} target (bf16), + head + argmax\n")
    print("| cache | nodes | xla ms | pallas ms | xla / pallas |")
    print("|---|---|---|---|---|")
    for r in out["verify"]:
        x, p = r.get("xla_ms"), r.get("pallas_ms")
        cells = [f"{v:.2f}" if v is not None else r.get(f"{a}_error", r.get("error", ""))
                 for v, a in ((x, "xla"), (p, "pallas"))]
        ratio = f"{x / p:.2f}" if x and p else ""
        print(f"| {r['cache']} | {r['nodes']} | {cells[0]} | {cells[1]} | {ratio} |")
    print(f"\nwrote {path} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
