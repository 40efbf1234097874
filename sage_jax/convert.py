"""`python -m sage_jax.convert SRC OUT [--to sage|hf] [--dtype float32|bfloat16] [--force]`: convert an LM.

`--to sage` (default): a GGUF file or an HF directory -> our LM checkpoint (params, metadata.json, tokenizer/).
`--to hf`: anything `sage_jax.load` reads (e.g. a draft LM written by `train_draft`) -> an HF directory
(config.json + float32 model.safetensors + tokenizer) that transformers loads.
Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import os
import sys

from configs import cli


def _main(argv: list[str] | None) -> int:
    ap = cli.Parser(prog="python -m sage_jax.convert", description=__doc__.splitlines()[0].split(": ", 1)[1])
    ap.add_argument("src", help="a GGUF file, an HF directory (config.json + safetensors) or our checkpoint")
    ap.add_argument("out", help="directory to write")
    ap.add_argument("--to", choices=("sage", "hf"), default="sage", help="our checkpoint (default) or HF")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="stored parameter dtype of our checkpoint (HF output is float32)")
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists")
    args = ap.parse_args(argv)
    if os.path.exists(args.out) and not args.force:
        raise cli.BadInput(f"{args.out} exists; pass --force to replace it")
    import jax
    import jax.numpy as jnp

    from sage_jax.io import hf, loader, store

    with cli.reported(OSError, ValueError):  # configs.checkpoint.CheckpointError is a ValueError
        if args.to == "hf":
            cfg, model, tok = loader.load_lm(args.src, dtype="float32")
            path = hf.write_hf(args.out, cfg, model.params(), tok)
        else:
            cfg, params, tok, provenance = loader.read(args.src)
            cfg = store.with_dtype(cfg, args.dtype)
            params = jax.tree.map(lambda a: jnp.asarray(a, cfg.param_dtype), params)
            path = store.save_lm(args.out, cfg, params, tok, provenance=provenance, overwrite=args.force)
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
