"""The project's one checkpoint format, shared by `sage_jax` and `pgla_jax`.

Layout of a checkpoint directory::

    CKPT/
      metadata.json     {"format": "sage-jax-checkpoint", "format_version": 1, "kind": ..., "config": {...},
                         "config_class": "pkg.module.Class", "provenance": {...}, "params": {path: [shape, dtype]}}
      params/           Orbax (OCDBT) checkpoint of a pure nested dict of arrays
      ...               optional extra files (e.g. tokenizer.json) written by the caller
      SHA256SUMS        `sha256  relative/path` of every file (but the rewritable acceptance.json): written with
                        the checkpoint (`write_sums`; a caller that adds files writes it again), checked by every
                        `restore` and `Reader` (`verify_sums`), so damaged or changed bytes are one line, not a crash
                        or, worse, a model that runs on them

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

import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from configs import cli, provenance

FORMAT = "sage-jax-checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
PARAMS_DIR = "params"


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, or does not fit the requested config (one-line message)."""


SUMS_FILE = "SHA256SUMS"
#: Files a checkpoint folder may rewrite after it is written (a draft's measured acceptance): never summed.
REWRITABLE = ("acceptance.json",)


def cache_dir() -> str:
    """This project's cache ($SAGE_JAX_CACHE, else ~/.cache/sage_jax): compiled programs, remembered digests."""
    return os.environ.get("SAGE_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sage_jax")


def stamp(path: str) -> str:
    """Identity of a file's current contents without reading it: path, inode, size, mtime and ctime. The ctime moves
    with every write and no call sets it back (`os.utime` restores an mtime, not a ctime), so bytes changed in place
    at the same size and mtime still give a new stamp."""
    st = os.stat(path)
    key = f"{os.path.realpath(path)}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def verified_sha256(path: str | os.PathLike, remember: bool = True) -> str:
    """sha256 of `path`, remembered in the cache dir per `stamp` so it is read once (`remember=False`: read now and
    not remembered, for files that live a short while, e.g. a training run's checkpoints)."""
    path = os.fspath(path)
    if not remember:
        return provenance.file_sha256(path)
    memo = os.path.join(cache_dir(), "sha256", stamp(path) + ".json")
    if os.path.isfile(memo):
        with open(memo) as f:
            return json.load(f)["sha256"]
    digest = provenance.file_sha256(path)
    try:
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        with open(memo, "w") as f:
            json.dump({"path": os.path.realpath(path), "sha256": digest}, f)
    except OSError:  # an unwritable cache only costs a re-read next time
        pass
    return digest


def summed_files(path: str | os.PathLike) -> list[str]:
    """The files of a checkpoint folder its SHA256SUMS lists: every one (sorted relative paths) but itself and the
    rewritable ones."""
    path = os.fspath(path)
    rels = (os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)
    return sorted(r for r in rels if r != SUMS_FILE and os.path.basename(r) not in REWRITABLE)


def write_sums(path: str | os.PathLike, remember: bool = True) -> str:
    """Writes `path`/SHA256SUMS (`sha256  relative/path` per file of `summed_files`), atomically; returns it."""
    path = os.fspath(path)
    text = "".join(f"{verified_sha256(os.path.join(path, rel), remember)}  {rel}\n" for rel in summed_files(path))
    file = os.path.join(path, SUMS_FILE)
    with cli.written(file) as f:
        f.write(text)
    return file


def read_sums(path: str | os.PathLike) -> dict[str, str] | None:
    """relative path → sha256 from `path`/SHA256SUMS; None where the folder has none (written before sums)."""
    file = os.path.join(os.fspath(path), SUMS_FILE)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return dict(reversed(ln.split("  ", 1)) for ln in f.read().splitlines() if ln.strip())


