"""`python -m pgla_jax.attack`: invert clean and protected FL gradients, print a table or JSON, save a PNG grid.

Bad input (unknown config or data path, ε ≤ 0, batch larger than the data, an existing output file without
--force, a denoiser that is not part 1) → one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import sys

EXIT_USAGE = 2


class UsageError(Exception):
    pass


def load_config(spec: str):
    """`mnist_lenet` (a module in configs/pgla/) or a path to a .py file; either defines get_config()."""
    if spec.endswith(".py"):
        if not os.path.isfile(spec):
            raise UsageError(f"config file {spec} not found")
        mod_spec = importlib.util.spec_from_file_location("pgla_user_config", spec)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(f"configs.pgla.{spec}")
        except ModuleNotFoundError:
            raise UsageError(f"unknown config {spec!r} (no configs/pgla/{spec}.py)") from None
    if not hasattr(module, "get_config"):
        raise UsageError(f"config {spec!r} defines no get_config()")
    return module.get_config()


def _epsilons(text: str) -> tuple[float, ...]:
    try:
        eps = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"epsilons must be numbers separated by commas, got {text!r}") from None
    if not eps or any(not (e > 0) for e in eps):
        raise argparse.ArgumentTypeError(f"every epsilon must be > 0, got {text!r}")
    return eps


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's default prints the usage block first)
        raise UsageError(message)


def parse(argv) -> argparse.Namespace:
    p = _Parser(prog="python -m pgla_jax.attack", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="mnist_lenet", help="configs/pgla/<name> or a .py file with get_config()")
    p.add_argument("--denoiser", default="none", help="gradient denoiser: 'none' (the diffusion model: part 2)")
    p.add_argument("--epsilons", type=_epsilons, help="comma-separated ε values, e.g. 1,10,50,100")
    p.add_argument("--noise", choices=("gaussian", "laplace"))
    p.add_argument("--calibration", choices=("paper", "dpsgd"))
    p.add_argument("--attack", choices=("dlg", "idlg", "ig"))
    p.add_argument("--images", type=int, help="number of private images attacked")
    p.add_argument("--batch-size", type=int, help="images per client gradient")
    p.add_argument("--iterations", type=int, help="attack iterations (L-BFGS or Adam steps)")
    p.add_argument("--data-path", help="data folder (CIFAR pickles, Fashion-MNIST IDX files)")
    p.add_argument("--out", default="pgla_out", help="output folder for the PNG grid")
    p.add_argument("--force", action="store_true", help="overwrite an existing figure")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p.parse_args(argv)


def build_config(args):
    cfg = load_config(args.config)
    if args.denoiser != "none":
        raise UsageError(f"denoiser {args.denoiser!r} is not available yet: the diffusion denoiser arrives with "
                         "PGLA part 2; use --denoiser none")
    prot = {k: v for k, v in (("noise", args.noise), ("calibration", args.calibration)) if v is not None}
    att = {k: v for k, v in (("kind", args.attack), ("iterations", args.iterations)) if v is not None}
    top = {k: v for k, v in (("epsilons", args.epsilons), ("num_images", args.images),
                             ("batch_size", args.batch_size)) if v is not None}
    if att.get("kind", cfg.attack.kind) != cfg.attack.kind:
        att.setdefault("iterations", None)  # the new attack's own defaults, not the config's (L-BFGS ≠ Adam)
        att["lr"] = None
    if args.data_path is not None:
        if not os.path.isdir(args.data_path):
            raise UsageError(f"data path {args.data_path} not found")
        top["data"] = dataclasses.replace(cfg.data, path=args.data_path)
    return cfg.replace(protection=dataclasses.replace(cfg.protection, **prot),
                       attack=dataclasses.replace(cfg.attack, **att), **top)


def main(argv=None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        cfg = build_config(args)
        os.makedirs(args.out, exist_ok=True)
        p = cfg.protection
        figure = os.path.join(args.out, f"pgla_{cfg.data.name.split('/')[0]}_{cfg.attack.kind}_{p.noise}_"
                                        f"{p.calibration}.png")
        if os.path.exists(figure) and not args.force:
            raise UsageError(f"{figure} exists; pass --force to overwrite it or choose another --out")

        # Heavy imports after the argument checks, so bad input fails fast.
        from tqdm import tqdm

        from pgla_jax import data, experiment

        try:
            ds = data.load(cfg.data)
            experiment.validate(cfg, ds)
        except ValueError as e:  # DataError is a ValueError
            raise UsageError(str(e)) from None
        total = (cfg.num_images // cfg.batch_size) * (1 + len(cfg.epsilons))
        with tqdm(total=total, desc=f"{cfg.attack.kind} attacks", file=sys.stderr) as bar:
            outcome = experiment.run(cfg, ds, progress=bar.update, denoiser=args.denoiser)
        experiment.save_figure(outcome, figure, title=f"{cfg.attack.kind} on {cfg.victim.kind}/{cfg.data.name}, "
                                                      f"{p.noise} noise, {p.calibration} calibration")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps({"results": outcome.rows, "clean": outcome.clean, "figure": figure}))
    else:
        cols = ("epsilon", "noise_std", "grad_cosine", "grad_psnr", "image_psnr", "image_ssim", "label_accuracy")
        print(" ".join(f"{c:>14}" for c in cols))
        for r in [outcome.clean, *outcome.rows]:
            print(" ".join(f"{'clean' if r[c] is None else format(r[c], '.4g'):>14}" for c in cols))
        print(f"image PSNR/SSIM with data range 1.0; figure: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
