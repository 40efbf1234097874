"""`python -m pgla_jax.attack`: protect FL gradients, denoise them, invert them; print a Markdown table or JSON and
save PNG grids of the recovered images (OUT/results.md and OUT/results.json too, each with what produced it: the
commit, the command line, the denoiser checkpoints' sha256, the CPU and jax; `configs.provenance`).

`--denoiser CKPT` is a diffusion checkpoint (or a Gaussian prior alone) from `python -m pgla_jax.train_denoiser`
(default: the one shipped for the victim, for the 28×28 and the 32×32×3 DLG LeNet; `none`: classical baselines
only). Bad input (unknown config, data path or denoiser, ε ≤ 0, batch larger than the data, a checkpoint that does
not fit the victim, an existing output file without --force) → one line ``error: ...`` on stderr and exit code 2
(`configs.cli`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from configs import cli
from pgla_jax.config import DATASETS, ExperimentConfig, is_dataset_name


def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [t for t in items if t not in allowed]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(allowed)})")
        return items

    return parse


def _names(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _epsilons(text: str) -> tuple[float, ...]:
    try:
        eps = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"epsilons must be numbers separated by commas, got {text!r}") from None
    if not eps or any(not (0 < e < float("inf")) for e in eps):
        raise argparse.ArgumentTypeError(f"every epsilon must be a finite number > 0, got {text!r}")
    return eps


def parse(argv) -> argparse.Namespace:
    p = cli.Parser(prog="python -m pgla_jax.attack", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="mnist_lenet", help="configs/pgla/<name> or a .py file with get_config()")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set protection.delta=1e-5 (repeatable; before the flags "
                        "below, which win)")
    p.add_argument("--denoiser", default="shipped",
                   help="checkpoint folder (train_denoiser's WORKDIR/denoiser, or WORKDIR/prior alone), 'shipped' "
                        "(default: the one shipped for the victim: the 28×28 and the 32×32×3 LeNet) or 'none' "
                        "(classical baselines only)")
    p.add_argument("--denoisers", type=_names,
                   help="comma-separated denoisers to score (default: all available), e.g. none,wiener,diffusion")
    p.add_argument("--attacked", type=_names,
                   help="denoisers whose outputs are also attacked (default: none, diffusion_ddim, prior_ddim, "
                        "prior_refined and attack_aware, those available; attack_aware, the default path, inverts "
                        "blends of the protected and the best denoised gradient and keeps the reconstruction under "
                        "which the protected gradient is the most likely)")
    p.add_argument("--epsilons", type=_epsilons, help="comma-separated ε values, e.g. 1,10,50,100")
    p.add_argument("--noise", type=_choices(("gaussian", "laplace")), help="gaussian, laplace or both (comma)")
    p.add_argument("--calibration", type=_choices(("paper", "dpsgd")), help="paper, dpsgd or both (comma)")
    p.add_argument("--attack", choices=("dlg", "idlg", "ig"))
    p.add_argument("--images", type=cli.integer(1, 10**6), help="number of private images attacked")
    p.add_argument("--jitter", type=cli.integer(0, 1000), default=0, metavar="J",
                   help="J more attacks of each protected gradient from other random starts: their spread is the "
                        "image_psnr_jitter column, the attack's own noise (default 0: not measured)")
    p.add_argument("--batch-size", type=cli.integer(1, 4096), help="images per client gradient")
    p.add_argument("--iterations", type=cli.integer(1, 10**7), help="attack iterations (L-BFGS or Adam steps)")
    p.add_argument("--data", metavar="NAME",
                   help="data set: mnist5k, fashion_mnist, digits, skimage_patches, surrogate_patches, cifar10, "
                        "cifar100 (pickles) or "
                        "tfds:<name> (a prepared tfds dataset, e.g. tfds:cifar100, tfds:pgla_patches)")
    p.add_argument("--data-path", help="data folder (CIFAR pickles, Fashion-MNIST IDX files, the tfds data_dir)")
    p.add_argument("--out", default="pgla_out", help="output folder for the PNG grids and results.{md,json}")
    p.add_argument("--force", action="store_true", help="overwrite existing outputs")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p.parse_args(argv)


def check_data_name(name: str) -> str:
    """`name` if it names a data set (`pgla_jax.config.DATASETS` or tfds:<name>); BadInput otherwise."""
    if is_dataset_name(name):
        return name
    raise cli.BadInput(f"unknown data set {name!r}; expected one of {', '.join(DATASETS)} or tfds:<name>")


def build_config(args):
    cfg = cli.load_config(args.config, "configs.pgla", ExperimentConfig, overrides=args.set)
    prot = {k: v[0] for k, v in (("noise", args.noise), ("calibration", args.calibration)) if v is not None}
    att = {k: v for k, v in (("kind", args.attack), ("iterations", args.iterations)) if v is not None}
    top = {k: v for k, v in (("epsilons", args.epsilons), ("num_images", args.images),
                             ("batch_size", args.batch_size)) if v is not None}
    if att.get("kind", cfg.attack.kind) != cfg.attack.kind:
        att.setdefault("iterations", None)  # the new attack's own defaults, not the config's (L-BFGS ≠ Adam)
        att["lr"] = None
    data_cfg = cfg.data
    if args.data is not None:
        data_cfg = dataclasses.replace(data_cfg, name=check_data_name(args.data))
    if args.data_path is not None:
        if not os.path.isdir(args.data_path):
            raise cli.BadInput(f"data path {args.data_path} not found")
        data_cfg = dataclasses.replace(data_cfg, path=args.data_path)
    if data_cfg != cfg.data:
        top["data"] = data_cfg
    return cfg.replace(protection=dataclasses.replace(cfg.protection, **prot),
                       attack=dataclasses.replace(cfg.attack, **att), **top)


def denoiser_path(spec: str, victim) -> str | None:
    """The checkpoint folder `--denoiser` names; 'shipped' is the one shipped for `victim` (None: there is none,
    and the classical baselines run alone)."""
    if spec == "none":
        return None
    if spec == "shipped":
        from pgla_jax.denoise.denoiser_checkpoint import shipped_for

        return shipped_for(victim)
    if not os.path.isdir(spec):
        raise cli.BadInput(f"denoiser checkpoint {spec} not found")
    return spec


def checkpoints(ckpt: str | None) -> dict[str, str | None]:
    """The checkpoints a run reads, for its provenance: the denoiser and, beside it, its DnCNN, Gaussian prior and
    the prior's learned correction (`denoisers.load`)."""
    out: dict[str, str | None] = {"denoiser": ckpt}
    if ckpt is not None:
        for name in ("dncnn", "prior", "refiner"):
            sibling = os.path.join(os.path.dirname(os.path.abspath(ckpt)), name)
            if os.path.isdir(sibling) and sibling != os.path.abspath(ckpt):
                out[name] = sibling
    return out


