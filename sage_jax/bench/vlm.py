"""`python -m sage_jax.bench --vlm`: speculative decoding of a vision-language pair, as the paper measures it.

    python -m sage_jax.bench --vlm [--target VLM] [--draft VLM] [--image PATH ...] [--video PATH ...]
        [--ratios 0,0.3,0.6,0.8,0.9,0.95] [--prune attention|uniform] [--budget static|auto|N,D]
        [--max-new-tokens N] [--prompts N] [--clips] [--methods chain,static,eagle2,sage] [--out DIR] [--quick]

Two tables, side by side in one process: AR vs every tree policy (chain, static, EAGLE-2, SAGE) at the engine's
pruning ratios (the paper's 0.8 / 0.9 by default), and the draft pruning-ratio sweep of the paper's Table 5 (SAGE at
each ratio: τ, τ+1, tokens/s, and the target's and the draft's prefill seconds, each compiled and timed apart).
Without `--target` the pair is the shipped home-trained VLM (SmolLM2-135M-Instruct with its own tower) and its
shipped draft VLM (`sage_jax/assets/smollm2_vlm_draft`; `--draft sage_jax/assets/smollm2_vlm/draft`: its
EAGLE-style head), asked about held-out
Fashion-MNIST test images (never trained on; `--prompts N` of them, default 8), and the table says how many answers
name the right class; with `--clips`, which items appear in held-out clips of three Fashion-MNIST test items
(`vlm_data.heldout_clips`, 24 frames, 97 video tokens each), and how many answers name exactly the clip's items.
With another target and no `--image` / `--video` the prompts ask about scikit-image's sample photos. `--quick`: a
tiny random Qwen2.5-VL pair and two synthetic images (CI smoke run). Writes DIR/vlm_bench.json (with what
produced it: `configs.provenance`) and DIR/vlm_pruning.png.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from tqdm import tqdm

from configs import cli

QUESTIONS = ("Describe this image in detail.", "What is in the picture?", "Write a short caption for this image.",
             "What colours dominate this image?")
VIDEO_QUESTION = "Describe what happens in this video."
RATIOS = (0.0, 0.3, 0.6, 0.8, 0.9, 0.95)  # the paper's Table 5
POLICIES = ("chain", "static", "eagle2", "sage")


def default_images() -> list:
    """scikit-image's sample photos (they ship with the package, no download)."""
    from PIL import Image

    try:
        from skimage import data
    except ModuleNotFoundError:
        raise cli.BadInput("without --image or --video the prompts ask about scikit-image's sample photos: "
                           "pip install -e '.[vlm-train]', or give --image") from None

    return [Image.fromarray(getattr(data, n)()) for n in ("astronaut", "coffee", "chelsea", "rocket")]


def heldout_images(n: int, skip: int = 0, split: str = "test") -> tuple[list, np.ndarray]:
    """Held-out Fashion-MNIST images `skip` … `skip + n` of `split` (`vlm_data.heldout_indices`) as PIL images, and
    labels. The bench asks about the first test ones; `evaluate_draft --vlm` measures on dev ones."""
    from PIL import Image

    from sage_jax.training import vlm_data

    test = vlm_data.fashion(split)
    idx = vlm_data.heldout_indices(skip + n, split)[skip:]
    return [Image.fromarray(x) for x in test.pixels[idx]], test.labels[idx]


def heldout_split(prompt_set: str) -> str:
    """The Fashion-MNIST split the shipped VLM's bench reads for `--prompt-set`: dev for the dev sets (where a draft
    or a setting is chosen), test otherwise (frozen, quoted)."""
    return "dev" if prompt_set.startswith("dev") else "test"


def heldout_questions() -> tuple[str, ...]:
    """The questions asked about held-out images, in turn: the default one, two more "what is" and a description."""
    from sage_jax.training import vlm_data

    return (vlm_data.DEFAULT_QUESTION, *vlm_data.WHAT[1:3], vlm_data.DESCRIBE[0])


def _synthetic_images() -> list:
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((224, 224), (168, 224))]