def verify_sums(path: str | os.PathLike, remember: bool = True) -> None:
    """`CheckpointError` (one line) unless every file `path`/SHA256SUMS lists is there with that digest (digests
    remembered per file stamp: a second load reads nothing). Files it does not list (added later, e.g. a
    datastore beside a draft) are not its business; a folder without sums passes."""
    path = os.fspath(path)
    want = read_sums(path)
    for rel, digest in (want or {}).items():
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing: the checkpoint {path} is incomplete (its {SUMS_FILE} lists it)")
        if verified_sha256(file, remember) != digest:
            raise CheckpointError(f"{file} does not match its sha256 in {os.path.join(path, SUMS_FILE)}: the "
                                  "checkpoint is damaged or was changed")


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
    stacked: tuple[str, ...] = (),
) -> str:
    """Writes `params` (a pure nested dict of arrays, possibly sharded) and `metadata.json` to `path`.

    Refuses to replace an existing checkpoint unless `overwrite=True`. Returns the absolute path. `stacked`: the
    top-level keys whose arrays hold one layer per index of their leading axis (an LM's "blocks"): stored one layer
    per chunk, as `Writer` stores them, so that a `Reader` reads a layer without decoding its neighbours; other
    arrays in chunks of at most `Writer.CHUNK_BYTES`.

    In a multi-host run every process calls `save` with the same `path`, which must be one folder all hosts see (a
    shared file system): Orbax writes each array's shards from the hosts holding them, an array held whole by every
    process (a numpy or single-host array, the same on every host) once, and process 0 writes `metadata.json`.
    """
    import orbax.checkpoint as ocp

    from configs import sharding

    path = os.path.abspath(os.fspath(path))
    flat = _flatten(params)
    _refuse_existing(path, overwrite)
    if jax.process_count() > 1:
        # Orbax refuses host-local jax arrays in a multi-host save: such a value is written by process 0 as numpy.
        params = jax.tree.map(lambda v: np.asarray(v) if isinstance(v, jax.Array) and v.is_fully_addressable else v,
                              dict(params))
        sharding.barrier(f"checkpoint {path}: checked")  # no host writes before every host has looked
    os.makedirs(path, exist_ok=True)
    shapes = {k: [list(np.shape(v)), str(getattr(v, "dtype", np.asarray(v).dtype))] for k, v in flat.items()}
    meta = _metadata(kind, config, provenance, shapes)
    ckptr = ocp.StandardCheckpointer()
    save_args = {k: jax.tree.map(lambda _, k=k: ocp.SaveArgs(chunk_byte_size=Writer.CHUNK_BYTES,
                                                            shard_axes=(0,) if k in stacked else ()), v)
                 for k, v in dict(params).items()}
    ckptr.save(os.path.join(path, PARAMS_DIR), dict(params), save_args=save_args, force=overwrite)
    ckptr.wait_until_finished()
    sharding.barrier(f"checkpoint {path}: params written")  # every host's shards on disk before they are summed
    if sharding.is_primary():
        with open(os.path.join(path, METADATA_FILE), "w") as f:
            json.dump(meta, f, indent=1)
        write_sums(path)
    sharding.barrier(f"checkpoint {path}: written")  # no host reads it back before the metadata is there
    return path