def markdown(rows, clean) -> str:
    """The results as a Markdown table (image metrics with data range 1; '–' where a denoiser was not attacked)."""
    cols = ("noise", "calibration", "epsilon", "noise_std", "denoiser", "t_star", "grad_cosine", "grad_psnr",
            "image_psnr", "image_ssim", "label_accuracy", "image_psnr_jitter")

    def fmt(v):
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:.5f}" if abs(v) < 1 else f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in [{**clean, "noise": "clean", "denoiser": "–"}, *rows]:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Runs the command line (`argv` without the program name; None: sys.argv); returns the exit code."""
    return cli.run(_main, argv)


def _main(argv) -> int:
    args = parse(argv)
    cfg = build_config(args)
    noises = args.noise or (cfg.protection.noise,)
    cals = args.calibration or (cfg.protection.calibration,)
    settings = [(n, c) for n in noises for c in cals]
    stem = f"pgla_{cfg.data.name.split('/')[0]}_{cfg.attack.kind}"
    figures = [os.path.join(args.out, f"{stem}_{n}_{c}.png") for n, c in settings]
    outputs = [*figures, os.path.join(args.out, "results.md"), os.path.join(args.out, "results.json")]
    cli.output_dir(args.out, "--out", args.force, [os.path.basename(p) for p in outputs])
    ckpt = denoiser_path(args.denoiser, cfg.victim)

    # Heavy imports after the argument checks, so bad input fails fast.
    from tqdm import tqdm

    from configs import provenance
    from pgla_jax import data, experiment
    from pgla_jax.codec import make_codec
    from pgla_jax.denoise import denoisers as den
    from pgla_jax.models import split_victim

    with cli.reported(ValueError):  # DataError and CheckpointError are ValueErrors
        ds = data.load(cfg.data)
        experiment.validate(cfg, ds)
        dens = den.load(ckpt, make_codec(split_victim(cfg.victim)[1], "image2d", 4))
    names = args.denoisers or dens.names
    unknown = [n for n in (*names, *(args.attacked or ())) if n not in (*dens.names, experiment.AWARE)]
    if unknown:
        raise cli.BadInput(f"denoiser {unknown[0]!r} is not available; available: {', '.join(dens.names)}")
    base = experiment.aware_base(names)
    if args.attacked is not None and experiment.AWARE in args.attacked and base is None:
        raise cli.BadInput(f"{experiment.AWARE} blends one of {', '.join(experiment.AWARE_BASES)}, and none of them "
                           "is among the denoisers")
    attacked = [n for n in (args.attacked if args.attacked is not None else experiment.ATTACKED)
                if n in names or (n == experiment.AWARE and base is not None)]
    # attack_aware runs each blend that no attacked row has already inverted (α = 0: none's, α = 1: its base's).
    aware = experiment.AWARE in attacked and len(experiment.BLENDS) - ("none" in attacked) - (base in attacked)
    # After every check: a refused run leaves no empty folder behind; an earlier run's figures (other settings) go.
    cli.begin_outputs(args.out, [os.path.basename(p) for p in outputs])
    per_image = 1 + len(settings) * len(cfg.epsilons) * (len(attacked) - (experiment.AWARE in attacked) + aware
                                                          + args.jitter + (args.jitter > 0 and "none" not in attacked))
    total = (cfg.num_images // cfg.batch_size) * per_image
    # What produced the results, taken as the run starts: the checkout may move on while it runs.
    record = provenance.record("python -m pgla_jax.attack", argv, checkpoints(ckpt))
    with tqdm(total=total, desc=f"{cfg.attack.kind} attacks", file=sys.stderr) as bar:
        outcome = experiment.run(cfg, ds, progress=bar.update, denoisers=dens, settings=settings, names=names,
                                 attacked=attacked, jitter=args.jitter)
    for (n, c), figure in zip(settings, figures):
        experiment.save_figure(outcome.panels[(n, c)], outcome.psnr[(n, c)], figure,
                               title=f"{cfg.attack.kind} on {cfg.victim.kind}/{cfg.data.name}, {n} noise, "
                                     f"{c} calibration")
    result = {"results": outcome.rows, "clean": outcome.clean, "figure": figures[0], "figures": figures,
              "denoiser_checkpoint": dens.path, "provenance": record}
    table = markdown(outcome.rows, outcome.clean)
    with cli.written(os.path.join(args.out, "results.md")) as f:
        f.write(provenance.markdown(record) + "\n\n" + table + "\n")
    with cli.written(os.path.join(args.out, "results.json")) as f:
        json.dump(result, f, indent=1)
    cli.end_outputs(args.out, outputs)
    if args.json:
        print(json.dumps(result))
    else:
        print(table)
        print(f"image PSNR/SSIM with data range 1.0; figures: {', '.join(figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
