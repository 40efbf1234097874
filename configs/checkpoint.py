"""The project's one checkpoint format, shared by `sage_jax` and `pgla_jax`.

Layout of a checkpoint directory::

    CKPT/
      metadata.json     {"format": "sage-jax-checkpoint", "format_version": 1, "kind": ..., "config": {...},
                         "config_class": "pkg.module.Class", "provenance": {...}, "params": {path: [shape, dtype]}}
      params/           Orbax (OCDBT) checkpoint of a pure nested dict of arrays
      ...               optional extra files (e.g. tokenizer.json) written by the caller

The arrays are a plain nested ``dict[str, dict | Array]``, so downstream code restores them with nothing but
``jax`` and ``orbax.checkpoint``::

    ck = orbax.checkpoint.StandardCheckpointer()
    md = ck.metadata(os.path.abspath("CKPT/params")).item_metadata.tree   # shapes and dtypes
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), md)
    tree = ck.restore(os.path.abspath("CKPT/params"), target)

(A target is needed whenever the saving topology differs, e.g. a checkpoint saved sharded over 8 devices.)
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

FORMAT = "sage-jax-checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
PARAMS_DIR = "params"


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, or does not fit the requested config (one-line message)."""


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in sorted(tree):
        if not isinstance(key, str):
            raise CheckpointError(f"checkpoint keys must be strings, got {key!r} under '{prefix or '/'}'")
        value = tree[key]
        path = f"{prefix}/{key}" if prefix else key
        if isinstance(value, Mapping):
            out.update(_flatten(value, path))
        else:
            out[path] = value
    return out


def config_to_json(config: Any) -> dict[str, Any]:
    """A (possibly nested, frozen) dataclass or a mapping -> JSON-able dict."""
    if config is None:
        return {}
    if dataclasses.is_dataclass(config):
        config = dataclasses.asdict(config)
    return json.loads(json.dumps(dict(config), default=lambda o: list(o) if isinstance(o, tuple) else str(o)))


def _metadata(kind: str, config: Any, provenance: Mapping[str, Any] | None, shapes: Mapping[str, Any]) -> dict:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "config_class": "" if config is None or not dataclasses.is_dataclass(config)
        else f"{type(config).__module__}.{type(config).__qualname__}",
        "config": config_to_json(config),
        "provenance": {
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "jax": jax.__version__,
            "python": platform.python_version(),
            **dict(provenance or {}),
        },
        "params": dict(shapes),
    }


def _refuse_existing(path: str, overwrite: bool) -> None:
    if os.path.exists(os.path.join(path, PARAMS_DIR)) or os.path.exists(os.path.join(path, METADATA_FILE)):
        if not overwrite:
            raise CheckpointError(f"{path} already holds a checkpoint; pass overwrite=True to replace it")