def build(args, scratch: str):
    """(engine, prompts [(question, images, videos)], title) from the flags; `scratch`: a folder for --quick's
    tiny models, removed by the caller."""
    from sage_jax.engine import Engine, load_engine

    ratios = (0.8, 0.9)
    if args.quick:
        from sage_jax.bench.tiny_vlm import tiny_vlm

        # Images of up to 256 visual tokens against ~30 text tokens: the proportions of a real image prompt.
        kw = dict(max_pixels=224 * 224, max_position=2048)
        target = tiny_vlm("qwen2_5_vl", 0, os.path.join(scratch, "target"), **kw)
        draft = tiny_vlm("qwen2_5_vl", 1, os.path.join(scratch, "draft"), n_layers=1, like=target, noise=0.05, **kw)
        engine = Engine(target, draft, prune=args.prune, prune_ratio=ratios, description="tiny 1-layer VLM",
                        attention=args.attention)
        images, videos, name = _synthetic_images(), [], "tiny random Qwen2.5-VL pair (--quick)"
    elif args.target is None:
        from sage_jax.io import loader

        with cli.reported(OSError, ValueError):
            engine = load_engine(loader.default_vlm(), args.draft, prune=args.prune, prune_ratio=ratios,
                                 attention=args.attention)
        split = heldout_split(args.prompt_set)
        if args.clips:
            from sage_jax.training import vlm_data

            clips, labels = vlm_data.heldout_clips(args.prompts or 8, split=split)
            prompts = [(vlm_data.VIDEO_QUESTION, [], [v]) for v in clips]
            what = f"held-out clips of 3 Fashion-MNIST {split} items"
        else:
            images, labels = heldout_images(args.prompts or 8, split=split)
            questions = heldout_questions()
            prompts = [(questions[i % len(questions)], [im], []) for i, im in enumerate(images)]
            what = f"held-out Fashion-MNIST {split} images"
        title = (f"shipped home-trained VLM (SmolLM2-135M-Instruct + its own tower), draft {engine.description}, "
                 f"greedy, {args.max_new_tokens} new tokens, {len(prompts)} {what}, pruning by {args.prune}")
        return engine, prompts, title, labels
    else:
        with cli.reported(OSError, ValueError):
            engine = load_engine(args.target, args.draft, prune=args.prune, prune_ratio=ratios,
                                 attention=args.attention)
            if engine.vision is None:
                raise cli.BadInput(f"--vlm needs a vision-language target; {args.target} is a text LM")
            from sage_jax.io import images as io_images

            images = [io_images.load_image(p) for p in args.image] or ([] if args.video else default_images())
            videos = [io_images.load_frames(p) for p in args.video]
        name = args.target
    prompts = [(QUESTIONS[i % len(QUESTIONS)], [im], []) for i, im in enumerate(images)]
    prompts += [(VIDEO_QUESTION, [], [v]) for v in videos]
    prompts = prompts[: args.prompts] if args.prompts else prompts
    title = (f"{name}, draft {engine.description}, greedy, {args.max_new_tokens} new tokens, {len(prompts)} "
             f"prompts, pruning by {args.prune}")
    return engine, prompts, title, None


def _measure(engine, prompts, policy, budget, max_new, ratio=None, acceptance=None) -> dict:
    """Compiles on the first prompt (timed apart), then decodes each prompt: tokens and per-prompt seconds; each
    prompt's statistics are also added to `acceptance` (a `budget.AcceptanceStats` of `policy`'s sizes), if given."""
    q, im, vi = prompts[0]
    t0 = time.perf_counter()
    engine.generate([q], images=[im], videos=[vi], policy=policy, budget=budget, max_new_tokens=max_new,
                    prune_ratio=ratio)
    warm = time.perf_counter() - t0
    runs = []
    for q, im, vi in prompts:
        g = engine.generate([q], images=[im], videos=[vi], policy=policy, budget=budget, max_new_tokens=max_new,
                            prune_ratio=ratio)
        s = g.stats
        if acceptance is not None:
            acceptance.update(s)
        runs.append({"tokens": g.token_ids[0], "seconds": s.prefill_seconds + s.decode_seconds,
                     "steps": s.steps, "tau": s.mean_accepted, "prompt_tokens": s.prompt_tokens,
                     "draft_prompt_tokens": s.draft_prompt_tokens, "draft_forwards": s.draft_forwards})
    toks = sum(len(r["tokens"]) for r in runs)
    secs = sum(r["seconds"] for r in runs)
    steps = sum(r["steps"] for r in runs)
    loop = toks - len(runs)  # the first token of each prompt comes from the prefill
    return {"runs": runs, "warmup_seconds": warm, "tokens": toks, "seconds": secs,
            "tokens_per_second": toks / secs if secs else 0.0,
            "tau": (loop / steps - 1.0) if steps and policy != "ar" else 0.0,
            "tau_plus_1": loop / steps if steps else 0.0}


