"""`python -m pgla_jax.prepare_data NAME [NAME ...] --data-dir DIR`: prepare tfds datasets as array_record files.

NAME is this project's offline builder (``pgla_mnist5k``, ``pgla_fashion_mnist``, ``pgla_patches``; seconds, no
network) or a tfds catalogue name (``mnist``, ``cifar100``, ``stl10``: downloads, so run it once where there is
network, e.g. on a TPU VM, with TensorFlow installed for the catalogue's PNG encoding). Then
``python -m pgla_jax.attack --data tfds:NAME --data-path DIR`` reads them without TensorFlow. Bad input (an
unknown name, a --data-dir that is a file) → one line ``error: ...`` and exit code 2.
"""

from __future__ import annotations

import os
import sys

from configs import cli


def main(argv=None) -> int:
    """Runs the command line (`argv` without the program name; None: sys.argv); returns the exit code."""
    return cli.run(_main, argv)


def _main(argv) -> int:
    p = cli.Parser(prog="python -m pgla_jax.prepare_data", description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="+", metavar="NAME", help="offline builder or tfds catalogue name")
    p.add_argument("--data-dir", help="tfds data_dir (default $TFDS_DATA_DIR or ~/tensorflow_datasets)")
    args = p.parse_args(argv)
    if args.data_dir is not None and os.path.exists(args.data_dir) and not os.path.isdir(args.data_dir):
        raise cli.BadInput(f"--data-dir {args.data_dir} exists and is not a folder")
    from pgla_jax import tfds_sources

    with cli.reported(ValueError):  # DataError: unknown name, missing offline files
        for name in args.names:
            tfds_sources.builder(name.removeprefix(tfds_sources.PREFIX), args.data_dir)  # names checked first
        for name in args.names:
            print(tfds_sources.prepare(name.removeprefix(tfds_sources.PREFIX), args.data_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
