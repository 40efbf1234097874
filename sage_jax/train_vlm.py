"""`python -m sage_jax.train_vlm --config NAME_OR_FILE [--workdir DIR] [--set key=value ...]`

Trains the home-trained vision-language model of a recipe (`configs/sage/<name>.py`, or any .py file whose
`get_config()` returns the ConfigDict of a `sage_jax.training.vlm_recipe.VLMRecipe`, kind "vlm"): a LLaVA-OneVision
tower and projector around the shipped SmolLM2-135M-Instruct, on images that ship offline
(`sage_jax/training/vlm_stages.py` for the stages and the work-directory layout). Rerunning resumes. Writes
WORKDIR/vlm (load it with `--target WORKDIR/vlm`), WORKDIR/loss.png and WORKDIR/summary.json. A recipe of kind
"vlm_draft" (`DraftVLMRecipe`, e.g. `smollm2_vlm_draft`) trains a separate draft VLM for it instead
(`sage_jax/training/vlm_draft.py`), written to WORKDIR/vlm_draft (`--draft WORKDIR/vlm_draft`). Bad input: one line
`error: ...` on stderr, exit code 2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

from configs import cli


def _main(argv: list[str] | None) -> int:
    p = cli.Parser(prog="python -m sage_jax.train_vlm", description=__doc__.split("\n\n")[1])
    p.add_argument("--config", required=True, help="a recipe name under configs/sage, or a .py file")
    p.add_argument("--workdir", default=None, help="output directory (default: runs/<config name>)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set align.steps=10 (repeatable)")
    p.add_argument("--heldout", type=cli.integer(1, 10_000), default=100, metavar="N",
                   help="held-out Fashion-MNIST test images answered at the end (default 100)")
    p.add_argument("--restart", action="store_true",
                   help="empty WORKDIR and start over (a rerun with other settings is refused without it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    missing = [name for name, mod in (("scikit-learn", "sklearn"), ("scikit-image", "skimage"))
               if importlib.util.find_spec(mod) is None]
    if missing:
        raise cli.BadInput(f"training the home VLM reads {' and '.join(missing)} (digits, photos): "
                           "pip install -e '.[vlm-train]'")
    from sage_jax.training.vlm_recipe import DraftVLMRecipe, VLMRecipe

    recipe = cli.load_config(args.config, "configs.sage", (VLMRecipe, DraftVLMRecipe), overrides=args.set)
    workdir = args.workdir or os.path.join("runs", cli.config_name(args.config))
    cli.work_folder(workdir)
    from sage_jax.io.loader import cache_dir
    from sage_jax.training import vlm_draft, vlm_stages

    cli.use_compilation_cache(os.path.join(cache_dir(), "jax"))
    stages = [k for k, v in recipe.to_json().items() if isinstance(v, dict) and "steps" in v]
    cli.settled(workdir, {"recipe": recipe.to_json()}, restart=args.restart,
                free=[f"recipe.{s}.{f}" for s in stages for f in ("steps", "ckpt_every", "eval_every")])
    with cli.reported(ValueError, FileNotFoundError):
        if isinstance(recipe, DraftVLMRecipe):
            summary = vlm_draft.run(recipe, workdir, progress=not args.no_progress)
        else:
            summary = vlm_stages.run(recipe, workdir, progress=not args.no_progress, heldout=args.heldout)
    print(json.dumps(summary, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv, resumable=True)


if __name__ == "__main__":
    sys.exit(main())
