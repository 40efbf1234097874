"""Compiles `kernel.cc` for this machine once, caches the shared library where only its user can write, and
registers it with XLA:CPU.

The library is built with the host's C++ compiler (`$CXX`, else `g++`, else `c++`, else `clang++`) against the XLA
FFI headers that ship inside jaxlib, with `-march=native`. The cache key holds the source, the flags, jaxlib's
version, the machine, the CPU's feature flags and the compiler's identity (its resolved path and the first line of
its `--version`), so a library never runs on a machine, or with a toolchain, it was not built for.

It lives in `cache_dir()` (default `~/.cache/sage_jax/kernels`; where that cannot be made, `fallback_dir()` in the
temporary folder). Loading a library runs its code, so a cache directory is used only if it is a real directory
(not a symlink) owned by this user that no one else can write: it is made with mode 0700, and one of ours that
others may read or search (an older cache, made 0755) is tightened to 0700. One that someone else owns, or that
group or others may write, is refused, as is a library that is a symlink, not a regular file, not ours, or
writable by group or others: nothing is built there or loaded from there. A build goes to a temporary file in the
checked directory first and is renamed into place, so concurrent processes (pytest workers) never load a
half-written one; whatever the compiler prints is shown (`-Wall -Wextra`: a clean build prints nothing).

`prepare()` does all of this once per process, eagerly, where a serving model is set up (never inside a trace);
`ready()` only reads its answer. Without a compiler, with an unsafe cache, or if the build fails, `prepare()`
returns False, says why once (a warning; `reason()`), and the model falls back to XLA's dot;
`SAGE_JAX_SKINNY_MATMUL=0` in the environment turns the kernel off the same way.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

TARGET = "sage_skinny_matmul"
SOURCE = Path(__file__).with_name("kernel.cc")
# -ffp-contract=off: the kernel fuses only where it says so, so every column is computed the same way. The XLA FFI
# headers go in with -isystem: their own warnings are not this file's.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Wextra")

_lock = threading.Lock()
_state: dict[str, object] = {}


class UnsafeCache(RuntimeError):
    """A cache directory or library that someone other than this user could have written."""


def cache_dir() -> Path:
    """`$SAGE_JAX_KERNEL_CACHE`, else `~/.cache/sage_jax/kernels`: machine-wide, not under `$SAGE_JAX_CACHE` (the
    converted-weights cache, which tests and notebooks point at fresh folders: each would rebuild the kernel)."""
    root = os.environ.get("SAGE_JAX_KERNEL_CACHE")
    return Path(root) if root else Path(os.path.expanduser("~")) / ".cache" / "sage_jax" / "kernels"


def fallback_dir() -> Path:
    """Where the kernel is cached when `cache_dir()` cannot be made (an unwritable home): this user's folder in the
    temporary folder, under the same checks."""
    return Path(tempfile.gettempdir()) / f"sage_jax_kernels_{os.getuid()}"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def compiler() -> tuple[str, str]:
    """(how to call the C++ compiler, its identity: resolved path and first line of `--version`); RuntimeError
    without one."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        found = shutil.which(name) if name else None
        if found:
            try:
                done = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=60)
                version = (done.stdout or done.stderr).strip().splitlines()[:1]
            except (OSError, subprocess.SubprocessError):
                version = []
            return found, f"{os.path.realpath(found)} {' '.join(version)}"
    raise RuntimeError("no C++ compiler (g++ / c++ / clang++) on PATH")


