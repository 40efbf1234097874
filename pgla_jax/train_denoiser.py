"""`python -m pgla_jax.train_denoiser`: build the clean surrogate-gradient data set, then train the gradient diffusion
model (resumable: rerun the same command to continue). Writes WORKDIR/gradients/, the training state WORKDIR/state/
(`pgla_jax/denoise/loop.py`), the final checkpoint WORKDIR/denoiser/, the DnCNN baseline WORKDIR/dncnn/ (its state
in WORKDIR/dncnn_state/), the Gaussian prior WORKDIR/prior/ and, where the config trains one (`refiner.steps`), the
prior's learned correction WORKDIR/refiner/ (its own gradients in WORKDIR/refiner_gradients/, its state in
WORKDIR/refiner_state/); then `python -m pgla_jax.attack --denoiser WORKDIR/denoiser`. `--refiner-only` builds the
data, fits the prior and trains the refiner, no U-Net and no DnCNN.

Data-parallel over every device present (`--mesh data=-1`, the default: each batch is cut over the mesh's `data`
axis), on one host or on every host of a multi-host job: run the same command on each host, with WORKDIR one
folder they all see; `configs.sharding.initialize_distributed` joins them first (TPU pods; elsewhere
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), and only process 0 prints.

Bad input (unknown config, an unusable --steps, --mesh or --workdir, a state written by another config) → one line
``error: ...`` on stderr and exit code 2 (`configs.cli`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from configs import cli
from pgla_jax.config import DATASETS, DenoiserConfig, is_dataset_name


def parse(argv):
    p = cli.Parser(prog="python -m pgla_jax.train_denoiser", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="denoiser_lenet",
                   help="configs/pgla/<name> or a .py file whose get_config() returns a DenoiserConfig's ConfigDict")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set unet.width=32 (repeatable; --steps wins over it)")
    p.add_argument("--workdir", required=True, help="folder for the data set, the training state and the result")
    p.add_argument("--data-dir", help="gradient data set folder (default WORKDIR/gradients)")
    p.add_argument("--data", metavar="NAME",
                   help="the surrogate's images (default: the config's, Fashion-MNIST): a data set name of "
                        "`pgla_jax.attack --data`, e.g. tfds:pgla_fashion_mnist")
    p.add_argument("--data-path", help="folder of those images (CIFAR pickles, the tfds data_dir)")
    p.add_argument("--steps", type=cli.integer(1, 10**9),
                   help="override the number of training steps (a new schedule: new workdir)")
    p.add_argument("--max-steps", type=cli.integer(1, 10**9),
                   help="stop after this many steps of the configured schedule")
    p.add_argument("--extend", action="store_true",
                   help="go on from WORKDIR's saved state to more --steps (a warm restart of the schedule)")
    p.add_argument("--prior-only", action="store_true",
                   help="build the data set and fit the Gaussian prior (WORKDIR/prior) only: no U-Net, no DnCNN")
    p.add_argument("--refiner-only", action="store_true",
                   help="the data set, the Gaussian prior and its learned correction (WORKDIR/refiner) only")
    p.add_argument("--mesh", type=cli.mesh_axes, default={"data": -1}, metavar="AXIS=SIZE,...",
                   help="the device mesh (axes data, fsdp, model; -1 = the devices left over), default data=-1: "
                        "data-parallel over every device of every host")
    return p.parse_args(argv)


def build_config(args) -> DenoiserConfig:
    cfg = cli.load_config(args.config, "configs.pgla", DenoiserConfig, overrides=args.set)
    if args.data is not None or args.data_path is not None:
        src = cfg.gradients.data
        if args.data is not None:
            if not is_dataset_name(args.data):
                raise cli.BadInput(f"unknown data set {args.data!r}; expected one of {', '.join(DATASETS)} or "
                                   "tfds:<name>")
            src = dataclasses.replace(src, name=args.data)
        if args.data_path is not None:
            if not os.path.isdir(args.data_path):
                raise cli.BadInput(f"data path {args.data_path} not found")
            src = dataclasses.replace(src, path=args.data_path)
        cfg = dataclasses.replace(cfg, gradients=dataclasses.replace(cfg.gradients, data=src))
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    if args.extend and args.steps is None:
        raise cli.BadInput("--extend needs --steps (the new total)")
    if (args.prior_only or args.refiner_only) and cfg.prior_rank < 1:
        raise cli.BadInput(f"--{'prior' if args.prior_only else 'refiner'}-only needs prior_rank ≥ 1, "
                           f"got {cfg.prior_rank}")
    if args.refiner_only and cfg.refiner.steps < 1:
        raise cli.BadInput(f"--refiner-only needs refiner.steps ≥ 1 (e.g. --set refiner.steps=4000), "
                           f"got {cfg.refiner.steps}")
    if args.prior_only and args.refiner_only:
        raise cli.BadInput("--prior-only and --refiner-only exclude each other")
    if cfg.refiner.steps and cfg.prior_rank and cfg.refiner.gradients.victim != cfg.gradients.victim:
        raise cli.BadInput(f"refiner.gradients.victim {cfg.refiner.gradients.victim} is not the prior's victim "
                           f"gradients.victim {cfg.gradients.victim}; the learned correction works in its eigenbasis")
    cli.work_folder(args.workdir)
    return cfg


def main(argv=None) -> int:
    """Runs the command line (`argv` without the program name; None: sys.argv); returns the exit code."""
    return cli.run(_main, argv, resumable=True)


def _main(argv) -> int:
    args = parse(argv)
    cfg = build_config(args)
    data_dir = args.data_dir or os.path.join(args.workdir, "gradients")

    # Heavy imports after the argument checks, so bad input fails fast.
    from tqdm import tqdm

    from configs import sharding
    from pgla_jax.denoise import dncnn, gradients, loop

    sharding.initialize_distributed()  # a multi-host job: before anything touches a device
    mesh = cli.make_mesh(args.mesh)
    quiet = not sharding.is_primary()  # one host reports
    t0 = time.time()
    with cli.reported(ValueError):  # DataError and CheckpointError are ValueErrors
        with tqdm(total=cfg.gradients.steps, desc="surrogate gradients", file=sys.stderr, disable=quiet) as bar:
            gradients.build(cfg.gradients, data_dir, progress=bar.update)
        out = None
        if not (args.prior_only or args.refiner_only):
            stop = cfg.steps if args.max_steps is None else min(cfg.steps, args.max_steps)
            start = min(loop.saved_step(args.workdir), stop)  # a resumed run's bar starts where it left off
            with tqdm(total=stop, initial=start, desc="denoiser", file=sys.stderr, disable=quiet) as bar:

                def progress(loss):
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.4f}")

                out = loop.train(cfg, data_dir, args.workdir, progress=progress, mesh=mesh, max_steps=args.max_steps,
                                  extend=args.extend)
            # Process 0 decides: every host must run the baseline's steps (and its checkpoint save) or none.
            if cfg.dncnn_steps and not sharding.from_primary(os.path.isdir(os.path.join(args.workdir, "dncnn"))):
                start = min(loop.saved_step(args.workdir, dncnn.STATE), cfg.dncnn_steps)
                with tqdm(total=cfg.dncnn_steps, initial=start, desc="DnCNN baseline", file=sys.stderr,
                          disable=quiet) as bar:

                    def progress_dncnn(loss):
                        bar.update(1)
                        bar.set_postfix(loss=f"{loss:.4f}")

                    dncnn.train(cfg, data_dir, args.workdir, progress=progress_dncnn, mesh=mesh)
        prior_dir = os.path.join(args.workdir, "prior")
        # Like the baseline: every host fits (deterministic, seconds to minutes) and saves together, or none does.
        if cfg.prior_rank and not sharding.from_primary(os.path.isdir(prior_dir)):
            from pgla_jax.denoise import prior
            from pgla_jax.models import split_victim

            layers = len(prior.blocks(split_victim(cfg.gradients.victim)[1]))
            with tqdm(total=layers, desc="Gaussian prior (layers)", file=sys.stderr, disable=quiet) as bar:
                prior.build(cfg, data_dir, prior_dir, progress=bar.update)
        refiner_dir = os.path.join(args.workdir, "refiner")
        if cfg.prior_rank and cfg.refiner.steps and not args.prior_only and not os.path.isdir(refiner_dir):
            _train_refiner(cfg, args.workdir, prior_dir, quiet, sys.argv[1:] if argv is None else argv, mesh)
    if not quiet:
        out = out or os.path.abspath(refiner_dir if args.refiner_only else prior_dir)
        what = "prior" if args.prior_only else "refiner" if args.refiner_only else "denoiser"
        print(f"{what} checkpoint: {out} ({time.time() - t0:.0f} s)")
    return 0


def _train_refiner(cfg: DenoiserConfig, workdir: str, prior_dir: str, quiet: bool, argv: list[str], mesh) -> str:
    """The prior's learned correction (`pgla_jax/denoise/refiner.py`), on one device: its gradients, then its
    steps (resumable; checkpoints replicated over `mesh` in a job of several processes)."""
    from tqdm import tqdm

    from configs import provenance
    from pgla_jax.denoise import denoisers, gradients, loop, refiner

    data_dir = os.path.join(workdir, refiner.DATA)
    with tqdm(total=cfg.refiner.gradients.steps, desc="refiner gradients", file=sys.stderr, disable=quiet) as bar:
        gradients.build(cfg.refiner.gradients, data_dir, progress=bar.update)
    dens = denoisers.load(prior_dir, denoisers.denoiser_checkpoint.make_codec(cfg))
    start = min(loop.saved_step(workdir, refiner.STATE), cfg.refiner.steps)
    with tqdm(total=cfg.refiner.steps, initial=start, desc="refiner", file=sys.stderr, disable=quiet) as bar:
        def progress(loss):
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4g}")
        return refiner.train(cfg, dens.prior, dens.prior_gains, data_dir, workdir, progress=progress, mesh=mesh,
                             provenance={"prior": os.path.abspath(prior_dir),
                                         "prior_sha256": provenance.checkpoint_sha256(prior_dir),
                                         "command": "python -m pgla_jax.train_denoiser " + " ".join(argv)})


if __name__ == "__main__":
    sys.exit(main())
