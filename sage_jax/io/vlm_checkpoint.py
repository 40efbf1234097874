"""Vision-language models in and out of our checkpoint format, and streamed conversion from HF directories.

A VLM checkpoint (kind "vlm")::

    CKPT/metadata.json   config {"architecture": "qwen2_5_vl" | "llava_onevision", "model": <config.to_json()>}
    CKPT/params/         Orbax, {"lm": <sage_jax/models/decoder.py layout>, "vision": ..., ...}
    CKPT/tokenizer/      the tokenizer (save_pretrained)
    CKPT/processor/      the HF directory's preprocessor / processor / chat-template files, copied

Conversion streams: each stored tensor is read (memory-mapped), transformed to our layout and written chunk by
chunk (`configs.checkpoint.Writer`) before the next is read, so host memory holds about one stored tensor, never
the checkpoint; a per-layer tensor goes straight into its layer of the stacked parameter. Loading an HF
directory streams the same way onto the device(s), each per-layer parameter assembled in a device buffer.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import shutil
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import checkpoint, sharding
from sage_jax.io import architectures, hf, lm_checkpoint
from sage_jax.io.architectures import Architecture

VLM_KIND = lm_checkpoint.VLM_KIND
PROCESSOR_DIR = "processor"
# Files of an HF directory that the transformers image / video processors and chat templates read.
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                   "chat_template.json", "chat_template.jinja")


def with_dtype(arch: Architecture, cfg, dtype: str | None):
    """`cfg` with storage and compute dtype `dtype` ("float32" / "bfloat16") in every tower; None keeps it."""
    if dtype is None:
        return cfg
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"unsupported dtype {dtype!r}; expected float32 or bfloat16")

    def cast(c):
        fields = {f.name for f in dataclasses.fields(c)}
        return dataclasses.replace(c, **{k: dtype for k in ("param_dtype", "dtype") if k in fields})

    if not arch.is_vlm:
        return cast(cfg)
    towers = {f.name: cast(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
              if dataclasses.is_dataclass(getattr(cfg, f.name))}
    return dataclasses.replace(cfg, **towers)


def abstract(arch: Architecture, cfg):
    """(graphdef, abstract state) of the family's NNX module: shapes and dtypes, nothing allocated."""
    return nnx.split(nnx.eval_shape(lambda: arch.module(cfg, nnx.Rngs(0))))


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(buf: jax.Array, layer: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(buf, layer.astype(buf.dtype), i, 0)


def _zeros(shape, dtype, where) -> jax.Array:
    """A buffer allocated on the device(s) of `where` (a sharding), never on the host first."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=where)()


def _parameters(arch: Architecture, cfg, src: str | os.PathLike):
    """Per parameter of the HF directory, in the order of its plan: (path, shape, dtype, layers), where `layers`
    yields (layer index or None, the stored tensor transformed to our layout) one tensor at a time, each checked
    against the shape the config expects (one-line errors). A tensor is a memory-mapped view where its transform
    allows, so nothing is read before it is used."""
    _, state = abstract(arch, cfg)
    want = hf.flatten(nnx.to_pure_dict(state))
    index = hf.tensor_index(src)
    read = hf.tensor_reader(index)
    head_dim = arch.text_config(cfg).head_dim

    def layers(path, items, shape):
        for name, i, tr in items:
            w = tr.to_ours(read(name), head_dim)
            expected = shape if i is None else shape[1:]
            if tuple(w.shape) != expected:
                raise ValueError(f"{os.fspath(src)}: {name} gives '{path}' a shape {tuple(w.shape)}, the config "
                                 f"expects {expected}")
            yield i, w
            del w

    for path, items in arch.plan(cfg, list(index)).items():
        if path not in want:
            raise ValueError(f"{os.fspath(src)}: '{path}' is absent from the config")
        shape = tuple(want[path].shape)
        yield path, shape, want[path].dtype, layers(path, items, shape)


def streamed_leaves(arch: Architecture, cfg, src: str | os.PathLike, shardings: dict | None = None
                    ) -> Iterator[tuple[str, jax.Array]]:
    """The HF directory's parameters as (path, device array in the config's param dtype), one at a time.

    A per-layer parameter is assembled on the device(s): its buffer is allocated there (sharded by
    `shardings[path]` when given) and each layer's tensor is read, transformed and written into it before the
    next is read, so on an accelerator host memory holds one stored tensor and its transform at a time."""
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    for path, shape, dtype, layers in _parameters(arch, cfg, src):
        where = (shardings or {}).get(path, default)
        layer_where = where
        if isinstance(where, jax.sharding.NamedSharding):
            layer_where = jax.sharding.NamedSharding(where.mesh, jax.sharding.PartitionSpec(*where.spec[1:]))
        placed = None
        for i, w in layers:
            if i is None:
                placed = sharding.place(np.asarray(w, dtype), where)
            else:
                placed = _zeros(shape, dtype, where) if placed is None else placed
                placed = _set_layer(placed, sharding.place(np.asarray(w, dtype), layer_where), jnp.int32(i))
            del w
        yield path, placed
        del placed


def _write(dst, at: tuple, w: np.ndarray, dtype, chunk: list[int]) -> None:
    """Writes tensor `w` at index `at` of a checkpoint array chunk by chunk (`chunk`: the chunk shape of `w`'s
    dimensions), so only one chunk is copied out of the memory map at a time."""
    if w.ndim == 0:
        dst[at] = np.asarray(w, dtype)
        return
    for start in itertools.product(*(range(0, n, c) for n, c in zip(w.shape, chunk, strict=True))):
        block = tuple(slice(lo, lo + c) for lo, c in zip(start, chunk, strict=True))
        dst[(*at, *block)] = np.asarray(w[block], dtype)


def build_streamed(arch: Architecture, cfg, leaves: Iterator[tuple[str, Any]]):
    """The family's module holding `leaves` (placed arrays, `streamed_leaves`)."""
    graphdef, state = abstract(arch, cfg)
    nnx.replace_by_pure_dict(state, hf.unflatten(dict(leaves)))
    return nnx.merge(graphdef, state)


