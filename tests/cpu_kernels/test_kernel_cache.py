"""The skinny kernel's build cache: a fresh private directory is made 0700, built into and loaded; one of ours that
others could only read is tightened; a library planted where the kernel would be loaded from (a world-writable or
symlinked fallback directory, a group-writable or symlinked library, a directory someone else owns) is never
loaded, and the model's matmul falls back to XLA's dot; compiler output is shown; and "auto" never builds.

Each case runs in a fresh process (the kernel's state is per process) with its own temporary folder."""

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

from cpu_kernels.skinny_matmul import build

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    CXX = build.compiler()[0]
except RuntimeError:
    CXX = None
pytestmark = pytest.mark.skipif(CXX is None or os.environ.get("SAGE_JAX_SKINNY_MATMUL") == "0",
                                reason="no C++ compiler, or the kernel turned off")

# Prepares the kernel as a serving model's set-up does, then runs a model matmul (`serving_lm.project`) under jit.
_PROBE = """
import json, warnings
import jax, numpy as np
from cpu_kernels.skinny_matmul import build
from sage_jax.models import serving_lm
from sage_jax.models.config import LMConfig

cfg = LMConfig.tiny()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    serving_lm.prepare_matmul(cfg)
rng = np.random.default_rng(0)
w, x = rng.standard_normal((24, 16)).astype(np.float32), rng.standard_normal((16, 3)).astype(np.float32)
fn = jax.jit(lambda w, x: serving_lm.project(cfg, w, x))
np.testing.assert_allclose(np.asarray(fn(w, x)), w.astype(np.float64) @ x, rtol=1e-5, atol=1e-5)
print(json.dumps({"ready": build.ready(), "reason": build.reason(), "warnings": [str(c.message) for c in caught],
                  "kernel": build.TARGET in fn.lower(w, x).as_text()}))
"""


