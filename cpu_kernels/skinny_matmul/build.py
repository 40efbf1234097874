"""Compiles `kernel.cc` for this machine once, caches the shared library, and registers it with XLA:CPU.

The library is built with the host's C++ compiler (`$CXX`, else `g++`, else `c++`) against the XLA FFI headers
that ship inside jaxlib, with `-march=native`: the cache key holds the source, the flags, jaxlib's version and
the CPU's feature flags, so a library never runs on a machine it was not built for. It lives in `cache_dir()`
(default `~/.cache/sage_jax/kernels`; where that cannot be written, the temporary folder). A build goes to a
temporary file first and is renamed into place, so concurrent processes (pytest workers) never load a half-written
one. Without a compiler, or if the build fails, `register()` returns False, says why once (`reason()`), and the
model falls back to XLA's dot; `SAGE_JAX_SKINNY_MATMUL=0` in the environment turns the kernel off the same way.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

TARGET = "sage_skinny_matmul"
SOURCE = Path(__file__).with_name("kernel.cc")
# -ffp-contract=off: the kernel fuses only where it says so, so every column is computed the same way.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w")

_lock = threading.Lock()
_state: dict[str, object] = {}


def cache_dir() -> Path:
    """`$SAGE_JAX_KERNEL_CACHE`, else `~/.cache/sage_jax/kernels`: machine-wide, not under `$SAGE_JAX_CACHE` (the
    converted-weights cache, which tests and notebooks point at fresh folders: each would rebuild the kernel)."""
    root = os.environ.get("SAGE_JAX_KERNEL_CACHE")
    return Path(root) if root else Path(os.path.expanduser("~")) / ".cache" / "sage_jax" / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def library_path() -> Path:
    """Where this machine's build of the kernel lives (it may not exist yet)."""
    import jaxlib

    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(), jaxlib.__version__.encode(),
                                     platform.machine().encode(), _cpu_flags().encode()])).hexdigest()[:16]
    return cache_dir() / f"skinny_matmul-{key}.so"


def _build(out: Path) -> None:
    import jax.ffi

    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ / c++ / clang++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"skinny_matmul: building the CPU matmul kernel for this machine, once ({out})", file=sys.stderr)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def register() -> bool:
    """Builds (first time on this machine) and registers the kernel as XLA:CPU FFI target `TARGET`; True when it
    is available. Thread-safe; the answer is remembered for the process."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        if os.environ.get("SAGE_JAX_SKINNY_MATMUL", "1") == "0":
            _state.update(ok=False, reason="turned off by SAGE_JAX_SKINNY_MATMUL=0")
            return False
        try:
            import jax.ffi

            path = library_path()
            if not path.exists():
                try:
                    _build(path)
                except OSError:  # an unwritable home: build into the temporary folder instead
                    path = Path(tempfile.gettempdir()) / f"sage_jax_kernels_{os.getuid()}" / path.name
                    if not path.exists():
                        _build(path)
            lib = ctypes.cdll.LoadLibrary(str(path))
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SageSkinnyMatmul), platform="cpu")
            _state.update(ok=True, lib=lib, reason="")
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _state.update(ok=False, reason=str(e))
            warnings.warn(f"skinny_matmul: the CPU kernel is unavailable ({e}); using XLA's dot", stacklevel=2)
        return bool(_state["ok"])


def reason() -> str:
    """Why the kernel is unavailable ('' when it is, or before `register` ran)."""
    return str(_state.get("reason", ""))
