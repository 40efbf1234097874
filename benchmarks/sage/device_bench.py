"""Verify-cost curves and SAGE end to end on an accelerator (GPU or TPU VM), one prepared run under 8 minutes.

    bash benchmarks/device_bench.sh            # or: python benchmarks/sage/device_bench.py --out DIR [--sizes ...]

1. For each target size (random Llama-family weights in bf16, batch 1, a 2048-slot cache with 1024 committed
   tokens) it times one verify forward (+ head + argmax) at 1..1024 tree nodes: the c_t(N) curve the hardware-aware
   budget (`sage_jax/decoding/budget.py`) optimises against, beside what the roofline model
   (`sage_jax/decoding/cost_model.py`) predicts for this chip (on a CPU: for this machine's measured bandwidth and
   flops). On a CPU 32 nodes cost ~2.2x one token; on an accelerator the curve stays flat much longer.
2. The attention paths for a tree mask: our masked XLA einsum (the reference) vs `jax.nn.dot_product_attention`
   (cuDNN on GPU when available).
3. End to end: the shipped SmolLM2-135M-Instruct with its shipped head on `--e2e-prompts` chat prompts, plain
   decoding against SAGE with `--budget auto` and with full trees, every output compared with plain decoding's
   (on an accelerator a near-tie can round the other way in a verify forward: the count of identical outputs is
   reported, not assumed).

Writes DIR/device_bench.json (with what produced it: `configs.provenance`) and prints Markdown tables; a size is
skipped when the time budget (--seconds) would be exceeded.
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
WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CAPACITY, CONTEXT = 2048, 1024


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


def verify_curve(lm, capacity=CAPACITY, context=CONTEXT, widths=WIDTHS):
    from sage_jax.decoding.tree import causal_visibility

    cache = lm.init_cache(1, capacity)
    length, pad = jnp.full((1,), context, jnp.int32), jnp.zeros((1,), jnp.int32)

    @jax.jit
    def verify(lm, cache, tokens):
        slots = context + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        hidden, cache = lm.forward(tokens, slots, causal_visibility(slots, pad, capacity), cache, length)
        return jnp.argmax(lm.head(hidden), -1), cache

    return {w: _time(verify, lm, cache, jnp.full((1, w), 7, jnp.int32)) for w in widths}


def attention_paths(n_heads=28, n_kv=4, hd=128, capacity=2048, widths=(16, 64, 256, 1024)):
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


def predicted_curve(cfg, chip, widths=WIDTHS) -> dict[int, float]:
    """The cost model's ms for `verify_curve`'s forwards on `chip` (the XLA path attends over the whole cache)."""
    from sage_jax.decoding import cost_model

    return {w: float(ms) for w, ms in zip(widths, cost_model.widths_table(cost_model.Arch.of(cfg), chip, widths,
                                                                          context=CAPACITY))}


def end_to_end(n_prompts: int, max_new_tokens: int) -> dict:
    """The shipped SmolLM2 and head on `n_prompts` held-out chat prompts: AR, SAGE `--budget auto`, SAGE's full
    trees; tokens/s (compile excluded: each is run once to compile), τ+1, outputs identical to AR's."""
    from sage_jax.engine import load_engine
    from sage_jax.prompts import EVAL_PROMPTS

    engine = load_engine()
    prompts = [text for _, text in EVAL_PROMPTS[:n_prompts]]
    runs = {"ar": dict(policy="ar"), "sage-auto": dict(policy="sage", budget="auto"),
            "sage-full": dict(policy="sage", budget=None)}
    out = {}
    ref = None
    for name, kw in runs.items():
        engine.generate(prompts[:1], max_new_tokens=max_new_tokens, **kw)  # compile (and, for auto, measure)
        t0 = time.perf_counter()
        gens = [engine.generate([p], max_new_tokens=max_new_tokens, **kw) for p in prompts]
        secs = time.perf_counter() - t0
        ids = [g.token_ids[0] for g in gens]
        ref = ids if name == "ar" else ref
        tokens = sum(len(i) for i in ids)
        steps = sum(g.stats.steps for g in gens)
        out[name] = {"tok_s": tokens / secs, "tokens_per_step": tokens / max(steps, 1),
                     "identical": sum(a == b for a, b in zip(ids, ref)), "prompts": len(prompts),
                     "budgets": sorted({tuple(g.stats.budget) for g in gens if g.stats.budget is not None})}
    for row in out.values():
        row["vs_ar"] = row["tok_s"] / out["ar"]["tok_s"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out/device_bench"))
    ap.add_argument("--sizes", default="0.5b,1.5b,7b")
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="verify widths (tree nodes + root)")
    ap.add_argument("--seconds", type=float, default=300.0, help="stop starting new sizes after this")
    ap.add_argument("--attention-widths", default="16,64,256,1024", help="queries of the attention paths' part "
                    "(empty: skip it)")
    ap.add_argument("--e2e-prompts", type=int, default=8, help="chat prompts of the end-to-end part (0: skip it)")
    ap.add_argument("--e2e-tokens", type=int, default=96, help="new tokens per prompt in the end-to-end part")
    args = ap.parse_args(argv)
    from configs import provenance
    from sage_jax.decoding import cost_model

    widths = tuple(int(w) for w in args.widths.split(","))
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    chip = cost_model.device_chip() or cost_model.measure_host()
    result = {"device": f"{dev.platform} {dev.device_kind}", "jax": jax.__version__, "chip_model": chip.name,
              "provenance": provenance.record("python benchmarks/sage/device_bench.py", argv),
              "verify_ms": {}, "predicted_ms": {}, "attention_ms": {}, "end_to_end": {}}
    path = os.path.join(args.out, "device_bench.json")

    def save():
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)

    print(f"# {result['device']}, jax {jax.__version__}; cost model: {chip.name}")
    for name in args.sizes.split(","):
        if time.perf_counter() - t_start > args.seconds:
            print(f"skipping {name}: time budget spent")
            continue
        t0 = time.perf_counter()
        lm = random_lm(name)
        curve = verify_curve(lm, widths=widths)
        pred = predicted_curve(lm.cfg, chip, widths)
        result["verify_ms"][name], result["predicted_ms"][name] = curve, pred
        base = curve[widths[0]]
        print(f"\n## {name} (random weights, bf16): verify forward ms vs tree nodes ({time.perf_counter() - t0:.0f}s)")
        print("| nodes | " + " | ".join(str(w) for w in curve) + " |")
        print("|---|" + "---|" * len(curve))
        print("| ms | " + " | ".join(f"{c:.2f}" for c in curve.values()) + " |")
        print(f"| x {widths[0]} node(s) | " + " | ".join(f"{c / base:.2f}" for c in curve.values()) + " |")
        print("| model ms | " + " | ".join(f"{pred[w]:.2f}" for w in curve) + " |")
        save()
    att_widths = tuple(int(w) for w in args.attention_widths.split(",") if w)
    if att_widths and time.perf_counter() - t_start < args.seconds + 60:
        result["attention_ms"] = attention_paths(widths=att_widths)
        print("\n## tree-mask attention paths (ms; 28 heads, 4 kv heads, 2048-slot cache)")
        for w, row in result["attention_ms"].items():
            print(f"| {w} queries | " + " | ".join(f"{k}: {v if isinstance(v, str) else f'{v:.3f}'}"
                                                  for k, v in row.items()) + " |")
        save()
    if args.e2e_prompts > 0:
        t0 = time.perf_counter()
        result["end_to_end"] = end_to_end(args.e2e_prompts, args.e2e_tokens)
        print(f"\n## SmolLM2-135M-Instruct + shipped head, {args.e2e_prompts} held-out chat prompts, "
              f"{args.e2e_tokens} new tokens, one prompt at a time ({time.perf_counter() - t0:.0f}s)")
        print("| method | tok/s | vs AR | tokens per step | identical to AR | budgets |\n|---|---|---|---|---|---|")
        for name, r in result["end_to_end"].items():
            print(f"| {name} | {r['tok_s']:.1f} | {r['vs_ar']:.2f}x | {r['tokens_per_step']:.2f} | "
                  f"{r['identical']} / {r['prompts']} | {r['budgets']} |")
    save()
    print(f"\nwrote {path} in {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