def _copy_processor_files(src: str, out: str) -> None:
    files = [f for f in PROCESSOR_FILES if os.path.isfile(os.path.join(src, f))]
    if files:
        os.makedirs(os.path.join(out, PROCESSOR_DIR), exist_ok=True)
        for f in files:
            shutil.copy(os.path.join(src, f), os.path.join(out, PROCESSOR_DIR, f))


def convert_hf(src: str | os.PathLike, out: str | os.PathLike, *, dtype: str | None = None, overwrite: bool = False,
               progress: bool = False) -> str:
    """An HF directory (text LM or VLM, sharded or not) -> our checkpoint, streamed: each stored tensor is read,
    transformed and written (`configs.checkpoint.Writer`) in slabs of whole chunks before the next is read, so
    host memory holds about one stored tensor (a tensor never spans shards: at most the largest shard) whatever
    the model's size. Returns the checkpoint's path."""
    from tqdm.auto import tqdm


    src = os.path.abspath(os.fspath(src))
    if not hf.is_hf_dir(src):
        raise ValueError(f"{src} is not an HF model directory (expected config.json and model.safetensors)")
    arch, cfg = architectures.of_hf_dir(src)
    cfg = with_dtype(arch, cfg, dtype)
    provenance = {"source": src, "source_format": "hf"}
    if arch.is_vlm:
        config, kind = {"architecture": arch.name, "model": cfg.to_json()}, VLM_KIND
    else:
        config, kind = cfg, lm_checkpoint.KIND
    params = _parameters(arch, cfg, src)
    if progress:
        n = len(arch.plan(cfg, list(hf.tensor_index(src))))
        params = tqdm(params, total=n, desc=f"converting {os.path.basename(src)}", unit="param", leave=False)
    with checkpoint.Writer(out, overwrite=overwrite) as writer:
        for name, shape, dtype, layers in params:
            dst, chunk = None, None
            for i, w in layers:
                if dst is None:
                    stacked = i is not None
                    dst = writer.create(name, shape, dtype, stacked=stacked)
                    chunk = checkpoint.Writer.chunk_shape(shape, dtype.itemsize, stacked)
                at = () if i is None else (i,)
                _write(dst, at, w, dtype, chunk[len(at):])
                del w
        path = writer.commit(config=config, kind=kind, provenance=provenance)
    tok = hf.read_tokenizer(src)
    if tok is not None:
        tok.save_pretrained(os.path.join(path, lm_checkpoint.TOKENIZER_DIR))
    _copy_processor_files(src, path)
    checkpoint.write_sums(path)  # the tokenizer and processor files too
    return path


