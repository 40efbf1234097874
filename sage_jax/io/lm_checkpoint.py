"""Our checkpoints of SAGE's models (`configs.checkpoint` params + metadata): LMs and EAGLE-style draft heads.

An LM (kind "lm")::

    CKPT/metadata.json   config (LMConfig.to_json), provenance {source, sha256, ...}
    CKPT/params/         Orbax, our parameter tree (see sage_jax/models/decoder.py)
    CKPT/tokenizer/      tokenizer.json, tokenizer_config.json, chat_template.jinja (save_pretrained)

A draft head (kind "eagle_head"): params {"head": <sage_jax/models/eagle_head.py layout>[, "vocab_ids": [Vd]]},
metadata config {"head": LMConfig, "target": LMConfig or None, "vocab_size": Vd or 0, "taps": [layer ids] (an
EAGLE-3-style head's fused target layers; [] or absent: the last hidden state)}.

A draft of either kind may hold `acceptance.json`: per tree policy, its acceptance statistics on held-out prompts
(`decoding.budget.AcceptanceStats`), the prior of `--budget auto` (`python -m sage_jax.evaluate_draft
--write-prior`).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import checkpoint, cli, sharding
from sage_jax.io.hf import flatten
from sage_jax.models.config import LMConfig
from sage_jax.models.decoder import Decoder

KIND = "lm"
HEAD_KIND = "eagle_head"
VLM_KIND = "vlm"  # a vision-language model (`vlm_checkpoint`); a draft VLM carries a prior like the other drafts
DRAFT_KINDS = (KIND, HEAD_KIND, VLM_KIND)  # the checkpoints that can carry an `acceptance.json`
TOKENIZER_DIR = "tokenizer"
ACCEPTANCE_FILE = "acceptance.json"


def kind_of(path: str | os.PathLike) -> str | None:
    """The checkpoint kind stored at `path` ("lm", "eagle_head", ...), None when it is no checkpoint of ours."""
    try:
        return checkpoint.read_metadata(path).get("kind")
    except checkpoint.CheckpointError:
        return None


def is_checkpoint(path: str | os.PathLike) -> bool:
    return kind_of(path) == KIND


def save_lm(path: str | os.PathLike, cfg: LMConfig, params: Mapping[str, Any], tokenizer=None, *,
            provenance: Mapping[str, Any] | None = None, overwrite: bool = False) -> str:
    """Writes params (pure nested dict, numpy or jax, possibly sharded) + config + tokenizer. Returns the path."""
    path = checkpoint.save(path, params, config=cfg, kind=KIND, provenance=provenance, overwrite=overwrite,
                           stacked=("blocks",))
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(path, TOKENIZER_DIR))
        checkpoint.write_sums(path)  # the tokenizer too
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
        arrays = jax.tree.map(lambda a, s: sharding.place(jnp.asarray(a, dt), s), dict(params), shardings)
    nnx.replace_by_pure_dict(state, arrays)
    return nnx.merge(graphdef, state)


def load_lm(path: str | os.PathLike, *, dtype: str | None = None, mesh: jax.sharding.Mesh | None = None):
    """Our LM checkpoint -> (config, Decoder, tokenizer or None).

    With `mesh`, every array is restored straight onto it, sharded by `configs.sharding`'s current rules
    (no full copy on one device first).
    """
    cfg = with_dtype(read_config(path), dtype)
    graphdef, state = abstract_model(cfg)
    return cfg, restore_module(path, graphdef, state, mesh), read_tokenizer(path)


def load_serving(path: str | os.PathLike, *, dtype: str | None = None, mesh: jax.sharding.Mesh | None = None):
    """Our LM checkpoint -> (config, its serving form `serving_lm.LM`, tokenizer or None), built while restoring
    (`serving_from`): loading peaks at about the served weights plus one part of a layer, where restoring a
    `Decoder` and then fusing it (`load_lm(...)[1].serving()`) holds both forms at once. The result equals that of
    the second way, array for array."""
    cfg = with_dtype(read_config(path), dtype)
    reader = checkpoint.Reader(path)
    checkpoint.check_fits(reader.meta, nnx.to_pure_dict(abstract_model(cfg)[1]))
    return cfg, serving_from(reader, cfg, mesh), read_tokenizer(path)


def serving_from(reader: checkpoint.Reader, cfg: LMConfig, mesh: jax.sharding.Mesh | None = None, prefix: str = ""):
    """The serving form (`serving_lm.LM`, in `cfg`'s dtype) of the LM whose canonical arrays `reader` holds under
    `prefix` ("lm/" in a vision-language checkpoint), built while restoring.

    Part by part of each layer (`serving_lm.SERVING_PARTS`: its qkv, its output projection, its gate|up, ...), the
    canonical arrays are read (`checkpoint.Reader`), fused on the host (`serving_part`), cast and placed (on `mesh`,
    by the inference rules, cut as `Decoder.serving` cuts them); the host copies are dropped before the next part is
    read. So the host holds one part beside what is placed, and the canonical form never exists whole. In a
    multi-host run every host reads the parts and places its own shards."""
    from jax.sharding import SingleDeviceSharding

    from sage_jax.models import serving_lm

    _, state = abstract_model(cfg)
    abstract = nnx.to_pure_dict(state)
    dt = jnp.dtype(cfg.param_dtype)
    if mesh is None:
        one = SingleDeviceSharding(jax.local_devices()[0])
        where = jax.tree.map(lambda _: one, abstract)
        groups, layout = (1, 1), None
    else:
        with sharding.use(mesh, "inference"):
            where = nnx.to_pure_dict(sharding.state_shardings(state, mesh))
        placed = jax.tree.map(lambda a, w: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=w), abstract, where)
        groups, layout = serving_lm.serving_layout(cfg, placed)

    def put(value: np.ndarray, at) -> jax.Array:
        return sharding.place(np.asarray(value).astype(dt, copy=False), at)

    parts = [part for part, keys in serving_lm.SERVING_PARTS.items() if all(k in abstract["blocks"] for k in keys)]
    # Where each serving matrix goes: one device, or cut on the mesh as `Decoder.serving` cuts it.
    out_at = (lambda k: where["embed"]) if layout is None else (lambda k: layout.layers[0][k])  # noqa: E731
    # The embedding and head first: their host copies come and go while little else is held.
    top = {k: put(reader.read(prefix + k), where[k]) for k in abstract if k != "blocks"}
    _release_host_memory()
    layers = [{} for _ in range(cfg.n_layers)]
    for part in parts:  # one part at a time, fused on the host: it holds only this part's arrays
        keys = serving_lm.SERVING_PARTS[part]
        # Layers read together as they are stored: one per chunk as `checkpoint.Writer` and `save` store them; an
        # older checkpoint holding an array in fewer chunks is read in as many layers as a chunk spans, not once a
        # layer (which would decode the whole array every time).
        span = max(reader.chunk_shape(f"{prefix}blocks/{k}")[0] for k in keys)
        for i0 in range(0, cfg.n_layers, span):
            stacked = {k: reader.read(f"{prefix}blocks/{k}", slice(i0, i0 + span)) for k in keys}
            for j in range(stacked[keys[0]].shape[0]):
                fused = serving_lm.serving_part(cfg, part, {k: v[j] for k, v in stacked.items()}, groups, xp=np)
                for k, v in fused.items():
                    layers[i0 + j][k] = jax.block_until_ready(put(np.ascontiguousarray(v), out_at(k)))
            del stacked
            _release_host_memory()
    return serving_lm.LM(embed=top["embed"], final_norm=top["final_norm"], lm_head=top.get("lm_head"),
                         layers=tuple(layers), cfg=cfg, groups=groups)


@functools.cache
def _malloc_trim():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def _release_host_memory() -> None:
    """Hands the heap pages the last part's host buffers came from back to the system (glibc's `malloc_trim`, where
    the C library has it), which a process keeps for reuse otherwise: loading part by part would end up holding a
    part's worth of free heap per buffer size."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def restore_module(path: str | os.PathLike, graphdef, state, mesh: jax.sharding.Mesh | None = None):
    """The NNX module of (graphdef, abstract state) holding the checkpoint's params, each array restored straight
    onto its shard of `mesh` (or the default device) in the state's dtype (Orbax casts on restore)."""
    abstract = nnx.to_pure_dict(state)
    if mesh is None:
        dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), abstract)
    else:
        shardings = nnx.to_pure_dict(sharding.state_shardings(state, mesh))
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    nnx.replace_by_pure_dict(state, checkpoint.restore(path, abstract))
    return nnx.merge(graphdef, state)


