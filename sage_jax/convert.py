"""`python -m sage_jax.convert SRC OUT [--dtype float32|bfloat16] [--force]`: a GGUF file or HF directory -> our
LM checkpoint (params, metadata.json, tokenizer/). Bad input: one line on stderr, exit code 2."""

from __future__ import annotations

import argparse
import os
import sys

from configs.checkpoint import CheckpointError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sage_jax.convert", description=__doc__.split(":")[0])
    ap.add_argument("src", help="a GGUF file or an HF directory (config.json + safetensors)")
    ap.add_argument("out", help="checkpoint directory to write")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="stored parameter dtype")
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists")
    args = ap.parse_args(argv)
    try:
        if os.path.exists(args.out) and not args.force:
            raise FileExistsError(f"{args.out} exists; pass --force to replace it")
        import jax
        import jax.numpy as jnp

        from sage_jax.io import load, store

        cfg, params, tok, provenance = load.read(args.src)
        cfg = store.with_dtype(cfg, args.dtype)
        params = jax.tree.map(lambda a: jnp.asarray(a, cfg.param_dtype), params)
        path = store.save_lm(args.out, cfg, params, tok, provenance=provenance, overwrite=args.force)
    except (OSError, ValueError, CheckpointError) as e:  # CheckpointError is a ValueError; listed for the reader
        print(f"error: {(str(e).splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
