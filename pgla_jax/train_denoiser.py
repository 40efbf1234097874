"""`python -m pgla_jax.train_denoiser`: build the clean surrogate-gradient data set, then train the gradient diffusion
model (resumable: rerun the same command to continue). Writes WORKDIR/gradients/, WORKDIR/state/, the final
checkpoint WORKDIR/denoiser/ and the DnCNN baseline WORKDIR/dncnn/; then
`python -m pgla_jax.attack --denoiser WORKDIR/denoiser`.

Bad input (unknown config, an unusable --steps or --workdir, a state written by another config) → one line on
stderr and exit code 2.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import time

from pgla_jax.attack import EXIT_USAGE, UsageError, _Parser


def load_config(spec: str):
    try:
        module = importlib.import_module(f"configs.pgla.{spec}")
    except ModuleNotFoundError:
        raise UsageError(f"unknown config {spec!r} (no configs/pgla/{spec}.py)") from None
    cfg = module.get_config() if hasattr(module, "get_config") else None
    from pgla_jax.config import DenoiserConfig

    if not isinstance(cfg, DenoiserConfig):
        raise UsageError(f"config {spec!r} does not define a DenoiserConfig")
    return cfg


def main(argv=None) -> int:
    p = _Parser(prog="python -m pgla_jax.train_denoiser", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="denoiser_lenet", help="configs/pgla/<name> returning a DenoiserConfig")
    p.add_argument("--workdir", required=True, help="folder for the data set, the training state and the result")
    p.add_argument("--data-dir", help="gradient data set folder (default WORKDIR/gradients)")
    p.add_argument("--steps", type=int, help="override the number of training steps (a new schedule: new workdir)")
    p.add_argument("--max-steps", type=int, help="stop after this many steps of the configured schedule")
    p.add_argument("--extend", action="store_true",
                   help="go on from WORKDIR's saved state to more --steps (a warm restart of the schedule)")
    try:
        args = p.parse_args(sys.argv[1:] if argv is None else argv)
        cfg = load_config(args.config)
        if args.steps is not None:
            if args.steps < 1:
                raise UsageError(f"--steps must be ≥ 1, got {args.steps}")
            cfg = dataclasses.replace(cfg, steps=args.steps)
        if args.extend and args.steps is None:
            raise UsageError("--extend needs --steps (the new total)")
        if args.max_steps is not None and args.max_steps < 1:
            raise UsageError(f"--max-steps must be ≥ 1, got {args.max_steps}")
        if os.path.exists(args.workdir) and not os.path.isdir(args.workdir):
            raise UsageError(f"--workdir {args.workdir} exists and is not a folder")
        data_dir = args.data_dir or os.path.join(args.workdir, "gradients")

        from tqdm import tqdm

        from configs.checkpoint import CheckpointError
        from pgla_jax.data import DataError
        from pgla_jax.denoise import dncnn, gradients, train

        t0 = time.time()
        try:
            with tqdm(total=cfg.gradients.steps, desc="surrogate gradients", file=sys.stderr) as bar:
                gradients.build(cfg.gradients, data_dir, progress=bar.update)
            stop = cfg.steps if args.max_steps is None else min(cfg.steps, args.max_steps)
            start = min(train.saved_step(args.workdir), stop)  # a resumed run's bar starts where it left off
            with tqdm(total=stop, initial=start, desc="denoiser", file=sys.stderr) as bar:

                def progress(loss):
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.4f}")

                out = train.train(cfg, data_dir, args.workdir, progress=progress, max_steps=args.max_steps,
                                  extend=args.extend)
            if cfg.dncnn_steps and not os.path.isdir(os.path.join(args.workdir, "dncnn")):
                with tqdm(total=cfg.dncnn_steps, desc="DnCNN baseline", file=sys.stderr) as bar:

                    def progress_dncnn(loss):
                        bar.update(1)
                        bar.set_postfix(loss=f"{loss:.4f}")

                    dncnn.train(cfg, data_dir, args.workdir, progress=progress_dncnn)
        except (DataError, CheckpointError, ValueError) as e:
            raise UsageError(str(e)) from None
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"denoiser checkpoint: {out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