class Writer:
    """Writes a checkpoint array by array and slice by slice, so that nothing bigger than a slice need be in
    memory: the same checkpoint `save` writes (Orbax restores it, plain `orbax.checkpoint` included).

    The arrays go through tensorstore in the storage Orbax uses (zarr3 arrays in one OCDBT database, named by
    their dotted tree path) and `params/_METADATA` lists the tree. The checkpoint appears at `path` only on
    `commit`; leaving the `with` block without it (an error) removes everything written::

        with checkpoint.Writer(path) as w:
            w.create("blocks/wq", (L, D, N, H), np.float32)[i] = layer_i      # any index tensorstore takes
            w.put("embed", embed)
            w.commit(config=cfg, kind="lm")
    """

    #: Upper bound of one stored chunk: reads and writes move whole chunks.
    CHUNK_BYTES = 16 << 20

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = False):
        self.path = os.path.abspath(os.fspath(path))
        _refuse_existing(self.path, overwrite)
        # Staged beside `path` and moved there by `commit` (`cli.replacing`); dropped unless committed.
        self._staging = contextlib.ExitStack()
        self._tmp = self._staging.enter_context(cli.replacing(self.path))
        self._params = os.path.join(self._tmp, PARAMS_DIR)
        os.makedirs(self._params)
        self._shapes: dict[str, Any] = {}
        self._arrays: dict[str, Any] = {}
        self._context = None

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc) -> None:
        self._arrays.clear()
        if exc[0] is None:  # left without `commit`: nothing appears at `path`
            exc = (CheckpointError, CheckpointError(f"{self.path} was not committed"), None)
        self._staging.__exit__(*exc)  # a no-op after `commit`

    @classmethod
    def chunk_shape(cls, shape: tuple[int, ...], itemsize: int, stacked: bool = False) -> list[int]:
        """The largest dimension halved until a chunk fits `CHUNK_BYTES`; a `stacked` array (layers on its
        leading axis, written one layer at a time) keeps one layer per chunk."""
        chunk = [int(n) for n in shape]
        if stacked and chunk:
            chunk[0] = 1
        while chunk and math.prod(chunk) * itemsize > cls.CHUNK_BYTES:
            i = max(range(len(chunk)), key=lambda j: chunk[j])
            chunk[i] = -(-chunk[i] // 2)
        return chunk

    def create(self, key: str, shape, dtype, *, stacked: bool = False):
        """A writable tensorstore array for parameter `key` ("a/b/c"), zero until written (`chunk_shape`)."""
        import tensorstore as ts

        if key in self._shapes:
            raise CheckpointError(f"'{key}' written twice")
        dtype, shape = np.dtype(dtype), tuple(int(n) for n in shape)
        self._shapes[key] = [list(shape), dtype.name]
        if self._context is None:
            self._context = ts.Context()
        spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{self._params}",
                                               "path": key.replace("/", ".")},
                "metadata": {"shape": list(shape), "data_type": dtype.name,
                             "chunk_grid": {"name": "regular", "configuration": {
                                 "chunk_shape": self.chunk_shape(shape, dtype.itemsize, stacked)}}},
                "create": True, "store_data_equal_to_fill_value": True}
        array = ts.open(spec, context=self._context).result()
        self._arrays[key] = array
        return _Committing(array)

    def put(self, key: str, value) -> None:
        """Writes a whole array (numpy, or a fully addressable jax array)."""
        value = np.asarray(value)
        self.create(key, value.shape, value.dtype)[...] = value

    def commit(self, *, config: Any = None, kind: str = "", provenance: Mapping[str, Any] | None = None) -> str:
        """Writes the tree and metadata files and moves the checkpoint to `path`. Returns the path."""
        if not self._shapes:
            raise CheckpointError(f"nothing to save at {self.path}")
        self._arrays.clear()
        tree = {str(tuple(k.split("/"))): {"key_metadata": [{"key": part, "key_type": 2} for part in k.split("/")],
                                           "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False}}
                for k in sorted(self._shapes)}
        with open(os.path.join(self._params, "_METADATA"), "w") as f:
            json.dump({"tree_metadata": tree, "use_ocdbt": True, "use_zarr3": True,
                       "store_array_data_equal_to_fill_value": True, "custom_metadata": None}, f)
        # What `StandardCheckpointer.save` writes beside the pytree (else Orbax warns on every restore).
        now = int(datetime.datetime.now(datetime.UTC).timestamp() * 1e9)
        with open(os.path.join(self._params, "_CHECKPOINT_METADATA"), "w") as f:
            json.dump({"item_handlers": "orbax.checkpoint._src.handlers.standard_checkpoint_handler."
                       "StandardCheckpointHandler", "metrics": {}, "performance_metrics": {},
                       "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now, "custom_metadata": {}}, f)
        with open(os.path.join(self._tmp, METADATA_FILE), "w") as f:
            json.dump(_metadata(kind, config, provenance, dict(sorted(self._shapes.items()))), f, indent=1)
        write_sums(self._tmp)  # relative paths: valid after the move below
        self._staging.close()  # in place of what was there (overwrite=True, checked on creation)
        return self.path


class _Committing:
    """A tensorstore array whose item assignment waits until the slice is stored (its memory is then free)."""

    def __init__(self, array):
        self._array = array

    def __setitem__(self, index, value) -> None:
        self._array[index].write(np.asarray(value)).result()


class Reader:
    """Reads a checkpoint's arrays whole or slice by slice through tensorstore, from the storage Orbax wrote (zarr or
    zarr3 arrays in one OCDBT database), so that a loader can build another layout of the weights piece by piece
    with only that piece in host memory beside what it has built (`sage_jax.io.lm_checkpoint.load_serving`). A slice
    costs the chunks it touches: `Writer` stores a stacked array one layer per chunk, `save` in chunks of at most
    `Writer.CHUNK_BYTES` (a checkpoint saved before that may hold an array in one chunk: still read right, at the
    cost of decoding it whole for each slice).

        reader = checkpoint.Reader(path)
        wq_3 = reader.read("blocks/wq", 3)          # layer 3 of a stacked [L, D, N, H] array, as numpy
    """

    def __init__(self, path: str | os.PathLike):
        import tensorstore as ts

        self.path = os.path.abspath(os.fspath(path))
        self.meta = read_metadata(self.path)
        verify_sums(self.path)
        self._params = os.path.join(self.path, PARAMS_DIR)
        try:
            with open(os.path.join(self._params, "_METADATA")) as f:
                self._zarr3 = bool(json.load(f).get("use_zarr3"))
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self._params}/_METADATA is unreadable: {e}") from None
        # No cache: a chunk read for one slice is not kept for the next (memory is what this reader saves).
        self._context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
        self._arrays: dict[str, Any] = {}

    def read(self, key: str, index: Any = ()) -> np.ndarray:
        """`key`'s array, or its slice `index` (anything numpy indexing takes on the stored shape), as numpy in the
        stored dtype."""
        with read_errors(self.path):
            return np.asarray(self._array(key)[index].read().result())

    def chunk_shape(self, key: str) -> tuple[int, ...]:
        """The shape of `key`'s stored chunks: a read costs every chunk it touches, whole."""
        return tuple(int(n) for n in self._array(key).chunk_layout.read_chunk.shape)

    def _array(self, key: str):
        import tensorstore as ts

        if key not in self.meta["params"]:
            raise CheckpointError(f"{self.path} holds no array '{key}'")
        if key not in self._arrays:
            spec = {"driver": "zarr3" if self._zarr3 else "zarr",
                    "kvstore": {"driver": "ocdbt", "base": f"file://{self._params}", "path": key.replace("/", ".")}}
            with read_errors(self.path):
                self._arrays[key] = ts.open(spec, context=self._context, open=True, read=True).result()
        return self._arrays[key]


@contextlib.contextmanager
def read_errors(path: str | os.PathLike, hint: str = "") -> Iterator[None]:
    """Orbax's ways of saying that what it reads under `path` is truncated or damaged (ValueError, OSError,
    KeyError, a bare Exception from its array reader: the first of 200 lines) as one `CheckpointError` naming
    `path`, plus `hint` (what to do). Only Orbax's reading calls go in the block, so that nothing else is blamed on
    the files."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - tensorstore's read errors reach us as a bare Exception
        if type(e) is Exception and e.__cause__ is not None:  # the reader's wrapper: what it wraps says what broke
            e = e.__cause__
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"the checkpoint {os.fspath(path)} is damaged or incomplete ({line}){hint}") from None


def step_manager(path: str | os.PathLike, *, read_only: bool = False, max_to_keep: int = 2) -> Any:
    """An Orbax `CheckpointManager` of a training run's steps in `path` (created unless `read_only`; the
    `max_to_keep` newest kept). Read-only (listing or exporting steps, possibly while the run trains), Orbax's
    warnings that it is read-only stay out of the user's terminal: they are about the options asked for."""
    import logging

    import orbax.checkpoint as ocp

    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR if read_only else level)
    try:
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=not read_only, read_only=read_only)
        return ocp.CheckpointManager(os.fspath(path), options=options)
    finally:
        absl.setLevel(level)


