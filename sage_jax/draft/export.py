"""Export a separate LM draft as an HF directory (config.json + model.safetensors [+ tokenizer]) that
transformers loads, e.g. for transformers' own assisted generation with the very same draft.

    python -m sage_jax.draft.export DRAFT_CKPT OUT_DIR
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from sage_jax.io.hf import write_hf
from sage_jax.models.config import LMConfig


def export_lm(path: str | os.PathLike, cfg: LMConfig, params: Mapping[str, Any], tokenizer=None) -> str:
    """Our canonical params (any float dtype) -> an HF directory in float32. Returns its absolute path."""
    params32 = jax.tree.map(lambda x: np.asarray(x, np.float32), dict(params))
    return write_hf(path, cfg.replace(param_dtype="float32", dtype="float32"), params32, tokenizer)


def export_checkpoint(src: str | os.PathLike, dst: str | os.PathLike) -> str:
    """A draft written by `train_draft` (kind "lm", or any spec `load_lm` reads) -> an HF directory."""
    from sage_jax.io import load_lm

    cfg, model, tok = load_lm(src, dtype="float32")
    return export_lm(dst, cfg, model.params(), tok)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("error: usage: python -m sage_jax.draft.export DRAFT_CKPT OUT_DIR", file=sys.stderr)
        return 2
    try:
        print(export_checkpoint(argv[0], argv[1]))
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {(str(e).splitlines() or ['export failed'])[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
