"""Verify-cost curves on an accelerator (GPU or TPU VM), random-weight targets, one prepared run < 10 minutes.

    bash benchmarks/device_bench.sh            # or: python benchmarks/sage/device_bench.py --out DIR [--sizes ...]

For each target size (random Llama-family weights in bf16, batch 1, a 2048-slot cache with 1024 committed
tokens) it times one verify forward (+ head + argmax) at 1..256 tree nodes: the c_t(N) curve the hardware-aware
budget (`sage_jax/decoding/budget.py`) optimises against. On a CPU 32 nodes cost ~2.2x one token; on an
accelerator the curve stays flat much longer, so --budget auto picks far larger trees there. It also compares the
attention paths for a tree mask: our masked XLA einsum (the reference) vs `jax.nn.dot_product_attention`
(cuDNN on GPU when available). Writes DIR/device_bench.json and prints Markdown tables; each size is skipped
if the time budget (--seconds) would be exceeded.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

SIZES = {  # name: (layers, d_model, heads, kv heads, mlp, vocab); "tiny" is a CPU smoke check of this script
    "tiny": (2, 64, 4, 2, 128, 512),
    "tiny64": (2, 128, 2, 1, 256, 512),  # head dim 64: the tree-attention kernels' smallest (its CPU smoke run)
    "0.5b": (24, 1024, 16, 4, 4096, 32000),
    "1.5b": (28, 1536, 12, 2, 8960, 32000),
    "7b": (28, 3584, 28, 4, 18944, 32000),
}
WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _time(fn, *args, repeats=10):
    """Median milliseconds after a warm-up call: the same timer as the cost profile of `--budget auto`."""
    from sage_jax.decoding.budget import time_ms

    return time_ms(fn, *args, repeats=repeats)


def random_lm(name: str, dtype="bfloat16"):
    from sage_jax.models.config import LMConfig
    from sage_jax.models.serving_lm import LM

    n_l, d, n_h, n_kv, f, v = SIZES[name]
    hd = d // n_h
    cfg = LMConfig(vocab_size=v, d_model=d, n_layers=n_l, n_heads=n_h, n_kv_heads=n_kv, head_dim=hd, mlp_dim=f,
                   qkv_bias=False, tie_embeddings=False, eos_token_ids=(), pad_token_id=0, dtype=dtype,
                   param_dtype=dtype)
    key = jax.random.key(0)
    dt = jnp.dtype(dtype)

    def w(shape, i):
        return (jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) * 0.02).astype(dt)

    layers = tuple({"attn_norm": jnp.ones((d,), dt), "mlp_norm": jnp.ones((d,), dt),  # `lm.serving_layer` form
                    "qkv": w(((n_h + 2 * n_kv) * hd, d), 6 * i), "o": w((d, n_h * hd), 6 * i + 1),
                    "gate_up": w((2 * f, d), 6 * i + 2), "down": w((d, f), 6 * i + 3)} for i in range(n_l))
    return LM(embed=w((v, d), 10_000), final_norm=jnp.ones((d,), dt), lm_head=w((d, v), 10_001), layers=layers,
              cfg=cfg)


def verify_curve(lm, capacity=2048, context=1024, widths=WIDTHS):
    from sage_jax.decoding.tree import causal_visibility

    cache = lm.init_cache(1, capacity)
    length, pad = jnp.full((1,), context, jnp.int32), jnp.zeros((1,), jnp.int32)

    @jax.jit
    def verify(lm, cache, tokens):
        slots = context + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        hidden, cache = lm.forward(tokens, slots, causal_visibility(slots, pad, capacity), cache, length)
        return jnp.argmax(lm.head(hidden), -1), cache

    return {w: _time(verify, lm, cache, jnp.full((1, w), 7, jnp.int32)) for w in widths}


def attention_paths(n_heads=28, n_kv=4, hd=128, capacity=2048, widths=(16, 64, 256)):
    from sage_jax.models import layers

    out = {}
    for w in widths:
        k0, k1, k2 = jax.random.split(jax.random.key(w), 3)
        q = jax.random.normal(k0, (1, w, n_heads, hd), jnp.bfloat16)
        k = jax.random.normal(k1, (1, capacity, n_kv, hd), jnp.bfloat16)
        v = jax.random.normal(k2, (1, capacity, n_kv, hd), jnp.bfloat16)
        mask = (jnp.arange(capacity)[None, None, :] < 1024 + jnp.arange(w)[None, :, None])
        row = {"xla_masked_einsum": _time(jax.jit(layers.attention), q, k, v, mask)}
        try:
            dpa = jax.jit(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m[:, None]))
            row["jax.nn.dot_product_attention"] = _time(dpa, q, k, v, mask)
        except Exception as e:  # noqa: BLE001 - report any backend refusal, keep going
            row["jax.nn.dot_product_attention"] = f"failed: {type(e).__name__}"
        out[w] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out/device_bench"))
    ap.add_argument("--sizes", default="0.5b,1.5b,7b")
    ap.add_argument("--seconds", type=float, default=480.0, help="stop starting new sizes after this")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    result = {"device": f"{dev.platform} {dev.device_kind}", "jax": jax.__version__, "verify_ms": {},
              "attention_ms": {}}
    print(f"# {result['device']}, jax {jax.__version__}")
    for name in args.sizes.split(","):
        if time.perf_counter() - t_start > args.seconds:
            print(f"skipping {name}: time budget spent")
            continue
        t0 = time.perf_counter()
        curve = verify_curve(random_lm(name))
        result["verify_ms"][name] = curve
        base = curve[1]
        print(f"\n## {name} (random weights, bf16): verify forward ms vs tree nodes ({time.perf_counter() - t0:.0f}s)")
        print("| nodes | " + " | ".join(str(w) for w in curve) + " |")
        print("|---|" + "---|" * len(curve))
        print("| ms | " + " | ".join(f"{c:.2f}" for c in curve.values()) + " |")
        print("| x one token | " + " | ".join(f"{c / base:.2f}" for c in curve.values()) + " |")
        with open(os.path.join(args.out, "device_bench.json"), "w") as fh:
            json.dump(result, fh, indent=1)
    if time.perf_counter() - t_start < args.seconds + 60:
        result["attention_ms"] = attention_paths()
        print("\n## tree-mask attention paths (ms; 28 heads, 4 kv heads, 2048-slot cache)")
        for w, row in result["attention_ms"].items():
            print(f"| {w} queries | " + " | ".join(f"{k}: {v if isinstance(v, str) else f'{v:.3f}'}"
                                                  for k, v in row.items()) + " |")
    with open(os.path.join(args.out, "device_bench.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"\nwrote {os.path.join(args.out, 'device_bench.json')} in {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
