"""Our checkpoint of an LM: `configs.checkpoint` params + metadata, and the tokenizer saved beside them.

Layout::

    CKPT/metadata.json   kind "lm", config (LMConfig.to_json), provenance {source, sha256, ...}
    CKPT/params/         Orbax, our parameter tree (see sage_jax/models/decoder.py)
    CKPT/tokenizer/      tokenizer.json, tokenizer_config.json, chat_template.jinja (save_pretrained)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import checkpoint, sharding
from sage_jax.io.hf import flatten
from sage_jax.models.config import LMConfig
from sage_jax.models.decoder import Decoder

KIND = "lm"
TOKENIZER_DIR = "tokenizer"


def is_checkpoint(path: str | os.PathLike) -> bool:
    try:
        return checkpoint.read_metadata(path).get("kind") == KIND
    except checkpoint.CheckpointError:
        return False


def save_lm(path: str | os.PathLike, cfg: LMConfig, params: Mapping[str, Any], tokenizer=None, *,
            provenance: Mapping[str, Any] | None = None, overwrite: bool = False) -> str:
    """Writes params (pure nested dict, numpy or jax, possibly sharded) + config + tokenizer. Returns the path."""
    path = checkpoint.save(path, params, config=cfg, kind=KIND, provenance=provenance, overwrite=overwrite)
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(path, TOKENIZER_DIR))
    return path


def read_config(path: str | os.PathLike) -> LMConfig:
    meta = checkpoint.read_metadata(path)
    if meta.get("kind") != KIND:
        raise checkpoint.CheckpointError(f"{os.fspath(path)} holds a {meta.get('kind')!r} checkpoint, not an LM")
    return LMConfig.from_json(meta["config"])


def read_tokenizer(path: str | os.PathLike):
    tdir = os.path.join(os.fspath(path), TOKENIZER_DIR)
    if not os.path.isdir(tdir):
        return None
    # Not AutoTokenizer: it imports torch when torch is installed; this class never does.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(tdir)


def with_dtype(cfg: LMConfig, dtype: str | None) -> LMConfig:
    """`dtype` sets both storage and compute dtype ("float32" or "bfloat16"); None keeps the config's."""
    if dtype is None:
        return cfg
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"unsupported dtype {dtype!r}; expected float32 or bfloat16")
    return cfg.replace(param_dtype=dtype, dtype=dtype)


def abstract_model(cfg: LMConfig):
    """(graphdef, abstract state) of a Decoder: shapes and dtypes only, nothing allocated."""
    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))


def build(cfg: LMConfig, params: Mapping[str, Any], mesh: jax.sharding.Mesh | None = None) -> Decoder:
    """A Decoder holding `params` (cast to cfg.param_dtype; placed by the logical-axis rules on `mesh` if given)."""
    graphdef, state = abstract_model(cfg)
    dt = jnp.dtype(cfg.param_dtype)
    # The same one-line error as a checkpoint that does not fit the config.
    checkpoint.check_fits({"params": {k: [list(np.shape(v))] for k, v in flatten(params).items()}},
                          nnx.to_pure_dict(state))
    if mesh is None:
        arrays = jax.tree.map(lambda a: jnp.asarray(a, dt), dict(params))
    else:
        shardings = nnx.to_pure_dict(sharding.state_shardings(state, mesh))
        arrays = jax.tree.map(lambda a, s: jax.device_put(jnp.asarray(a, dt), s), dict(params), shardings)
    nnx.replace_by_pure_dict(state, arrays)
    return nnx.merge(graphdef, state)


def load_lm(path: str | os.PathLike, *, dtype: str | None = None, mesh: jax.sharding.Mesh | None = None):
    """Our LM checkpoint -> (config, Decoder, tokenizer or None).

    With `mesh`, every array is restored straight onto it, sharded by `configs.sharding`'s current rules
    (no full copy on one device first).
    """
    cfg = with_dtype(read_config(path), dtype)
    graphdef, state = abstract_model(cfg)
    abstract = nnx.to_pure_dict(state)  # ShapeDtypeStructs in cfg.param_dtype; Orbax casts on restore
    if mesh is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), abstract)
    else:
        shardings = nnx.to_pure_dict(sharding.state_shardings(state, mesh))
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    params = checkpoint.restore(path, abstract)
    nnx.replace_by_pure_dict(state, params)
    return cfg, nnx.merge(graphdef, state), read_tokenizer(path)
