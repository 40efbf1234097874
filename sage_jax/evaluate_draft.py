"""`python -m sage_jax.evaluate_draft`: a draft's acceptance on the held-out chat prompts, decoded for real.

    python -m sage_jax.evaluate_draft [--target SPEC] [--draft SPEC | --draft-layers N]
        [--policies sage,eagle2,static,chain] [--max-new-tokens 128] [--prompts N] [--batch B] [--out results.json]
        [--write-prior] [--vlm] [--retrieval L] [--datastore [DIR]] [--prompt-set SET]

Greedy AR, then each policy with the draft, on the held-out prompts of `sage_jax/prompts.py` (`bench/acceptance.py`;
by default `EVAL_PROMPTS`, dev prompts, the ones the priors come from; `--prompt-set` takes a split, e.g. test-chat):
τ+1, its per-prompt spread, identity to AR and decode tokens/s. `--write-prior` stores each policy's acceptance
statistics in the draft checkpoint (`acceptance.json`), the prior of `--budget auto`. `--vlm`: the shipped
home-trained VLM and its draft (or `--draft`) on Fashion-MNIST dev images (train rows no stage trains on; `bench
--vlm` asks about test ones), with the bench's questions in turn. `--retrieval L` merges an L-token prompt-lookup chain
into every tree policy's trees (every chain, ungated: what they add to acceptance, where `TreePolicy.retrieval_gate`
is tuned for speed); `--datastore` also one from a datastore of the target's answers (the draft checkpoint's
datastore.npz, or DIR's; `python -m sage_jax.build_datastore`). Bad input: one line `error: ...`, exit code 2.
"""

from __future__ import annotations

import json
import os
import sys

from configs import cli, provenance
from sage_jax.decoding.policies import POLICIES, TreePolicy
from sage_jax.prompts import EVAL_PROMPTS, SETS, prompt_set

# `--vlm` asks about Fashion-MNIST dev images (a prior is a setting); `bench --vlm` asks about test ones.
VLM_IMAGES = 100