def _table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def draft_path(args) -> str | None:
    """The draft checkpoint `build` loads (None: the --quick pair's, built in memory, or a self-draft)."""
    if args.quick:
        return None
    if args.draft is not None:
        return args.draft
    from sage_jax.io import loader

    return loader.default_vlm_draft() if args.target is None else None


def run(args, argv: list[str] | None = None) -> int:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sage_bench_vlm_") as scratch:  # removed on every exit path
        return _run(args, argv, scratch)


def settings(args) -> tuple:
    """(budget, pruning ratios, methods) from the flags, or one-line `BadInput`: checked before any model loads
    (and before the results folder is touched)."""
    from sage_jax.bench.suite import parse_budget

    budget = parse_budget(args.budget)
    try:
        ratios = tuple(float(x) for x in args.ratios.split(",")) if args.ratios else RATIOS
    except ValueError:
        ratios = (float("nan"),)
    if not all(0.0 <= r <= 1.0 for r in ratios):
        raise cli.BadInput(f"--ratios takes numbers in [0, 1] separated by commas, got {args.ratios!r}")
    methods = ["ar", *POLICIES]
    if args.methods:
        want = [m.strip() for m in args.methods.split(",") if m.strip()]
        bad = [m for m in want if m not in POLICIES and m != "ar"]
        if bad:
            raise cli.BadInput(f"unknown --vlm method(s) {', '.join(bad)}; known: ar, {', '.join(POLICIES)}")
        methods = ["ar", *(m for m in POLICIES if m in want)]
    return budget, ratios, methods


