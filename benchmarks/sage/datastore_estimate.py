"""Would a datastore of the target's own answers (REST-style retrieval) add accepted tokens on held-out chat?

An offline estimate, before building anything into the decoding loop. The shipped SmolLM2 target answers N
training-split WordNet prompts greedily (96 new tokens) and the 24 held-out chat prompts (64). At every position
of every held-out answer, two 8-token candidate chains are checked against what the target really said next:

* prompt lookup, as `sage_jax.decoding.retrieval.lookup` builds it (the tokens after the latest earlier occurrence
  of the newest 3/2/1-gram of the prompt and the answer so far);
* the datastore: the longest newest n-gram (n = 4 down to `--min-n`) found in the training answers, continued by
  a walk down their continuations' trie that takes the most frequent token at each depth.

It reports the mean matched prefix per position of each chain and of the better of the two (what a tree holding
both would accept from them). The EAGLE head's own candidates are not in this estimate.

    .venv/bin/python benchmarks/sage/datastore_estimate.py --answers 384    # about 6 min on a 2-core CPU
    .venv/bin/python benchmarks/sage/datastore_estimate.py --answers 1536   # about 20 min

Results: `benchmarks/sage/results/datastore_estimate.md` (and the JSON of each run).
"""

import argparse
import collections
import json
import os
import time

import numpy as np

L = 8  # chain length, as `generate --retrieval 8`


def prompt_lookup(ctx: list[int], ngrams=(3, 2, 1)) -> list[int]:
    for n in ngrams:
        if len(ctx) <= n:
            continue
        q = ctx[-n:]
        for j in range(len(ctx) - 2, n - 2, -1):  # an occurrence ending strictly before the newest token
            if ctx[j - n + 1: j + 1] == q:
                return ctx[j + 1: j + 1 + L]
    return []


def build_store(seqs: list[list[int]], n_max: int) -> dict:
    store = collections.defaultdict(collections.Counter)
    for s in seqs:
        for n in range(1, n_max + 1):
            for i in range(n, len(s)):
                store[(n, tuple(s[i - n: i]))][tuple(s[i: i + L])] += 1
    return store


def store_lookup(store: dict, ctx: list[int], n_min: int, n_max: int) -> list[int]:
    for n in range(n_max, n_min - 1, -1):
        conts = store.get((n, tuple(ctx[-n:])))
        if not conts:
            continue
        cands, out = list(conts.items()), []
        for k in range(L):  # down the trie: the most frequent token at each depth among what is left
            firsts = collections.Counter()
            for cont, cnt in cands:
                if len(cont) > k:
                    firsts[cont[k]] += cnt
            if not firsts:
                break
            t = firsts.most_common(1)[0][0]
            out.append(t)
            cands = [(c, n_) for c, n_ in cands if len(c) > k and c[k] == t]
        return out
    return []


def matched(cand: list[int], truth: list[int]) -> int:
    m = 0
    for a, b in zip(cand, truth):
        if a != b:
            break
        m += 1
    return m


def answers(engine, texts: list[str], max_new: int, batch: int = 16) -> list[list[list[int]]]:
    out = []
    for s in range(0, len(texts), batch):
        g = engine.generate(texts[s: s + batch], policy="ar", max_new_tokens=max_new)
        out += [[engine.encode(t), ids] for t, ids in zip(texts[s: s + batch], g.token_ids, strict=True)]
        print(f"answered {s + len(g.token_ids)}/{len(texts)} ({time.strftime('%T')})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--answers", type=int, default=384, help="training prompts the target answers")
    ap.add_argument("--cache", default="runs/datastore_answers.json", help="answers kept here between runs")
    ap.add_argument("--out", help="JSON (default: benchmarks/sage/results/datastore_estimate_<answers>.json)")
    args = ap.parse_args()
    data = json.load(open(args.cache)) if os.path.exists(args.cache) else {}
    if "heldout" not in data or len(data.get("train", [])) < args.answers:
        from sage_jax.engine import load_engine
        from sage_jax.prompts import EVAL_PROMPTS
        from sage_jax.training import wordnet

        engine = load_engine()
        data["heldout"] = answers(engine, [t for _, t in EVAL_PROMPTS], 64)
        prompts = [t for _, t in wordnet.build_prompts(args.answers, "train", style="extended")]
        data["train"] = answers(engine, prompts, 96)
        os.makedirs(os.path.dirname(os.path.abspath(args.cache)), exist_ok=True)
        with open(args.cache, "w") as f:
            json.dump(data, f)
    train = [a for _, a in data["train"][: args.answers]]
    rows, store = [], build_store(train, 4)
    print("| datastore | n | positions | prompt lookup | datastore | better of the two | datastore fires | "
          "its first token right |\n|---|---|---|---|---|---|---|---|")
    for n_min in (2, 3):
        m_ctx, m_st, m_both, fired, first = [], [], [], 0, 0
        for p, a in data["heldout"]:
            for t in range(1, len(a)):
                ctx, truth = p + a[:t], a[t:]
                c1, c2 = prompt_lookup(ctx), store_lookup(store, ctx, n_min, 4)
                m1, m2 = matched(c1, truth), matched(c2, truth)
                m_ctx.append(m1), m_st.append(m2), m_both.append(max(m1, m2))
                fired += bool(c2)
                first += m2 > 0
        k = len(m_ctx)
        row = {"answers": len(train), "tokens": sum(map(len, train)), "n_min": n_min, "positions": k,
               "prompt_lookup": float(np.mean(m_ctx)), "datastore": float(np.mean(m_st)),
               "better_of_two": float(np.mean(m_both)), "fires": fired / k, "first_right": first / max(fired, 1)}
        rows.append(row)
        print(f"| {row['answers']} answers, {row['tokens']} tokens | {n_min}-4 | {k} | {row['prompt_lookup']:.3f} | "
              f"{row['datastore']:.3f} | {row['better_of_two']:.3f} | {row['fires']:.2f} | {row['first_right']:.2f} |")
    out = args.out or f"benchmarks/sage/results/datastore_estimate_{args.answers}.json"
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