def save(model, out: str | os.PathLike, *, overwrite: bool = False, provenance: dict | None = None) -> str:
    """An in-memory `VisionLM` (trained or built here) -> our checkpoint, with its tokenizer and its processor
    directory's files. Returns the checkpoint's path."""

    arch = architectures.named(model.architecture)
    params = hf.flatten(nnx.to_pure_dict(nnx.state(model.module, nnx.Param)))
    with checkpoint.Writer(out, overwrite=overwrite) as writer:
        for name, value in params.items():
            writer.put(name, jax.device_get(value))
        path = writer.commit(config={"architecture": arch.name, "model": model.config.to_json()}, kind=VLM_KIND,
                             provenance=provenance or {"source": model.source or "in memory"})
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(os.path.join(path, lm_checkpoint.TOKENIZER_DIR))
    if model.processor_dir is not None:
        _copy_processor_files(model.processor_dir, path)
    checkpoint.write_sums(path)
    return path


#: `config["language_model"]` of a checkpoint that stores no language model: it is the shipped default target's.
DEFAULT_LM = "default"


#: The language-model parameters an adapter may keep of its own (a draft VLM's first layers of the default target,
#: trained, and their final norm); the embedding (and head) are always the default target's.
OWN_LM = ("blocks", "final_norm")


def save_adapter(out: str | os.PathLike, cfg, params: dict, tokenizer, processor_dir: str, *,
                 overwrite: bool = False, provenance: dict | None = None) -> str:
    """A LLaVA-OneVision trained around the shipped SmolLM2-135M-Instruct (`sage_jax.train_vlm`) -> our checkpoint
    of everything but its language model's embedding and head (tower, projector, image_newline; megabytes, not the
    LM's 540), marked `"language_model": "default"`: `load_checkpoint` takes the LM from the default target,
    checked against `cfg.text`. A draft VLM also stores `params["lm"]` = its own `blocks` and `final_norm` (`OWN_LM`):
    `cfg.text.n_layers` layers, trained from the default's first ones, under the default's embedding and head.
    Returns the checkpoint's path."""

    own_lm = sorted(params.get("lm", {}))
    if own_lm and own_lm != sorted(OWN_LM):
        raise ValueError(f"save_adapter stores a language model's {' and '.join(OWN_LM)} or none of it, got {own_lm}")
    with checkpoint.Writer(out, overwrite=overwrite) as writer:
        for name, value in hf.flatten(params).items():
            writer.put(name, np.asarray(jax.device_get(value)))
        config = {"architecture": "llava_onevision", "model": cfg.to_json(), "language_model": DEFAULT_LM}
        if own_lm:
            config["own_lm"] = list(OWN_LM)
        path = writer.commit(config=config, kind=VLM_KIND, provenance=provenance or {})
    tokenizer.save_pretrained(os.path.join(path, lm_checkpoint.TOKENIZER_DIR))
    _copy_processor_files(processor_dir, path)
    checkpoint.write_sums(path)
    return path


def read_config(path: str | os.PathLike) -> tuple[Architecture, Any]:
    """(family, config) of our VLM checkpoint."""
    meta = checkpoint.read_metadata(path)
    if meta.get("kind") != VLM_KIND:
        raise checkpoint.CheckpointError(f"{os.fspath(path)} holds a {meta.get('kind')!r} checkpoint, not a VLM")
    arch = architectures.named(meta["config"]["architecture"])
    return arch, arch.config_from_json(meta["config"]["model"])


