"""`python -m sage_jax.train_draft --config NAME_OR_FILE[:ARG] [--workdir DIR] [--set key=value ...]`

Builds self-distillation data with the target and trains the drafts of a recipe (`configs/sage/<name>.py`, or any
.py file whose `get_config([ARG])` returns the ConfigDict of a `sage_jax.training.recipe.DraftRecipe`, kind "draft";
an EAGLE head and/or a small LM); see `sage_jax/training/distillation.py` for the work-directory layout. Rerunning
resumes. Bad input: one line `error: ...` on stderr, exit code 2.
"""

from __future__ import annotations

import json
import os
import sys

from configs import cli


def _main(argv: list[str] | None) -> int:
    p = cli.Parser(prog="python -m sage_jax.train_draft", description=__doc__.split("\n\n")[1])
    p.add_argument("--config", required=True, help="a recipe name under configs/sage, or a .py file; NAME:ARG "
                   "calls get_config(ARG), e.g. smollm2_eagle:answers6k")
    p.add_argument("--workdir", default=None, help="output directory (default: runs/<config name>[_ARG])")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set eagle.train.steps=10 (repeatable)")
    p.add_argument("--restart", action="store_true",
                   help="empty WORKDIR and start over (a rerun with other settings is refused without it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument("--export-step", default=None, metavar="N|latest",
                   help="write the EAGLE head of training checkpoint N (or the latest) to WORKDIR/eagle_head_stepN "
                        "and exit (works while the run trains)")
    args = p.parse_args(argv)
    from sage_jax.training.recipe import DraftRecipe

    recipe = cli.load_config(args.config, "configs.sage", DraftRecipe, overrides=args.set)
    workdir = args.workdir or os.path.join("runs", cli.config_name(args.config))
    cli.work_folder(workdir)
    from sage_jax.io.loader import cache_dir
    from sage_jax.training import distillation

    cli.use_compilation_cache(os.path.join(cache_dir(), "jax"))
    if args.export_step is not None:
        if args.export_step != "latest" and not args.export_step.isdigit():
            raise cli.BadInput(f"--export-step takes a step number or 'latest', got {args.export_step!r}")
        if args.restart:
            raise cli.BadInput("--export-step exports a step of the run in --workdir; --restart would delete it")
    # The work folder knows its recipe: other data, vocabulary or model settings would mix with (or silently reuse)
    # the work already there, or export a head of one recipe under another's name; a longer schedule resumes.
    cli.settled(workdir, {"recipe": recipe.to_json()}, restart=args.restart,
                free=[f"recipe.{k}.train.{f}" for k in ("eagle", "lm") for f in FREE_TRAIN])
    if args.export_step is not None:
        step = None if args.export_step == "latest" else int(args.export_step)
        with cli.reported(ValueError, FileNotFoundError):
            print(json.dumps({"path": distillation.export_head(recipe, workdir, step)}))
        return 0
    with cli.reported(ValueError, FileNotFoundError):  # e.g. a target path that does not exist
        summary = distillation.run(recipe, workdir, progress=not args.no_progress)
    print(json.dumps(summary, default=str))
    return 0


#: Training fields a rerun may change on the same work folder: the schedule's length and how often it reports.
FREE_TRAIN = ("steps", "eval_every", "ckpt_every", "log_every")


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv, resumable=True)


if __name__ == "__main__":
    sys.exit(main())