def step_folder(mngr: Any, step: int) -> str:
    """The folder of training checkpoint `step` of an Orbax `CheckpointManager` (its default step names)."""
    return os.path.join(os.fspath(mngr.directory), str(step))


def seal_step(mngr: Any, step: int) -> None:
    """Waits for `mngr`'s save of `step` and writes SHA256SUMS into its folder: a training run's checkpoints carry
    their sums as every other checkpoint does, so a resume (`restore_step`) refuses damaged bytes in one line
    instead of handing them to Orbax."""
    mngr.wait_until_finished()
    if jax.process_index() == 0:  # one writer of a shared folder (every process of a multi-host run waited)
        write_sums(step_folder(mngr, step), remember=False)


def restore_step(mngr: Any, step: int, args: Any, verify: bool = True) -> Any:
    """`mngr.restore(step, args=args)` after checking the step's sums (a step sealed before the sums existed
    passes; `verify=False`: checked already): damaged or missing bytes are one `CheckpointError` that says how to
    resume anyway."""
    path = step_folder(mngr, step)
    hint = f"; delete {path} to resume from the step before it, or start over"  # the manager keeps earlier steps
    try:
        if verify:
            verify_sums(path, remember=False)
    except CheckpointError as e:
        raise CheckpointError(f"{e}{hint}") from None
    with read_errors(path, hint):
        return mngr.restore(step, args=args)


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
    arrays come back on this process's first device with their stored dtypes (every process of a multi-host run
    then holds the whole of each).
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    meta = read_metadata(path)
    verify_sums(path)
    ckptr = ocp.StandardCheckpointer()
    with read_errors(path):  # a folder without sums can still be truncated or damaged
        if abstract is None:
            md = ckptr.metadata(os.path.join(path, PARAMS_DIR))
            md = getattr(getattr(md, "item_metadata", md), "tree", md)
            dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # jax.devices()[0] is process 0's
            abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), md)
        check_fits(meta, abstract)
        return ckptr.restore(os.path.join(path, PARAMS_DIR), dict(abstract))
