"""`python -m sage_jax.generate`: answer one chat prompt with a target LM and a draft, then print statistics.

    python -m sage_jax.generate [--target SPEC] [--draft SPEC | --draft-layers N] [--prompt TEXT] [--image PATH]...
        [--policy {ar,chain,static,eagle2,sage}] [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]
        [--seed S] [--attention {xla,pallas}] [--compare] [--json]

SPEC is a GGUF file, an HF directory or a sage-jax checkpoint; the default target is the shipped SmolLM2-135M-Instruct
and its default draft the EAGLE-style head shipped for it (`sage_jax/assets/smollm2_eagle`, trained by
`configs/sage/smollm2_eagle_chat2.py`); other targets default to a self-draft of their first 10 layers.
`--json` prints exactly one JSON object on stdout (design.md).
Bad input: one line `error: ...` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from sage_jax.decoding.policies import POLICIES

DEFAULT_PROMPT = "What is speculative decoding? Explain it in two sentences."
SELF_DRAFT_LAYERS = 10


class BadInput(Exception):
    """Input the user can fix: reported as one line on stderr with exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + error; the contract is one line
        raise BadInput(message.splitlines()[0] if message else "bad arguments")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = _Parser(prog="python -m sage_jax.generate", description=__doc__.splitlines()[0].split(": ", 1)[1])
    arg = ap.add_argument
    arg("--target", metavar="SPEC", help="GGUF file, HF dir or sage-jax checkpoint (default: SmolLM2-135M-Instruct)")
    arg("--draft", metavar="SPEC", help="a draft LM with the target's vocabulary, or an EAGLE-style head checkpoint "
        "(default: the shipped head for the default target, else a self-draft)")
    arg("--draft-layers", type=int, metavar="N", help=f"self-draft: run the target's first N layers as the draft "
        f"(default {SELF_DRAFT_LAYERS} when there is no other draft)")
    arg("--prompt", metavar="TEXT", default=DEFAULT_PROMPT, help="user message (chat-templated when possible)")
    arg("--image", metavar="PATH", action="append", default=[], help="image file (repeatable; VLM targets only)")
    arg("--policy", choices=("ar", *POLICIES), default="sage")
    arg("--max-new-tokens", type=int, metavar="N", default=128)
    arg("--temperature", type=float, metavar="T", default=0.0, help="0 = greedy")
    arg("--top-k", type=int, metavar="K", default=0, help="0 = all tokens")
    arg("--top-p", type=float, metavar="P", default=1.0)
    arg("--seed", type=int, metavar="S", default=0)
    arg("--attention", choices=("xla", "pallas"), default="xla")
    arg("--compare", action="store_true", help="also decode with plain AR and report the speedup")
    arg("--json", action="store_true", help="print one JSON object on stdout")
    return ap.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Everything checkable before loading a model."""
    if args.max_new_tokens < 1:
        raise BadInput(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.temperature >= 0.0 or args.temperature == float("inf"):
        raise BadInput(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.top_k < 0:
        raise BadInput(f"--top-k must be >= 0, got {args.top_k}")
    if not 0.0 < args.top_p <= 1.0:
        raise BadInput(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.draft is not None and args.draft_layers is not None:
        raise BadInput("give either --draft or --draft-layers, not both")
    if args.draft_layers is not None and args.draft_layers < 1:
        raise BadInput(f"--draft-layers must be >= 1, got {args.draft_layers}")
    if args.attention == "pallas":
        raise BadInput("the Pallas tree-attention kernel is not available yet (xla only)")
    for spec in filter(None, (args.target, args.draft)):
        if not os.path.exists(spec):
            raise BadInput(f"no such file or directory: {spec}")
    for path in args.image:
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as e:
            raise BadInput(f"cannot read image {path}: {e.strerror or e}") from None
    if args.image:  # every LM `load_lm` reads today is text-only
        raise BadInput(f"--image needs a vision-language target; {args.target or 'the default target'} is text-only")


def capacity(policy: str, prompt_len: int, max_new_tokens: int) -> int:
    """Cache slots the engine will allocate for this run (prompt and output bucketed, plus the tree's slack)."""
    from sage_jax.engine import run_config

    return run_config(policy, prompt_len, max_new_tokens).capacity


def _is_eagle_head(spec: str) -> bool:
    from configs import checkpoint
    from sage_jax.draft.eagle import KIND

    try:
        return checkpoint.read_metadata(spec).get("kind") == KIND
    except checkpoint.CheckpointError:
        return False


def prepare(args: argparse.Namespace):
    """Loads the models and tokenizes the prompt -> (engine, prompt ids, tokenizer, eos ids); BadInput on bad input."""
    from sage_jax import chat
    from sage_jax.decoding.drafts import DraftSpec
    from sage_jax.decoding.sampling import SamplingConfig
    from sage_jax.engine import Engine
    from sage_jax.io import default_target, load_lm
    from sage_jax.io.load import default_draft

    try:
        target_spec = args.target or default_target()
        cfg, target, tok = load_lm(target_spec)
        draft = dcfg = None
        if args.draft is None and args.draft_layers is None:
            args.draft = default_draft() if args.target is None else None
            if args.draft is None:
                args.draft_layers = SELF_DRAFT_LAYERS
        if args.draft and _is_eagle_head(args.draft):
            draft = args.draft  # the Engine loads an EAGLE-style head checkpoint for this target
        elif args.draft:
            dcfg, draft, _ = load_lm(args.draft)
    except (OSError, ValueError) as e:
        raise BadInput((str(e).splitlines() or [type(e).__name__])[0]) from None
    if tok is None:
        raise BadInput(f"{target_spec} has no tokenizer")
    if dcfg is not None and dcfg.vocab_size != cfg.vocab_size:
        raise BadInput(f"draft vocabulary ({dcfg.vocab_size}) != target vocabulary ({cfg.vocab_size})")
    if draft is None and args.draft_layers > cfg.n_layers:
        raise BadInput(f"--draft-layers {args.draft_layers} > the target's {cfg.n_layers} layers")
    ids = chat.prompt_ids(tok, args.prompt)
    if not ids:
        raise BadInput("the prompt is empty")
    for policy in {args.policy, "ar"} if args.compare else {args.policy}:
        need = capacity(policy, len(ids), args.max_new_tokens)
        if need > cfg.max_position:
            raise BadInput(f"prompt ({len(ids)} tokens) + --max-new-tokens {args.max_new_tokens} need {need} cache "
                           f"slots with policy {policy}, more than the target's context ({cfg.max_position})")
    draft_spec = None if draft is not None else DraftSpec(kind="self", n_layers=args.draft_layers)
    try:
        engine = Engine(target, draft, draft_spec=draft_spec,
                        sampling=SamplingConfig(top_k=args.top_k, top_p=args.top_p))
    except (OSError, ValueError) as e:  # e.g. a head trained for another target
        raise BadInput((str(e).splitlines() or [type(e).__name__])[0]) from None
    print(f"target {target_spec}, draft {args.draft or f'self ({args.draft_layers} layers)'}", file=sys.stderr)
    return engine, ids, tok, cfg.eos_token_ids


def run(args: argparse.Namespace) -> dict:
    """Generates per `args`; the result is the `--json` object."""
    from sage_jax import chat

    engine, ids, tok, eos = prepare(args)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    print(f"generating with policy {args.policy} ({len(ids)} prompt tokens; the first run compiles)", file=sys.stderr)
    gen = engine.generate([ids], policy=args.policy, **kw)
    out = {"text": chat.decode(tok, gen.token_ids[0], eos), "token_ids": gen.token_ids[0], "policy": gen.policy,
           "stats": gen.stats.to_json()}
    if args.compare:
        print("generating with policy ar for --compare", file=sys.stderr)
        base = engine.generate([ids], policy="ar", **kw)
        b_tps, tps = base.stats.tokens_per_second, gen.stats.tokens_per_second
        out["compare"] = {"policy": "ar", "token_ids": base.token_ids[0], "tokens_per_second": b_tps,
                          "speedup": tps / b_tps if b_tps > 0 else None,
                          "identical": base.token_ids[0] == gen.token_ids[0], "stats": base.stats.to_json()}
    return out


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


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)  # before the redirect: --help goes to stdout
        with _stdout_to_stderr() as stdout:
            check_args(args)
            import jax

            if not jax.config.jax_compilation_cache_dir:  # repeated runs skip XLA compilation
                from sage_jax.io.load import cache_dir

                jax.config.update("jax_compilation_cache_dir", os.path.join(cache_dir(), "jax"))
            out = run(args)
            stdout.write(json.dumps(out) + "\n" if args.json else report(out))
    except BadInput as e:
        print(f"error: {(str(e).splitlines() or ['bad input'])[0]}", file=sys.stderr)
        return 2
    return 0


def report(out: dict) -> str:
    """The human-readable form of a `run` result: the answer, the stats line, and the --compare line."""
    from sage_jax.engine import Stats

    lines = [out["text"], Stats(**out["stats"]).summary()]
    if "compare" in out:
        c = out["compare"]
        ratio = f"{c['speedup']:.2f}x" if c["speedup"] else "n/a"
        lines.append(f"compare: {out['policy']} {out['stats']['tokens_per_second']:.1f} tok/s vs ar "
                     f"{c['tokens_per_second']:.1f} tok/s -> speedup {ratio}"
                     f"{'' if c['identical'] else ' (outputs differ)'}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
