"""`python -m sage_jax.convert SRC OUT [--to sage|hf] [--dtype float32|bfloat16] [--force]`: convert a model.

`--to sage` (default): a GGUF file or an HF directory (a Llama / Qwen2 / Mistral LM, a Qwen2.5-VL or a
LLaVA-OneVision, sharded or not) -> our checkpoint (params, metadata.json, tokenizer/, processor/). HF
directories stream: one parameter is in memory at a time, never the whole checkpoint.
`--to hf`: a text LM `sage_jax.load` reads (e.g. a draft LM written by `train_draft`) -> an HF directory
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
    if os.path.lexists(args.out) and not args.force:
        raise cli.BadInput(f"{args.out} exists; pass --force to replace it")
    cli.writable(os.path.dirname(os.path.abspath(args.out)), "OUT")
    import jax
    import jax.numpy as jnp

    from sage_jax.io import architectures, hf, lm_checkpoint, loader, vlm_checkpoint

    # Written beside OUT and renamed into place when complete: --force replaces OUT whole (an old checkpoint left
    # inside would otherwise shadow the new one), and a failed or interrupted run leaves OUT as it was.
    with cli.reported(OSError, ValueError), cli.replacing(args.out) as staged:  # CheckpointError is a ValueError
        kind = loader.detect(args.src)
        if args.to == "hf":
            if kind == "vlm" or (kind == "hf" and architectures.of_hf_dir(args.src)[0].is_vlm):
                raise cli.BadInput(f"--to hf converts text LMs; {args.src} is a vision-language model")
            cfg, model, tok = loader.load_lm(args.src, dtype="float32")
            hf.write_hf(staged, cfg, model.params(), tok)
        elif kind == "hf":
            vlm_checkpoint.convert_hf(args.src, staged, dtype=args.dtype, progress=sys.stderr.isatty())
        else:
            cfg, params, tok, provenance = loader.read(args.src)
            cfg = lm_checkpoint.with_dtype(cfg, args.dtype)
            params = jax.tree.map(lambda a: jnp.asarray(a, cfg.param_dtype), params)
            lm_checkpoint.save_lm(staged, cfg, params, tok, provenance=provenance)
    print(args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