def save_head(path: str, head_cfg: LMConfig, head_params: Mapping[str, Any], *, target_cfg: LMConfig | None = None,
              vocab_ids=None, provenance: Mapping[str, Any] | None = None, overwrite: bool = False,
              dtype: str | None = None, taps: tuple[int, ...] = ()) -> str:
    """Writes an EAGLE-style head (kind "eagle_head", layout above; `taps`: the target layers an EAGLE-3-style
    head fuses); `dtype` e.g. "bfloat16". Returns the path."""
    params = jax.tree.map(lambda x: np.asarray(x, jnp.dtype(dtype)) if dtype else np.asarray(x), dict(head_params))
    tree = {"head": params}
    if vocab_ids is not None:
        tree["vocab_ids"] = np.asarray(vocab_ids, np.int32)
    config = {"head": head_cfg.to_json(), "target": target_cfg.to_json() if target_cfg else None,
              "vocab_size": 0 if vocab_ids is None else int(np.size(vocab_ids)), "taps": [int(i) for i in taps]}
    return checkpoint.save(path, tree, config=config, kind=HEAD_KIND, provenance=provenance, overwrite=overwrite)


def load_head(path: str | os.PathLike, *, dtype: str | None = "float32") -> tuple[LMConfig, dict, Any, dict]:
    """(head config, head params, vocab ids or None, metadata) of a checkpoint written by `save_head`; the taps
    are `head_taps(metadata)`."""
    meta = checkpoint.read_metadata(path)
    if meta.get("kind") != HEAD_KIND:
        raise checkpoint.CheckpointError(f"{os.fspath(path)} holds a {meta.get('kind')!r} checkpoint, not an "
                                         f"{HEAD_KIND}")
    tree = checkpoint.restore(path)
    cfg = LMConfig.from_json(meta["config"]["head"])
    params = tree["head"] if dtype is None else jax.tree.map(lambda x: jnp.asarray(x, jnp.dtype(dtype)), tree["head"])
    return cfg, params, tree.get("vocab_ids"), meta


def head_taps(meta: Mapping[str, Any]) -> tuple[int, ...]:
    """The target layers a head's metadata says it fuses (() for a plain EAGLE-style head)."""
    return tuple(int(i) for i in meta["config"].get("taps") or ())


def read_acceptance(path: str | os.PathLike) -> dict[str, Any]:
    """The `acceptance.json` of a draft checkpoint ({} when it has none)."""
    file = os.path.join(os.fspath(path), ACCEPTANCE_FILE)
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return json.load(f)


def write_acceptance(path: str | os.PathLike, data: Mapping[str, Any]) -> str:
    """Writes (replaces) the `acceptance.json` of the checkpoint at `path`. Returns the file's path."""
    if kind_of(path) not in DRAFT_KINDS:
        raise ValueError(f"{os.fspath(path)} is not a draft checkpoint of ours (an LM, a VLM or an EAGLE-style head)")
    file = os.path.join(os.fspath(path), ACCEPTANCE_FILE)
    with cli.written(file) as f:
        json.dump(data, f, indent=1)
    return file