def save(
    path: str | os.PathLike,
    params: Mapping[str, Any],
    *,
    config: Any = None,
    kind: str = "",
    provenance: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> str:
    """Writes `params` (a pure nested dict of arrays, possibly sharded) and `metadata.json` to `path`.

    Refuses to replace an existing checkpoint unless `overwrite=True`. Returns the absolute path.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    flat = _flatten(params)
    _refuse_existing(path, overwrite)
    os.makedirs(path, exist_ok=True)
    shapes = {k: [list(np.shape(v)), str(getattr(v, "dtype", np.asarray(v).dtype))] for k, v in flat.items()}
    meta = _metadata(kind, config, provenance, shapes)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(path, PARAMS_DIR), dict(params), force=overwrite)
    ckptr.wait_until_finished()
    with open(os.path.join(path, METADATA_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    return path


def save_streamed(
    path: str | os.PathLike,
    leaves: Iterable[tuple[str, Any]],
    *,
    config: Any = None,
    kind: str = "",
    provenance: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> str:
    """Writes the same checkpoint as `save`, one leaf at a time: `leaves` yields ("a/b/c", array) pairs and
    each array is written (Orbax partial save) before the next is asked for, so a model need never be in memory
    whole. The checkpoint appears at `path` only once complete. Returns the absolute path."""
    import shutil
    import tempfile

    from orbax.checkpoint.experimental.v1 import partial

    path = os.path.abspath(os.fspath(path))
    _refuse_existing(path, overwrite)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".partial-", dir=parent)
    try:
        shapes: dict[str, Any] = {}
        for key, array in leaves:
            shapes[key] = [list(np.shape(array)), str(getattr(array, "dtype", np.asarray(array).dtype))]
            *parents, leaf = key.split("/")
            tree: dict[str, Any] = {leaf: array}
            for name in reversed(parents):
                tree = {name: tree}
            partial.save(os.path.join(tmp, "orbax"), tree)
            del array, tree
        if not shapes:
            raise CheckpointError(f"nothing to save at {path}")
        partial.finalize(os.path.join(tmp, "orbax"))
        # A partial save finalizes to an Orbax checkpoint whose pytree lies under `state/`: that directory is
        # exactly what `save` writes as params/.
        os.makedirs(os.path.join(tmp, "ckpt"))
        os.replace(os.path.join(tmp, "orbax", "state"), os.path.join(tmp, "ckpt", PARAMS_DIR))
        # What `StandardCheckpointer.save` writes beside the pytree (else Orbax warns on every restore).
        now = int(datetime.datetime.now(datetime.UTC).timestamp() * 1e9)
        with open(os.path.join(tmp, "ckpt", PARAMS_DIR, "_CHECKPOINT_METADATA"), "w") as f:
            json.dump({"item_handlers": "orbax.checkpoint._src.handlers.standard_checkpoint_handler."
                       "StandardCheckpointHandler", "metrics": {}, "performance_metrics": {},
                       "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now, "custom_metadata": {}}, f)
        with open(os.path.join(tmp, "ckpt", METADATA_FILE), "w") as f:
            json.dump(_metadata(kind, config, provenance, dict(sorted(shapes.items()))), f, indent=1)
        if os.path.exists(path):
            shutil.rmtree(path)  # overwrite=True (checked above)
        os.replace(os.path.join(tmp, "ckpt"), path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's `metadata.json`, validated; `CheckpointError` if `path` is not one of ours."""
    path = os.path.abspath(os.fspath(path))
    file = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(file) or not os.path.isdir(os.path.join(path, PARAMS_DIR)):
        raise CheckpointError(f"{path} is not a checkpoint (expected {METADATA_FILE} and {PARAMS_DIR}/)")
    try:
        with open(file) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a {FORMAT} (format={meta.get('format')!r})")
    if int(meta.get("format_version", -1)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {meta['format_version']}; this library reads up to {FORMAT_VERSION}"
        )
    return meta


def check_fits(meta: Mapping[str, Any], abstract: Mapping[str, Any]) -> None:
    """Raises a one-line `CheckpointError` naming the first key or shape that differs."""
    stored = {k: tuple(v[0]) for k, v in meta["params"].items()}
    wanted = {k: tuple(np.shape(v)) for k, v in _flatten(abstract).items()}
    for key in sorted(set(stored) | set(wanted)):
        if key not in stored:
            raise CheckpointError(f"checkpoint does not fit the config: key '{key}' is missing from the checkpoint")
        if key not in wanted:
            raise CheckpointError(f"checkpoint does not fit the config: unexpected key '{key}' in the checkpoint")
        if stored[key] != wanted[key]:
            raise CheckpointError(
                f"checkpoint does not fit the config: '{key}' has shape {stored[key]} in the checkpoint, "
                f"the config expects {wanted[key]}"
            )


def restore(path: str | os.PathLike, abstract: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Restores the params tree.

    `abstract`: a nested dict of `jax.ShapeDtypeStruct` (with `.sharding` to restore straight onto a mesh,
    e.g. from `configs.sharding.state_shardings`); it is checked against the checkpoint first. Without it,
    arrays come back replicated on the default device with their stored dtypes.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    meta = read_metadata(path)
    ckptr = ocp.StandardCheckpointer()
    if abstract is None:
        md = ckptr.metadata(os.path.join(path, PARAMS_DIR))
        md = getattr(getattr(md, "item_metadata", md), "tree", md)
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), md)
    check_fits(meta, abstract)
    return ckptr.restore(os.path.join(path, PARAMS_DIR), dict(abstract))