def library_name(identity: str | None = None) -> str:
    """The file name of this machine's build of the kernel with this compiler (`compiler()[1]` by default)."""
    import jaxlib

    if identity is None:
        identity = compiler()[1]
    parts = [SOURCE.read_bytes(), " ".join(FLAGS).encode(), jaxlib.__version__.encode(), platform.machine().encode(),
             _cpu_flags().encode(), identity.encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return f"skinny_matmul-{key}.so"


def _writable_by(mode: int) -> str:
    return {0o020: "group-writable", 0o002: "world-writable", 0o022: "group- and world-writable"}[mode & 0o022]


def _owned_by_me(path: Path, what: str, is_kind, kind: str) -> os.stat_result:
    """`path`'s lstat; UnsafeCache when it is a symlink, not of the kind `is_kind` tests, not this user's, or
    writable by group or others."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCache(f"{what} {path} is a symlink")
    if not is_kind(st.st_mode):
        raise UnsafeCache(f"{what} {path} is not {kind}")
    if st.st_uid != os.getuid():
        raise UnsafeCache(f"{what} {path} is not owned by you (owner uid {st.st_uid})")
    if st.st_mode & 0o022:
        raise UnsafeCache(f"{what} {path} is {_writable_by(st.st_mode)}")
    return st


def _private_dir(path: Path) -> None:
    """Makes `path` with mode 0700 if it is missing; UnsafeCache unless it is a real directory owned by this user
    that no one else can write. Group / other read or search bits on one of ours are taken away."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = _owned_by_me(path, "kernel cache", stat.S_ISDIR, "a directory")
    if stat.S_IMODE(st.st_mode) != 0o700:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_ino != st.st_ino:
                raise UnsafeCache(f"kernel cache {path} changed while it was checked")
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)


def _check_library(path: Path) -> None:
    """UnsafeCache unless `path` is a regular file (not a symlink) of this user's that no one else can write."""
    _owned_by_me(path, "kernel library", stat.S_ISREG, "a regular file")


def _build(cxx: str, out: Path) -> None:
    """Compiles the kernel into `out`, in a directory `_private_dir` has checked."""
    import jax.ffi

    print(f"skinny_matmul: building the CPU matmul kernel for this machine, once ({out})", file=sys.stderr)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, "-isystem", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-500:]}")
        if done.stderr.strip():
            warnings.warn(f"skinny_matmul: {cxx} printed while building the CPU kernel:\n"
                          f"{done.stderr.strip()[:4000]}", stacklevel=2)
        os.chmod(tmp, 0o700)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> ctypes.CDLL:
    cxx, identity = compiler()
    name = library_name(identity)
    directory = cache_dir()
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        _private_dir(directory)
        if not os.path.lexists(directory / name):
            _build(cxx, directory / name)
    except OSError:  # it cannot be made or written (an unwritable home): the temporary folder, checked the same way
        directory = fallback_dir()
        _private_dir(directory)
        if not os.path.lexists(directory / name):
            _build(cxx, directory / name)
    path = directory / name
    _check_library(path)
    return ctypes.cdll.LoadLibrary(str(path))


def prepare() -> bool:
    """Builds (first time on this machine, with this compiler), checks, loads and registers the kernel as XLA:CPU
    FFI target `TARGET`; True when it is available. Call it eagerly, outside any trace, where a serving model is
    set up. Thread-safe and idempotent: the answer is remembered for the process."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        if os.environ.get("SAGE_JAX_SKINNY_MATMUL", "1") == "0":
            _state.update(ok=False, reason="turned off by SAGE_JAX_SKINNY_MATMUL=0")
            return False
        try:
            import jax.ffi

            lib = _load()
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SageSkinnyMatmul), platform="cpu")
            _state.update(ok=True, lib=lib, reason="")
        # AttributeError: a library without the kernel's handler symbol
        except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
            _state.update(ok=False, reason=str(e))
            warnings.warn(f"skinny_matmul: the CPU kernel is unavailable ({e}); using XLA's dot", stacklevel=2)
        return bool(_state["ok"])


def ready() -> bool:
    """Whether `prepare` has made the kernel available in this process. Never builds: what a trace may ask."""
    return bool(_state.get("ok"))


def reason() -> str:
    """Why the kernel is unavailable ('' when it is, or before `prepare` ran)."""
    return str(_state.get("reason", ""))