def uses_default_lm(path: str | os.PathLike) -> bool:
    """Whether our VLM checkpoint holds only its own parameters around the shipped default target (`save_adapter`)."""
    return checkpoint.read_metadata(path)["config"].get("language_model") == DEFAULT_LM


def own_lm(path: str | os.PathLike) -> bool:
    """Whether a `save_adapter` checkpoint keeps its own language-model layers (`OWN_LM`: a draft VLM's)."""
    return bool(checkpoint.read_metadata(path)["config"].get("own_lm"))


def load_checkpoint(path: str | os.PathLike, *, dtype: str | None = None, mesh=None, language_model=None):
    """Our VLM checkpoint -> (family, config, module), restored straight onto `mesh` when given. `language_model`:
    (config, `Decoder`) of the default target, which completes a `save_adapter` checkpoint (`uses_default_lm`;
    `sage_jax.io.loader.load_vlm_checkpoint` passes it)."""
    arch, cfg = read_config(path)
    cfg = with_dtype(arch, cfg, dtype)
    if uses_default_lm(path):
        if language_model is None:
            raise checkpoint.CheckpointError(f"{os.fspath(path)} holds its own parameters around the default target; "
                                             f"load it with sage_jax.load")
        return arch, cfg, _with_default_lm(path, arch, cfg, mesh, *language_model)
    return arch, cfg, lm_checkpoint.restore_module(path, *abstract(arch, cfg), mesh)


def _check_default_lm(path, cfg, text_cfg) -> None:
    """CheckpointError unless `text_cfg` (the default target's) is the language model `save_adapter` saved around
    (one with its own layers: as many as the default's or fewer)."""
    free = ("param_dtype", "dtype", *(("n_layers",) if own_lm(path) else ()))
    want = {k: v for k, v in cfg.text.to_json().items() if k not in free}
    have = {k: v for k, v in text_cfg.to_json().items() if k not in free}
    if want != have or cfg.text.n_layers > text_cfg.n_layers:
        differ = sorted(k for k in want if want[k] != have.get(k)) or ["n_layers"]
        raise checkpoint.CheckpointError(f"{os.fspath(path)} was trained around another language model than the "
                                         f"default target (config differs in {', '.join(differ)})")


def _own_lm_abstract(pure_lm: dict) -> dict:
    return {k: v for k, v in pure_lm.items() if k in OWN_LM}


