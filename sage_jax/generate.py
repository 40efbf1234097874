"""`python -m sage_jax.generate`: answer one chat prompt with a target LM and a draft, then print statistics.

    python -m sage_jax.generate [--target SPEC] [--draft SPEC | --draft-layers N] [--prompt TEXT]
        [--image PATH ...] [--video PATH ...] [--prune-ratio R[,R_VIDEO]] [--prune {attention,uniform}]
        [--policy {ar,chain,static,eagle2,sage}] [--retrieval L] [--datastore]
        [--budget auto|static|NODES,DEPTH] [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]
        [--seed S] [--attention {xla,pallas}] [--matmul {auto,xla,exact}] [--mesh AXIS=SIZE,...] [--compare] [--json]

SPEC is a GGUF file, an HF directory or a sage-jax checkpoint; the default target is the shipped SmolLM2-135M-Instruct
and its default draft the EAGLE-style head shipped for it (`sage_jax/assets/smollm2_eagle`); other targets default
to a self-draft of their first third of layers. `--budget auto` (the default) sizes each tree from this device's
measured costs and the draft's acceptance, and decodes plainly where no tree is predicted to pay (as on a 2-core
CPU): the default is never slower than plain decoding. `--json` prints exactly one JSON object on stdout
(design.md). Bad input: one line `error: ...` on stderr and exit code 2.

A vision-language target (Qwen2.5-VL, LLaVA-OneVision: an HF directory or our converted checkpoint) takes
`--image` / `--video` (an animated GIF / WebP, a directory of frames or a .npy array [F, H, W, 3]); its draft is a
smaller VLM of its family (`--draft`), an EAGLE-style head or a self-draft. The target sees every visual token, the
draft a pruned set: `--prune-ratio R` (or `R_IMAGE,R_VIDEO`; default 0.8,0.9 as in the paper, 0 = off) of the
visual tokens are dropped from the draft's prompt, ranked by the target's prefill attention (`--prune uniform`:
evenly spaced).

`--image` without `--target` runs the shipped home-trained VLM (`sage_jax/assets/smollm2_vlm`): a LLaVA-OneVision
whose language model is the default SmolLM2-135M-Instruct and whose small vision tower and projector were trained
here, offline, on Fashion-MNIST, handwritten digits and a few photos (`python -m sage_jax.train_vlm`). Its image
understanding is home-trained and narrow: it names clothes of the ten Fashion-MNIST kinds and digits, and little
else; give `--target` a real Qwen2.5-VL or LLaVA-OneVision directory for real images. Its draft is the shipped draft
VLM (`sage_jax/assets/smollm2_vlm_draft`: its own small tower and SmolLM2's first 2 layers, distilled on its answers).

`--mesh data=1,model=8` places target and draft on a device mesh by the inference rules of `configs/sharding.py`
(here 8-way tensor parallel) and decodes there; in a multi-host job (a TPU pod slice) the same command runs on every
host, `configs.sharding.initialize_distributed` joins them first, the mesh spans every host's devices, and only
process 0 prints.

`--attention pallas` runs the decoding loop's cache-reading forwards (verify, draft levels, catch-up) through the
Pallas tree-attention kernel (`pallas_kernels/tree_attention`: Mosaic on TPU, Triton on GPU; interpreted on CPU,
where it checks the kernel rather than speeding anything up); the output is the same as with `--attention xla`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import numpy as np

from configs import cli
from sage_jax.decoding.policies import POLICIES, TreePolicy
from sage_jax.models.config import MATMULS

DEFAULT_PROMPT = "What is speculative decoding? Explain it in two sentences."
DEFAULT_IMAGE_PROMPT = "What is in this image?"  # with --image: the question the shipped VLM was trained on most
DEFAULT_VIDEO_PROMPT = "Which items appear in this video?"  # with --video alone: the shipped VLM's clip question


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cli.Parser(prog="python -m sage_jax.generate", description=__doc__.splitlines()[0].split(": ", 1)[1])
    arg = ap.add_argument
    arg("--target", metavar="SPEC", help="GGUF file, HF dir or sage-jax checkpoint (default: SmolLM2-135M-Instruct)")
    arg("--draft", metavar="SPEC", help="a draft LM with the target's vocabulary, or an EAGLE-style head checkpoint "
        "(default: the shipped head for the default target, else a self-draft)")
    arg("--draft-layers", type=cli.integer(1, 1000), metavar="N",
        help="self-draft: run the target's first N layers as the draft")
    arg("--prompt", metavar="TEXT", help="user message, chat-templated when possible (default: a question about "
        "speculative decoding; with --image 'What is in this image?', with --video alone 'Which items appear in this "
        "video?')")
    arg("--image", metavar="PATH", action="append", default=[], help="an image for a vision-language target "
        "(repeatable)")
    arg("--video", metavar="PATH", action="append", default=[], help="video frames for a vision-language target: "
        "an animated GIF / WebP, a directory of frames or a .npy array [F, H, W, 3] (repeatable)")
    arg("--prune-ratio", metavar="R", help="share of the visual tokens the draft does not see: one ratio, or image "
        "and video ratios as R_IMAGE,R_VIDEO (default 0.8,0.9; 0 = the draft sees them all)")
    arg("--prune", choices=("attention", "uniform"), default="attention", help="which visual tokens the draft keeps: "
        "those the target's prefill attends to most, or evenly spaced ones")
    arg("--policy", choices=("ar", *POLICIES), default="sage")
    arg("--retrieval", type=cli.integer(0, 1024), metavar="L", default=0,
        help="merge an L-token prompt-lookup chain into every "
        "tree (copy-heavy prompts: rewrite, fix this code; 0 = off, at most the policy's depth cap)")
    arg("--datastore", action="store_true", help="also merge a chain from the draft's datastore of the target's own "
        "answers (`build_datastore`; the shipped head has one); --retrieval L sets its length too (default 8)")
    arg("--budget", default="auto", metavar="B", help="tree size: auto (measured on this device; where no tree pays, "
        "plain decoding, or with --retrieval the chain verified alone while it keeps being right), static (the "
        "policy's full tree) or NODES,DEPTH")
    arg("--max-new-tokens", type=cli.integer(1, cli.MAX_TOKENS), metavar="N", default=128)
    arg("--temperature", type=cli.number(0.0), metavar="T", default=0.0, help="0 = greedy")
    arg("--top-k", type=cli.integer(0, cli.SEED_MAX), metavar="K", default=0, help="0 = all tokens")
    arg("--top-p", type=cli.number(0.0, 1.0), metavar="P", default=1.0)
    arg("--seed", type=cli.integer(0, cli.SEED_MAX), metavar="S", default=0)
    arg("--attention", choices=("xla", "pallas"), default="xla", help="attention of the decoding loop's forwards: "
        "XLA einsums over a dense mask, or the Pallas tree-attention kernel (head dims 64 / 128; interpreted on CPU)")
    arg("--matmul", choices=MATMULS, default="auto", help="the models' matmuls: auto (on CPU, the few rows "
        "of a decode or verify step through the skinny kernel, cpu_kernels/skinny_matmul), XLA's dot throughout, or "
        "exact: the shape-invariant mode, in which speculative decoding equals plain decoding bit for bit in any "
        "dtype (a row's bits never depend on how many rows a forward holds; costs speed: README, Exactness)")
    arg("--dtype", choices=("float32", "bfloat16"), help="weights, activations and KV caches of target and draft "
        "(default: as stored; bfloat16 keeps norms, RoPE, attention scores and logits in float32). In bfloat16, "
        "and on accelerators, a verify forward can round a near-tie differently from a one-token step, so the "
        "text may differ from plain decoding's unless --matmul exact (README, Exactness)")
    arg("--mesh", type=cli.mesh_axes, metavar="AXIS=SIZE,...", help="place the models on a device mesh over every "
        "device (of every host), e.g. data=1,model=8 (axes data, fsdp, model; -1 = the devices left over); default: "
        "one device")
    arg("--compare", action="store_true",
        help="also decode with plain AR and report the speedup (both run twice, the second runs timed)")
    arg("--json", action="store_true", help="print one JSON object on stdout")
    return ap.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Everything checkable before loading a model."""
    if args.prompt is not None:
        try:  # bytes that are not UTF-8 reach argv as lone surrogates (Python's surrogateescape)
            args.prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise cli.BadInput("--prompt is not valid UTF-8 text") from None
        if not args.prompt.strip():
            raise cli.BadInput("--prompt is empty")
    # Numbers are range-checked by their flags' types (`cli.integer`, `cli.number`); top-p excludes 0 besides.
    if args.top_p == 0.0:
        raise cli.BadInput(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.draft is not None and args.draft_layers is not None:
        raise cli.BadInput("give either --draft or --draft-layers, not both")
    if args.datastore and not args.retrieval:
        args.retrieval = 8
    if args.retrieval:
        if args.policy == "ar":
            flag = "--datastore" if args.datastore else "--retrieval"
            raise cli.BadInput(f"{flag} needs a tree policy, not --policy ar")
        try:
            args.policy_obj = TreePolicy.named(args.policy, retrieval=args.retrieval, datastore=args.datastore)
        except ValueError as e:
            raise cli.BadInput(f"--retrieval: {e}") from None
    from sage_jax.decoding import budget

    try:
        args.budget = budget.parse(args.budget)
    except ValueError as e:
        raise cli.BadInput(f"--budget: {e}") from None
    for spec in filter(None, (args.target, args.draft)):
        if not os.path.exists(spec):
            raise cli.BadInput(f"no such file or directory: {spec}")
    args.prune_ratio = _prune_ratio(args.prune_ratio)
    from sage_jax.io import images

    with cli.reported(OSError, ValueError):  # read now: a bad file fails before any model loads
        args.images = [images.load_image(p) for p in args.image]
        args.videos = [images.load_frames(p) for p in args.video]


def _prune_ratio(text: str | None) -> tuple[float, float]:
    from sage_jax.decoding.visual_pruning import DEFAULT_RATIOS

    if text is None:
        return DEFAULT_RATIOS
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or not all(0.0 <= x <= 1.0 for x in parts):
        raise cli.BadInput(f"--prune-ratio must be one ratio in [0, 1] or two as R_IMAGE,R_VIDEO, got {text!r}")
    return (parts[0], parts[-1])


def run(args: argparse.Namespace) -> dict:
    """Loads, generates per `args`; the result is the `--json` object."""
    from sage_jax import executables
    from sage_jax.decoding.sampling import SamplingConfig
    from sage_jax.engine import load_engine
    from sage_jax.io.loader import cache_dir, is_vision_lm

    if args.prompt is None:
        args.prompt = (DEFAULT_IMAGE_PROMPT if args.images else DEFAULT_VIDEO_PROMPT if args.videos
                       else DEFAULT_PROMPT)
    with cli.reported(OSError, ValueError):
        if args.target is None and (args.images or args.videos):
            from sage_jax.io.loader import default_vlm

            args.target = args.default_vlm = default_vlm()
        vision = args.target is not None and is_vision_lm(args.target)
    if not vision and (args.images or args.videos):
        raise cli.BadInput(f"--image / --video need a vision-language target (Qwen2.5-VL or LLaVA-OneVision); "
                           f"{args.target or 'the default target'} is a text LM")
    mesh = cli.make_mesh(args.mesh) if args.mesh else None
    store = None
    if mesh is None:  # later runs load the compiled loops instead of tracing them, this one's while it reads weights
        store = executables.Store(os.path.join(cache_dir(), "executables"))
        store.prefetch(_settings(args), setup=_kernel_setup(args.matmul))
    with cli.reported(OSError, ValueError):  # a bad file, or a draft that does not fit the target
        engine = load_engine(args.target, args.draft, args.draft_layers,
                             sampling=SamplingConfig(top_k=args.top_k, top_p=args.top_p),
                             prune_ratio=args.prune_ratio, prune=args.prune, attention=args.attention,
                             matmul=args.matmul, mesh=mesh, dtype=args.dtype)
        if engine.tokenizer is None:
            raise cli.BadInput(f"{args.target} has no tokenizer")
        engine.fit_budget = True  # one request: compile the loop at the budget --budget auto picks, no larger
        engine.executables = store
        if args.datastore and engine.datastore is None:
            raise cli.BadInput(f"--datastore: the draft ({engine.description}) has no datastore.npz "
                               f"(python -m sage_jax.build_datastore --out DRAFT_DIR makes one)")
        if vision:  # the processor outputs: a video on an image-only model or an image it refuses fails here
            prompt = engine.vision.inputs(args.prompt, images=args.images, videos=args.videos)
            ids = [int(t) for t in prompt["input_ids"][0]]
            kinds = np.isin(ids, [engine.vision.config.image_token_id, engine.vision.config.video_token_id or -1])
            visual = int(kinds.sum())
        else:
            prompt = ids = engine.encode(args.prompt)
            visual = 0
        policy = getattr(args, "policy_obj", None) or args.policy
        for p in [policy, "ar"] if args.compare else [policy]:
            engine.check_fits(len(ids), args.max_new_tokens, p, visual)
        if isinstance(args.budget, tuple) and args.policy != "ar":
            pol = TreePolicy.named(args.policy)
            if args.budget[0] > pol.n_max or args.budget[1] > pol.d_cap:
                raise ValueError(f"--budget {args.budget[0]},{args.budget[1]} exceeds the {args.policy} tree "
                                 f"({pol.n_max} nodes, depth {pol.d_cap})")
    name = ("SmolLM2-135M-Instruct with the shipped home-trained vision tower" if getattr(args, "default_vlm", None)
            else args.target or "SmolLM2-135M-Instruct (shipped)")
    _note(f"target {name}, draft {engine.description}{', Pallas tree attention' if args.attention == 'pallas' else ''}"
          f"{f', on the mesh {dict(mesh.shape)}' if mesh is not None else ''}")
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    of = f", {visual} of them visual" if visual else ""
    _note(f"generating with policy {args.policy} ({len(ids)} prompt tokens{of}; the first run compiles"
          f"{', and measures this device for --budget auto' if args.budget == 'auto' else ''})")
    gen = engine.generate([prompt], policy=policy, budget=args.budget, **kw)
    if gen.stats.budget == (0, 0):
        _note(f"--budget auto: no {args.policy} tree is predicted to pay on this device; decoded plainly")
    out = {"text": gen.text[0], "token_ids": gen.token_ids[0], "policy": gen.policy, "stats": gen.stats.to_json()}
    if args.compare:
        # A program's first execution in a process pays one-time costs (tens of ms, the whole difference on a short
        # answer), so each side runs again and the second runs are compared: the first one timed is otherwise
        # penalised (plain AR against itself read 0.83x).
        _note("generating with policy ar for --compare, then both again to time them warm")
        base = engine.generate([prompt], policy="ar", **kw)
        # The second run keeps the first one's choice (`--budget auto`, having measured the first, may choose another
        # tree, or plain decoding, whose program would compile now): the same program, which compiles nothing.
        budget = gen.stats.budget if args.budget == "auto" and gen.stats.budget is not None else args.budget
        again = (engine.generate([prompt], policy="ar", **kw) if budget == (0, 0)
                 else engine.generate([prompt], policy=policy, budget=budget, **kw))
        base_again = engine.generate([prompt], policy="ar", **kw)
        b_tps, tps = base_again.stats.tokens_per_second, again.stats.tokens_per_second
        out["compare"] = {"policy": "ar", "token_ids": base.token_ids[0], "tokens_per_second": b_tps,
                          "policy_tokens_per_second": tps, "speedup": tps / b_tps if b_tps > 0 else None,
                          "identical": base.token_ids[0] == gen.token_ids[0] == again.token_ids[0],
                          "stats": base_again.stats.to_json(), "policy_stats": again.stats.to_json()}
    return out


def _settings(args: argparse.Namespace) -> str:
    """What decides the compiled loops of a run, less the prompt's words and images (whose lengths may, within a
    bucket, not): the key of the loops `executables.Store.prefetch` loads ahead."""
    skip = {"prompt", "images", "videos", "seed", "temperature", "json", "policy_obj"}
    media = (len(args.images or ()), len(args.videos or ()))
    return repr((sorted((k, repr(v)) for k, v in vars(args).items() if k not in skip), media))


def _kernel_setup(matmul: str):
    """What a stored loop needs registered before it loads: the skinny CPU kernel where `--matmul auto` uses it."""
    def setup() -> None:
        import jax

        from cpu_kernels import skinny_matmul

        if matmul == "auto" and jax.default_backend() == "cpu":
            skinny_matmul.prepare()

    return setup


def _note(message: str) -> None:
    """A progress line on stderr, from one process of a multi-host job."""
    from configs import sharding

    if sharding.is_primary():
        print(message, file=sys.stderr)


@contextlib.contextmanager
def _stdout_to_stderr():
    """Sends everything written to fd 1 (library prints, C++ logs) to stderr; yields a writer for the real stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with os.fdopen(os.dup(saved), "w") as real:
            yield real
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def report(out: dict) -> str:
    """The human-readable form of a `run` result: the answer, the stats line, and the --compare line."""
    from sage_jax.engine import Stats

    lines = [out["text"], Stats(**out["stats"]).summary()]
    if "compare" in out:
        c = out["compare"]
        ratio = f"{c['speedup']:.2f}x" if c["speedup"] else "n/a"
        lines.append(f"compare (second runs): {out['policy']} {c['policy_tokens_per_second']:.1f} tok/s vs ar "
                     f"{c['tokens_per_second']:.1f} tok/s -> speedup {ratio}"
                     f"{'' if c['identical'] else ' (outputs differ)'}")
    return "\n".join(lines) + "\n"


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)  # before the redirect: --help goes to stdout
    with _stdout_to_stderr() as stdout:
        check_args(args)
        from configs import sharding
        from sage_jax.io.loader import cache_dir

        sharding.initialize_distributed()  # a multi-host job: before anything touches a device
        cli.use_compilation_cache(os.path.join(cache_dir(), "jax"))  # repeated runs skip XLA compilation
        out = run(args)
        if sharding.is_primary():  # every host has the same result; one prints it
            stdout.write(json.dumps(out) + "\n" if args.json else report(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