def _run(args, argv: list[str] | None, scratch: str) -> int:
    from configs import provenance
    from sage_jax.bench.run import provenance as record_of

    budget, ratios, methods = settings(args)
    engine, prompts, title, labels = build(args, scratch)
    if not prompts:
        raise cli.BadInput("no prompts: give --image / --video, or --prompts > 0")
    record = record_of(argv, draft_path(args))
    out = {"title": title, "machine": provenance.machine(record), "provenance": record, "methods": {}, "sweep": []}
    for m in tqdm(methods, desc="policies", disable=args.no_progress):
        out["methods"][m] = _measure(engine, prompts, m, None if m == "ar" else budget, args.max_new_tokens)
    ar = out["methods"]["ar"]
    for r in tqdm(ratios, desc="pruning ratios", disable=args.no_progress):
        row = _measure(engine, prompts, "sage", budget, args.max_new_tokens, ratio=r)
        pre = [engine.time_prefill([q], images=[im], videos=[vi], prune_ratio=r, max_new_tokens=args.max_new_tokens)
               for q, im, vi in prompts]
        row.update(ratio=r, target_prefill_seconds=sum(p["target_prefill_seconds"] for p in pre),
                   draft_prefill_seconds=sum(p["draft_prefill_seconds"] for p in pre),
                   draft_prefill_gflops=sum(p["draft_prefill_flops"] for p in pre) / 1e9,
                   draft_prompt_tokens=sum(p["draft_prompt_tokens"] for p in pre),
                   prompt_tokens=sum(p["prompt_tokens"] for p in pre))
        out["sweep"].append(row)
    same = lambda m: all(a["tokens"] == b["tokens"] for a, b in zip(m["runs"], ar["runs"]))  # noqa: E731
    t1 = _table(["method", "tok/s", "vs AR", "τ", "τ+1", "same as AR"],
                [[m, f"{v['tokens_per_second']:.1f}", f"{v['tokens_per_second'] / ar['tokens_per_second']:.2f}x",
                  f"{v['tau']:.2f}", f"{v['tau_plus_1']:.2f}", "yes" if same(v) else "NO"]
                 for m, v in out["methods"].items()])
    t2 = _table(["pruning ratio", "draft prompt tokens", "τ", "τ+1", "tok/s", "vs AR", "target prefill s",
                 "draft prefill s", "draft prefill GFLOP", "same as AR"],
                [[f"{v['ratio']:g}", f"{v['draft_prompt_tokens']} / {v['prompt_tokens']}", f"{v['tau']:.2f}",
                  f"{v['tau_plus_1']:.2f}", f"{v['tokens_per_second']:.1f}",
                  f"{v['tokens_per_second'] / ar['tokens_per_second']:.2f}x", f"{v['target_prefill_seconds']:.4f}",
                  f"{v['draft_prefill_seconds']:.4f}", f"{v['draft_prefill_gflops']:.3f}", "yes" if same(v) else "NO"]
                 for v in out["sweep"]])
    for v in [*out["methods"].values(), *out["sweep"]]:
        v["same_as_ar"] = same(v)
    named = ""
    if labels is not None:  # the held-out classes: does the (lossless, so every row's) answer name them?
        from sage_jax.training import vlm_data

        texts = [engine.tokenizer.decode(r["tokens"], skip_special_tokens=True) for r in ar["runs"]]
        if np.ndim(labels) == 2:  # clips: exactly their items
            right = sum(vlm_data.classes_named(t) == {int(k) for k in y} for t, y in zip(texts, labels, strict=True))
            named = f"\nThe answers name exactly the clip's items for {right} of {len(texts)} held-out clips.\n"
        else:
            right = sum(vlm_data.class_named(t) == int(y) for t, y in zip(texts, labels, strict=True))
            named = f"\nThe answers name the right class for {right} of {len(texts)} held-out images.\n"
        out["heldout"] = {"right": int(right), "n": len(texts), "answers": texts}
    for v in [*out["methods"].values(), *out["sweep"]]:
        v.pop("runs")
    out["args"] = {k: v for k, v in vars(args).items() if k not in ("image", "video")}
    out["time"] = time.strftime("%Y-%m-%d %H:%M:%S")
    with cli.written(os.path.join(args.out, "vlm_bench.json")) as f:
        json.dump(out, f, indent=1)
    png = _plot(out, os.path.join(args.out, "vlm_pruning.png"))
    cli.end_outputs(args.out, ["vlm_bench.json", png])
    print(f"\n{title}\n{out['machine']}\n\n{t1}\n{named}\nDraft visual-token pruning (SAGE):\n\n{t2}\n")
    print(f"wrote {os.path.join(args.out, 'vlm_bench.json')} and {png}", file=sys.stderr)
    return 0


def _plot(out: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sw = out["sweep"]
    r = [v["ratio"] for v in sw]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(r, [v["tau"] for v in sw], "o-", label="τ (accepted per step)")
    a.set_xlabel("draft visual-token pruning ratio")
    a.set_ylabel("τ")
    a2 = a.twinx()
    a2.plot(r, [v["tokens_per_second"] for v in sw], "s--", color="tab:orange", label="tokens/s")
    a2.set_ylabel("tokens/s")
    a.set_title("acceptance and speed")
    b.plot(r, [v["draft_prefill_seconds"] * 1e3 for v in sw], "o-", label="draft prefill")
    b.plot(r, [v["target_prefill_seconds"] * 1e3 for v in sw], "s--", label="target prefill")
    b.set_xlabel("draft visual-token pruning ratio")
    b.set_ylabel("ms (summed over prompts)")
    b.set_title("prefill time")
    b.legend()
    fig.suptitle(out["title"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