def _main(argv: list[str] | None) -> int:
    ap = cli.Parser(prog="python -m sage_jax.evaluate_draft", description=__doc__.splitlines()[0].split(": ", 1)[1])
    ap.add_argument("--target", metavar="SPEC", help="target LM (default: the shipped SmolLM2-135M-Instruct)")
    ap.add_argument("--draft", metavar="SPEC", help="EAGLE head or LM draft (default: the shipped head)")
    ap.add_argument("--draft-layers", type=cli.integer(1, 1000), metavar="N",
                    help="self-draft with the target's first N layers")
    ap.add_argument("--policies", default="sage,eagle2,static,chain")
    ap.add_argument("--max-new-tokens", type=cli.integer(1, cli.MAX_TOKENS), default=128)
    ap.add_argument("--prompts", type=cli.integer(1, 10**6), help="the first N prompts (default: all of the set)")
    ap.add_argument("--prompt-set", choices=SETS, help="a split of sage_jax/prompts.py instead of the 24 dev "
                    "acceptance prompts (EVAL_PROMPTS)")
    ap.add_argument("--batch", type=cli.integer(1, 4096), default=1, help="prompts per request: faster, but the "
                    "prior's depth histogram then reads only the first row of each (its τ trace)")
    ap.add_argument("--out", metavar="JSON", help="write the results here too (with what produced them)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing --out")
    ap.add_argument("--write-prior", action="store_true",
                    help="store the acceptance statistics in the draft checkpoint (the prior of --budget auto)")
    ap.add_argument("--vlm", action="store_true",
                    help="the shipped VLM on Fashion-MNIST dev images (the prompts: images)")
    ap.add_argument("--retrieval", type=cli.integer(0, 1024), default=0, metavar="L",
                    help="merge an L-token prompt-lookup chain into every tree (default 0: none; with --datastore "
                         "8, or the smallest depth cap of the policies)")
    ap.add_argument("--datastore", nargs="?", const="", default=None, metavar="DIR",
                    help="also merge a chain from the target's answers: the draft checkpoint's datastore, or DIR's")
    args = ap.parse_args(argv)
    if args.out:
        cli.output_file(args.out, "--out", args.force)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise cli.BadInput(f"--policies: unknown {bad or args.policies!r}; choose from {', '.join(POLICIES)}")
    if args.datastore is not None and not args.retrieval:  # 8, or the shallowest policy's depth cap
        args.retrieval = min(8, *(TreePolicy.named(p).d_cap for p in policies))
    # Every chain merged (gate 0): what the chains can add to acceptance, not the speed-tuned default gate.
    policy_kw = ({"retrieval": args.retrieval, "datastore": args.datastore is not None, "retrieval_gate": 0.0}
                 if args.retrieval else {})
    for name in policies if policy_kw else ():
        try:
            TreePolicy.named(name, **policy_kw)
        except ValueError as e:
            raise cli.BadInput(f"--retrieval with policy {name}: {e}") from None
    if args.vlm and (args.target is not None or args.draft_layers is not None):
        raise cli.BadInput("--vlm evaluates the shipped VLM; give no --target or --draft-layers with it")
    if args.vlm and args.prompt_set:
        raise cli.BadInput("--vlm asks about held-out images; give no --prompt-set with it")
    texts = prompt_set(args.prompt_set) if args.prompt_set else [t for _, t in EVAL_PROMPTS]
    limit = VLM_IMAGES if args.vlm else len(texts)
    args.prompts = limit if args.prompts is None else args.prompts
    if not 1 <= args.prompts <= limit:
        raise cli.BadInput(f"--prompts must be in [1, {limit}]")
    if args.write_prior and args.prompt_set:
        raise cli.BadInput("--write-prior measures the prior on the dev acceptance prompts; give no --prompt-set")
    if args.max_new_tokens < 1 or args.batch < 1:
        raise cli.BadInput("--max-new-tokens and --batch must be >= 1")
    from sage_jax.bench.acceptance import evaluate, table
    from sage_jax.engine import load_engine
    from sage_jax.io import lm_checkpoint, loader

    if args.vlm:
        draft_path = args.draft or loader.default_vlm_draft()
    else:
        draft_path = args.draft or (loader.default_draft() if args.target is None and args.draft_layers is None
                                    else None)
    if args.write_prior and (draft_path is None or lm_checkpoint.kind_of(draft_path) not in lm_checkpoint.DRAFT_KINDS):
        raise cli.BadInput("--write-prior needs a draft checkpoint of ours (--draft CKPT, or the shipped draft)")
    if args.write_prior and policy_kw:
        raise cli.BadInput("--write-prior stores the plain policies' prior; give it no --retrieval or --datastore")

    cli.use_compilation_cache(os.path.join(loader.cache_dir(), "jax"))
    images, source = None, f"{args.prompt_set or 'EVAL_PROMPTS'}[:{args.prompts}]"
    with cli.reported(OSError, ValueError):
        if args.vlm:
            from sage_jax.bench.vlm import heldout_images, heldout_questions

            engine = load_engine(loader.default_vlm(), args.draft)
            pics, _ = heldout_images(args.prompts, split="dev")  # a prior is a setting: chosen on dev
            questions = heldout_questions()
            ids = [questions[i % len(questions)] for i in range(args.prompts)]
            images = [[p] for p in pics]
            source = f"Fashion-MNIST dev images 0 to {args.prompts - 1} (vlm_data.heldout_indices(n, 'dev'))"
        else:
            engine = load_engine(args.target, args.draft, args.draft_layers)
            ids = [engine.encode(text) for text in texts[: args.prompts]]
            for policy in ("ar", *policies):
                engine.check_fits(max(map(len, ids)), args.max_new_tokens, policy)
        if args.datastore:
            from sage_jax.decoding import datastore

            engine.datastore = datastore.load(args.datastore)
            if engine.datastore is None:
                raise cli.BadInput(f"--datastore: {args.datastore} holds no {datastore.FILE}")
        if args.datastore is not None and engine.datastore is None:
            raise cli.BadInput("--datastore: the draft has no datastore.npz; give its directory (--datastore DIR)")
    # What produced the results (commit, command, the draft's sha256, CPU), taken as the run starts.
    record = provenance.record("python -m sage_jax.evaluate_draft", argv, {"draft": draft_path})
    res = evaluate(engine, ids, policies, args.max_new_tokens, batch=args.batch, images=images, policy_kw=policy_kw)
    print(table(res))
    if args.out:
        with cli.written(args.out) as f:
            json.dump({"provenance": record, "prompts": source, "draft": engine.description, "results": res}, f,
                      indent=1)
    if args.write_prior:
        prior = {"prompts": source, "max_new_tokens": args.max_new_tokens,
                 "batch": args.batch, "policies": {p: res[p]["acceptance"] for p in policies}}
        print(f"wrote {lm_checkpoint.write_acceptance(draft_path, prior)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
