"""Greedy autoregressive decoding of the real SmolLM2-135M-Instruct: ours (one jit around lax.while_loop) vs
transformers' eager PyTorch `generate`, same weights (the shipped GGUF), same prompts, same CPU, one process.

    python benchmarks/sage/ar_vs_transformers.py [--new-tokens 128] [--prompts 3] [--policies chain,static,eagle2,sage]

Prints a Markdown table (tokens/s; compile time excluded for ours, a warm-up generate for transformers) and checks
that both produce the same tokens. With --policies it also times our speculative policies (self-draft).
"""

from __future__ import annotations

import argparse
import os
import time

PROMPTS = [
    "Explain what a hash table is and when to use one.",
    "Write a Python function that checks whether a number is prime.",
    "List five tips for writing clear technical documentation.",
    "Rewrite in formal English: gonna be late, traffic is crazy.",
    "What causes the seasons on Earth?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--policies", default="", help="comma-separated speculative policies to time as well")
    ap.add_argument("--draft-layers", type=int, default=10)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    import sage_jax

    torch.set_num_threads(os.cpu_count() or 1)
    path = sage_jax.default_target()
    engine = sage_jax.load_engine(path, draft_layers=args.draft_layers)
    d, f = os.path.split(path)
    ref = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    prompts = [engine.encode(p) for p in PROMPTS[: args.prompts]]
    n = args.new_tokens

    def ours(policy):
        engine.generate([prompts[0]], policy=policy, max_new_tokens=n)  # compile
        toks, secs, outs = 0, 0.0, []
        for p in prompts:
            g = engine.generate([p], policy=policy, max_new_tokens=n)
            toks += g.stats.new_tokens
            secs += g.stats.prefill_seconds + g.stats.decode_seconds
            outs.append(g.token_ids[0])
        return toks / secs, outs

    def theirs():
        kw = dict(max_new_tokens=n, do_sample=False, eos_token_id=list(engine.cfg.eos_token_ids),
                  pad_token_id=engine.cfg.pad_token_id)
        with torch.no_grad():
            ref.generate(torch.tensor([prompts[0]]), **kw)  # warm-up
            toks, secs, outs = 0, 0.0, []
            for p in prompts:
                t0 = time.perf_counter()
                out = ref.generate(torch.tensor([p]), **kw)[0, len(p):].tolist()
                secs += time.perf_counter() - t0
                toks += len(out)
                outs.append(out)
        return toks / secs, outs

    hf_tps, hf_out = theirs()
    ar_tps, ar_out = ours("ar")
    rows = [("transformers eager generate", hf_tps, "-"), ("ours: ar", ar_tps, str(ar_out == hf_out))]
    for pol in filter(None, args.policies.split(",")):
        tps, out = ours(pol)
        rows.append((f"ours: {pol} (self-draft {args.draft_layers} layers)", tps, str(out == ar_out)))
    print(f"\nSmolLM2-135M-Instruct, greedy, {n} new tokens, {len(prompts)} prompts, {os.cpu_count()} CPU cores\n")
    print("| method | tokens/s | vs transformers | same tokens |")
    print("|---|---|---|---|")
    for name, tps, same in rows:
        print(f"| {name} | {tps:.1f} | {tps / hf_tps:.2f}x | {same} |")


if __name__ == "__main__":
    main()