def _probe(tmp_path, **env) -> tuple[dict, str]:
    """Runs `_PROBE` with its own temporary folder (so `build.fallback_dir()` lies under `tmp_path`)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    full = {k: v for k, v in os.environ.items() if k not in ("SAGE_JAX_KERNEL_CACHE", "SAGE_JAX_SKINNY_MATMUL")}
    full.update(TMPDIR=str(tmp), JAX_PLATFORMS="cpu", **env)
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=full, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _fallback(tmp_path):
    return tmp_path / "tmp" / f"sage_jax_kernels_{os.getuid()}"


def _unwritable_home(tmp_path) -> str:
    """A HOME under which `~/.cache` cannot be made (even by root): a regular file."""
    home = tmp_path / "home"
    home.write_text("not a directory")
    return str(home)


@pytest.fixture(scope="session")
def private_cache(tmp_path_factory):
    """A fresh private cache, built into once for the session: (its directory, the probe's answer, its stderr)."""
    base = tmp_path_factory.mktemp("kernel_cache")
    cache = base / "kernels"
    return cache, *_probe(base, SAGE_JAX_KERNEL_CACHE=str(cache))


def test_a_fresh_cache_is_private_built_into_and_loaded(private_cache):
    cache, got, stderr = private_cache
    assert got["ready"] and got["kernel"], got
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    (lib,) = cache.iterdir()
    assert lib.name == build.library_name() and os.stat(lib).st_mode & 0o077 == 0
    # -Wall -Wextra: a clean build prints nothing but the one line saying it builds
    assert not got["warnings"], got["warnings"]
    assert [line for line in stderr.splitlines() if line.strip()] == [
        f"skinny_matmul: building the CPU matmul kernel for this machine, once ({lib})"], stderr


def test_an_older_cache_of_ours_is_tightened_and_loaded_without_a_rebuild(private_cache, tmp_path):
    built, _, _ = private_cache
    cache = tmp_path / "kernels"
    cache.mkdir()
    os.chmod(cache, 0o755)  # as an older version made it
    shutil.copy2(built / build.library_name(), cache)
    got, stderr = _probe(tmp_path, SAGE_JAX_KERNEL_CACHE=str(cache))
    assert got["ready"] and got["kernel"], got
    assert "building" not in stderr
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700


def test_compiler_output_is_shown(private_cache, tmp_path):
    """A build that succeeds but prints (here a compiler stand-in that prints a warning and hands back the real
    build) warns with what it printed; the compiler's identity keys the cache, so it builds anew."""
    built, _, _ = private_cache
    cxx = tmp_path / "cxx"
    cxx.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = --version ]; then echo "stand-in 1.0"; exit 0; fi
        while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done
        cp "{built / build.library_name()}" "$out"
        echo "kernel.cc:1:1: warning: something the user should see" >&2
        """))
    cxx.chmod(0o755)
    cache = tmp_path / "kernels"
    got, _ = _probe(tmp_path, SAGE_JAX_KERNEL_CACHE=str(cache), CXX=str(cxx))
    assert got["ready"], got
    assert any("warning: something the user should see" in w for w in got["warnings"]), got["warnings"]
    (lib,) = cache.iterdir()
    assert lib.name != build.library_name()


@pytest.fixture(scope="session")
def planted(tmp_path_factory):
    """A shared library whose constructor writes the file `$PLANTED_MARKER`: loading it leaves a trace."""
    d = tmp_path_factory.mktemp("planted")
    src = d / "planted.cc"
    src.write_text(textwrap.dedent("""\
        #include <cstdio>
        #include <cstdlib>
        __attribute__((constructor)) static void planted() {
          if (const char* path = std::getenv("PLANTED_MARKER"))
            if (std::FILE* f = std::fopen(path, "w")) { std::fputs("loaded\\n", f); std::fclose(f); }
        }
        """))
    lib = d / "planted.so"
    subprocess.run([CXX, "-shared", "-fPIC", str(src), "-o", str(lib)], check=True, timeout=120)
    control = d / "control"
    subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(lib)!r})"], check=True, timeout=60,
                   env=dict(os.environ, PLANTED_MARKER=str(control)))
    assert control.exists()  # the trace works
    return lib


def _world_writable_dir(d, lib):
    d.mkdir()
    os.chmod(d, 0o777)  # created first by someone else, open to all
    shutil.copy(lib, d / build.library_name())
    return f"kernel cache {d} is group- and world-writable"


def _symlinked_dir(d, lib):
    real = d.with_name("elsewhere")
    real.mkdir(mode=0o700)
    shutil.copy(lib, real / build.library_name())
    d.symlink_to(real, target_is_directory=True)
    return f"kernel cache {d} is a symlink"


def _group_writable_library(d, lib):
    d.mkdir(mode=0o700)
    shutil.copy(lib, d / build.library_name())
    os.chmod(d / build.library_name(), 0o775)
    return f"kernel library {d / build.library_name()} is group-writable"


def _symlinked_library(d, lib):
    d.mkdir(mode=0o700)
    (d / build.library_name()).symlink_to(lib)
    return f"kernel library {d / build.library_name()} is a symlink"


def _foreign_dir(d, lib):
    d.mkdir(mode=0o700)
    shutil.copy(lib, d / build.library_name())
    os.chown(d, 65534, 65534)  # only root gets here: root owns everything it makes
    return f"kernel cache {d} is not owned by you"


@pytest.mark.parametrize("plant", [
    _world_writable_dir, _symlinked_dir, _group_writable_library, _symlinked_library,
    pytest.param(_foreign_dir, marks=pytest.mark.skipif(os.getuid() != 0, reason="chown needs root")),
])
def test_a_library_planted_in_the_fallback_cache_is_never_loaded(plant, planted, tmp_path):
    """An unwritable home sends the cache to the temporary folder, where another local user could have made the
    directory first: the kernel refuses it, says why, and the model multiplies with XLA's dot."""
    (tmp_path / "tmp").mkdir()
    why = plant(_fallback(tmp_path), planted)
    marker = tmp_path / "marker"
    got, _ = _probe(tmp_path, HOME=_unwritable_home(tmp_path), PLANTED_MARKER=str(marker))
    assert not marker.exists(), "the planted library was loaded"
    assert not got["ready"] and not got["kernel"], got
    assert why in got["reason"], got["reason"]
    (warned,) = got["warnings"]
    assert why in warned and "using XLA's dot" in warned


def test_auto_never_builds(tmp_path):
    """Without `prepare`, "auto" takes XLA's dot even where the kernel could run, and builds nothing."""
    cache = tmp_path / "kernels"
    script = textwrap.dedent("""
        import jax, numpy as np
        from cpu_kernels import skinny_matmul as sm
        w, x = np.ones((4, 8), np.float32), np.ones((8, 2), np.float32)
        assert not sm.kernel_usable(w, x)
        assert sm.build.TARGET not in jax.jit(sm.skinny_matmul).lower(w, x).as_text()
        np.testing.assert_array_equal(np.asarray(jax.jit(sm.skinny_matmul)(w, x)), np.full((4, 2), 8.0))
        """)
    env = dict(os.environ, SAGE_JAX_KERNEL_CACHE=str(cache), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not cache.exists()