def load_serving(path: str | os.PathLike, *, dtype: str | None = None, mesh=None, language_model=None):
    """Our VLM checkpoint -> (family, config, module, the language model's serving form `serving_lm.LM`), that
    language model built in serving form while restoring (`lm_checkpoint.serving_from`), never in the checkpoint's
    layout: one copy of its weights, where `load_checkpoint` and then `VisionLM.serving` hold two.

    The module holds the vision tower and projector, read and placed array by array, and the language model's
    embedding, final norm and head, the serving form's own arrays; its layers are empty ([0]-shaped): a `VisionLM`
    made with the serving form (`sage_jax.io.loader.load_vision_serving`) runs them through it. `language_model`:
    the default target's serving form, which completes a `save_adapter` checkpoint (`uses_default_lm`)."""
    arch, cfg = read_config(path)
    cfg = with_dtype(arch, cfg, dtype)
    graphdef, state = abstract(arch, cfg)
    pure = nnx.to_pure_dict(state)
    own = {k: v for k, v in pure.items() if k != "lm"}
    reader = checkpoint.Reader(path)
    if uses_default_lm(path):
        if language_model is None:
            raise checkpoint.CheckpointError(f"{os.fspath(path)} holds its own parameters around the default target; "
                                             f"load it with sage_jax.load")
        _check_default_lm(path, cfg, language_model.cfg)
        lm = language_model
        if own_lm(path):  # its own first layers and final norm under the default's embedding and head
            own = {**own, "lm": _own_lm_abstract(pure["lm"])}
            checkpoint.check_fits(reader.meta, own)
            from sage_jax.models import serving_lm

            mine = hf.unflatten({k: jnp.asarray(np.asarray(reader.read("lm/" + k)).astype(a.dtype, copy=False))
                                 for k, a in hf.flatten(own["lm"]).items()})
            lm = serving_lm.serving_params(cfg.text, {"embed": language_model.embed, "lm_head": language_model.lm_head,
                                                      **mine})
            if mesh is not None:
                lm = jax.tree.map(lambda x: sharding.place(x, jax.sharding.NamedSharding(
                    mesh, jax.sharding.PartitionSpec())), lm)
            own = {k: v for k, v in own.items() if k != "lm"}
        else:
            checkpoint.check_fits(reader.meta, own)
    else:
        checkpoint.check_fits(reader.meta, pure)
        lm = lm_checkpoint.serving_from(reader, cfg.text, mesh, prefix="lm/")
    if mesh is None:
        dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        where = jax.tree.map(lambda _: dev, own)
    else:
        where = {k: v for k, v in nnx.to_pure_dict(sharding.state_shardings(state, mesh)).items() if k != "lm"}

    def read(key_path, a, at):
        key = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in key_path)
        return sharding.place(np.asarray(reader.read(key)).astype(a.dtype, copy=False), at)

    params = jax.tree_util.tree_map_with_path(read, own, where)
    empty = jax.tree.map(lambda a: jnp.zeros((0,), a.dtype), pure["lm"]["blocks"])
    params["lm"] = {"embed": lm.embed, "final_norm": lm.final_norm, "blocks": empty,
                    **({} if lm.lm_head is None else {"lm_head": lm.lm_head})}
    nnx.replace_by_pure_dict(state, params)
    return arch, cfg, nnx.merge(graphdef, state), lm


def _with_default_lm(path, arch: Architecture, cfg, mesh, text_cfg, decoder):
    """The module of a `save_adapter` checkpoint: its own parameters restored, the language model's from `decoder`
    (the default target, which must be the LM the checkpoint was trained around)."""
    _check_default_lm(path, cfg, text_cfg)
    graphdef, state = abstract(arch, cfg)
    pure = nnx.to_pure_dict(state)
    own = {k: v for k, v in pure.items() if k != "lm"}
    if own_lm(path):
        own["lm"] = _own_lm_abstract(pure["lm"])
    if mesh is None:
        dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        own = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), own)
    else:
        shard_of = {k: v for k, v in nnx.to_pure_dict(sharding.state_shardings(state, mesh)).items() if k != "lm"}
        own = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), own, shard_of)
    restored = checkpoint.restore(path, own)
    lm = {k: v for k, v in decoder.params().items() if k not in OWN_LM} if own_lm(path) else decoder.params()
    nnx.replace_by_pure_dict(state, {**restored, "lm": {**lm, **restored.get("lm", {})}})
    return nnx.merge(graphdef, state)


def load_hf(path: str | os.PathLike, *, dtype: str | None = None, mesh=None):
    """An HF VLM directory -> (family, config, module), streamed tensor by tensor onto `mesh` (or the default
    device)."""
    arch, cfg = architectures.of_hf_dir(path)
    cfg = with_dtype(arch, cfg, dtype)
    shardings = None
    if mesh is not None:
        shardings = hf.flatten(nnx.to_pure_dict(sharding.state_shardings(abstract(arch, cfg)[1], mesh)))
    return arch, cfg, build_streamed(arch, cfg, streamed_leaves(arch, cfg, path, shardings))


def processor_dir(path: str | os.PathLike, source_format: str) -> str | None:
    """Where the image processor's files are: the HF directory itself, or our checkpoint's processor/."""
    d = os.fspath(path) if source_format == "hf" else os.path.join(os.fspath(path), PROCESSOR_DIR)
    return d if os.path.isfile(os.path.join(d, "preprocessor_config.json")) else None
