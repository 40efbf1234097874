"""Compiled decoding loops kept on disk, so that a later process loads them instead of tracing them again.

XLA's persistent compilation cache (`configs.cli.use_compilation_cache`) spares a process the XLA compile, but it
still traces and lowers each loop to find the cache key: on a CPU about 1.5 s for a SAGE loop against 1 s for plain
decoding, more than the loop's load. `Store` keeps the executables themselves (`jax.experimental.
serialize_executable`), keyed by everything that decides them: this project's source, jax and jaxlib, the device,
the flags that change lowering, the engine's configuration key and the arguments' shapes, dtypes and placements.
A key that misses compiles as before, with XLA's cache off (`fresh`), and writes its entry (atomically); an entry
that does not load is compiled again and rewritten. For single-device engines (`Engine.executables`; the generate
command sets it).

Loading an entry takes about as long as tracing would have (0.5 s for a plain loop on a CPU, 0.8 s for SAGE's),
but it needs no weights: `Store.prefetch` loads, on a thread, the entries that the last command with the same
settings used, while the process reads its checkpoints (deserialization releases the GIL). A guess that misses costs
only that thread's work.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import os
import pickle
from collections.abc import Callable
from typing import Any

import jax

from configs import cli

#: Bumped when what an entry holds changes.
FORMAT = 1
#: The packages whose source decides a compiled loop.
_PACKAGES = ("sage_jax", "configs", "pallas_kernels", "cpu_kernels")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def fingerprint() -> str:
    """sha256 of what every compiled loop here depends on besides its own arguments: the packages' source files,
    jax / jaxlib, the backend and its devices, XLA_FLAGS, the jax flags that change lowering, and the CPU's
    instruction-set flags (an executable built for one CPU may not run on another)."""
    import jaxlib

    h = hashlib.sha256()
    for pkg in _PACKAGES:
        for d, _, files in sorted(os.walk(os.path.join(_ROOT, pkg))):
            for f in sorted(files):
                if f.endswith((".py", ".cc")):
                    path = os.path.join(d, f)
                    h.update(os.path.relpath(path, _ROOT).encode())
                    with open(path, "rb") as fh:
                        h.update(fh.read())
    dev = jax.devices()[0]
    flags = (jax.__version__, jaxlib.__version__, dev.platform, dev.device_kind, jax.device_count(),
             os.environ.get("XLA_FLAGS", ""), jax.config.jax_enable_x64, str(jax.config.jax_default_matmul_precision))
    h.update(repr(flags).encode())
    try:
        with open("/proc/cpuinfo") as fh:
            h.update(next((ln for ln in fh if ln.startswith("flags")), "").encode())
    except OSError:
        pass
    return h.hexdigest()


def key(name: str, config: Any, args: Any) -> str:
    """The entry of `name` compiled for `config` (a repr-able static key) and `args` (a pytree of arrays)."""
    leaves, tree = jax.tree.flatten(args)
    avals = [(tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves]
    text = repr((FORMAT, fingerprint(), name, config, str(tree), avals))
    return hashlib.sha256(text.encode()).hexdigest()


@contextlib.contextmanager
def fresh():
    """Compiles with XLA's persistent cache off: an executable that cache hands back serializes without its object
    code, and the entry would fail when run. (jax decides once per process whether the cache is used; resetting
    it makes the flag count, here and again after.)"""
    from jax.experimental.compilation_cache import compilation_cache

    old = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", old)
        compilation_cache.reset_cache()


class Store:
    """Executables in `directory`, one file per key; past `keep` entries the least recently written go (every
    change of this project's source makes new keys)."""

    #: How many of the keys a hint names are loaded ahead (a command uses one loop, two with `--compare`).
    AHEAD = 2

    def __init__(self, directory: str, keep: int = 16):
        self.directory, self.keep = directory, keep
        self._hint: str | None = None
        self._used: list[str] = []  # the keys this process asked for, in order: what the hint's next run will want
        self._ahead: dict[str, concurrent.futures.Future] = {}
        self.prefetched = 0  # entries served from `prefetch`'s thread

    def _path(self, k: str) -> str:
        return os.path.join(self.directory, f"{k}.exe")

    def _hint_path(self) -> str:
        return os.path.join(self.directory, f"{self._hint}.hint")

    def prefetch(self, hint: str, setup: Callable[[], Any] | None = None) -> None:
        """Starts loading, on one thread, the entries that the last process with the same `hint` (its settings,
        less what does not change the compiled loops) asked for, and remembers the keys this process asks for
        under `hint`. `setup` runs on that thread first (what an entry needs registered to load: a custom call's
        handler). `get` takes a loaded entry from the thread, waiting for it if it is still loading."""
        self._hint = hashlib.sha256(hint.encode()).hexdigest()
        try:
            with open(self._hint_path()) as fh:
                keys = [k for k in fh.read().split() if os.path.exists(self._path(k))][: self.AHEAD]
        except OSError:
            return
        if not keys:
            return
        # The pool's thread is joined at interpreter exit: never torn down in the middle of a deserialization.
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="executables")
        if setup is not None:
            pool.submit(setup)
        self._ahead = {k: pool.submit(self._load, k) for k in keys}
        pool.shutdown(wait=False)

    def _write(self, path: str, data: bytes) -> None:
        """`data` to `path`, written beside it and renamed: a reader sees the old file or the new one, never half."""
        with cli.written(path, "wb") as fh:
            fh.write(data)

    def _note(self, k: str) -> None:
        """Adds `k` to the keys the hint names (written atomically; a store that cannot be written is skipped)."""
        if self._hint is None or k in self._used:
            return
        self._used.append(k)
        try:
            self._write(self._hint_path(), ("\n".join(self._used) + "\n").encode())
        except OSError:
            return

    def get(self, k: str) -> tuple | None:
        """The compiled functions stored under `k`, placed on the default device, or None (missing, or written by
        something this process cannot load). Entries are pickles: the store is the user's own cache folder, trusted
        as XLA's cache is."""
        self._note(k)
        ahead = self._ahead.pop(k, None)
        if ahead is not None and (loaded := ahead.result()) is not None:
            self.prefetched += 1
            return loaded
        return self._load(k)

    def _load(self, k: str) -> tuple | None:
        from jax.experimental import serialize_executable as se

        try:
            with open(self._path(k), "rb") as fh:
                entries = pickle.load(fh)
            return tuple(se.deserialize_and_load(*e, execution_devices=jax.devices()[:1]) for e in entries)
        except Exception:  # noqa: BLE001 - a missing, torn or foreign entry is compiled again
            return None

    def put(self, k: str, compiled: tuple) -> None:
        """Writes `compiled` (jax `Compiled` objects) under `k`; a store that cannot be written is skipped."""
        from jax.experimental import serialize_executable as se

        try:
            self._write(self._path(k), pickle.dumps(tuple(se.serialize(c) for c in compiled)))
            for suffix, keep in ((".exe", self.keep), (".hint", 4 * self.keep)):
                entries = sorted((e for e in os.scandir(self.directory) if e.name.endswith(suffix)),
                                 key=lambda e: e.stat().st_mtime)
                for e in entries[: max(0, len(entries) - keep)]:
                    os.remove(e.path)
        except Exception:  # noqa: BLE001 - keeping executables is an optimisation, never an error
            return
