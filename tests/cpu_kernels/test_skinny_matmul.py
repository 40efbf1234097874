"""The skinny CPU matmul kernel against a float64 oracle and the jnp reference: every layout, widths across its
column blocks and a D that is no multiple of the vector width; bit-for-bit independence of a column from the
others; gradients; export for other platforms; and when "auto" takes it."""

import itertools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import sharding
from cpu_kernels import skinny_matmul as sm
from cpu_kernels.skinny_matmul import build

pytestmark = pytest.mark.skipif(not build.prepare(), reason=f"kernel unavailable: {build.reason()}")


def _operands(e: int, d: int, m: int, x_tokens_major: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((e, d)).astype(np.float32)
    x = rng.standard_normal((m, d) if x_tokens_major else (d, m)).astype(np.float32)
    return w, x


def _oracle(w, x, x_tokens_major, y_tokens_major):
    xm = x.astype(np.float64) if x_tokens_major else x.T.astype(np.float64)  # [M, D]
    y = xm @ w.astype(np.float64).T  # [M, E]
    return y if y_tokens_major else y.T


run = jax.jit(sm.skinny_matmul, static_argnames=("x_tokens_major", "y_tokens_major", "impl"))


@pytest.mark.parametrize("xt,yt", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("e,d,m", [(130, 576, 1), (97, 64, 3), (64, 37, 5), (300, 1536, 7), (33, 200, 8),
                                   (17, 16, 13)])
def test_kernel_matches_the_oracle(e, d, m, xt, yt):
    w, x = _operands(e, d, m, xt)
    got = np.asarray(run(w, x, x_tokens_major=xt, y_tokens_major=yt, impl="kernel"))
    want = _oracle(w, x, xt, yt)
    assert got.shape == want.shape
    # fp32 accumulation over D terms of unit variance: XLA's dot is held to the same bound.
    tol = 4e-6 * np.sqrt(d) * 4
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)
    ref = np.asarray(run(w, x, x_tokens_major=xt, y_tokens_major=yt, impl="reference"))
    np.testing.assert_allclose(ref, want, atol=tol, rtol=0)


@pytest.mark.parametrize("d", [576, 37])
def test_a_column_does_not_depend_on_the_others(d):
    """Column j of an M-column product equals the one-column product of column j bit for bit, for every M the
    blocks cut differently (8, then one block of the rest): a verify row equals the decode step's row."""
    w, x = _operands(50, d, 13, False, seed=1)
    alone = [np.asarray(run(w, x[:, j:j + 1], impl="kernel"))[:, 0] for j in range(13)]
    for m in (2, 3, 4, 5, 6, 7, 8, 9, 12, 13):
        y = np.asarray(run(w, x[:, :m], impl="kernel"))
        for j in range(m):
            np.testing.assert_array_equal(y[:, j], alone[j], err_msg=f"column {j} of {m}")
    yt = np.asarray(run(w, np.ascontiguousarray(x[:, :6].T), x_tokens_major=True, y_tokens_major=True,
                        impl="kernel"))
    np.testing.assert_array_equal(yt, np.stack(alone[:6], 0))


def test_gradients_go_through_the_reference():
    w, x = _operands(40, 24, 3, False, seed=2)

    def loss(impl):
        return lambda w_, x_: jnp.sum(jnp.sin(sm.skinny_matmul(w_, x_, impl=impl)))

    gk = jax.jit(jax.grad(loss("kernel"), argnums=(0, 1)))(w, x)
    gr = jax.jit(jax.grad(loss("reference"), argnums=(0, 1)))(w, x)
    for a, b in zip(gk, gr, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_exports_for_tpu_without_the_cpu_target():
    """A CPU host exporting for TPU (`jax.export`) gets the reference: the FFI target exists on CPU only."""
    w, x = _operands(16, 8, 2, False)
    fn = jax.jit(lambda w_, x_: sm.skinny_matmul(w_, x_, impl="kernel"))
    text = jax.export.export(fn, platforms=["tpu"])(w, x).mlir_module()
    assert build.TARGET not in text
    assert build.TARGET in jax.jit(fn).lower(w, x).as_text()


def test_auto_takes_the_kernel_only_where_it_pays_and_can_run(devices):
    w, x = _operands(16, 8, 2, False)
    assert sm.kernel_usable(w, x)
    assert build.TARGET in jax.jit(sm.skinny_matmul).lower(w, x).as_text()
    wide = np.ones((8, sm.MAX_COLUMNS + 1), np.float32)
    assert not sm.kernel_usable(w, wide)
    assert not sm.kernel_usable(w.astype(jnp.bfloat16), x.astype(jnp.bfloat16))
    with sharding.use(sharding.make_mesh(data=len(devices))):  # the partitioner cannot cut an FFI call
        assert not sm.kernel_usable(w, x)
        assert build.TARGET not in jax.jit(sm.skinny_matmul).lower(w, x).as_text()


def test_bad_input():
    w, x = _operands(16, 8, 2, False)
    with pytest.raises(ValueError, match="disagree on D"):
        sm.skinny_matmul(w, x.T)
    with pytest.raises(ValueError, match="2-D"):
        sm.skinny_matmul(w, x[None])
    with pytest.raises(ValueError, match="impl must be"):
        sm.skinny_matmul(w, x, impl="fast")
    with pytest.raises(ValueError, match="float32"):
        sm.skinny_matmul(w.astype(jnp.bfloat16), x, impl="kernel")


_FALLBACK = """
import warnings, numpy as np, jax.numpy as jnp
from cpu_kernels import skinny_matmul as sm
from cpu_kernels.skinny_matmul import build
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ok = build.prepare()
w, x = np.ones((4, 8), np.float32), np.ones((8, 2), np.float32)
assert not sm.kernel_usable(w, x)
np.testing.assert_array_equal(np.asarray(sm.skinny_matmul(w, x)), np.full((4, 2), 8.0))
print(ok, build.reason(), len(caught))
"""


@pytest.mark.parametrize("env,why,warned", [
    ({"SAGE_JAX_SKINNY_MATMUL": "0"}, "turned off by SAGE_JAX_SKINNY_MATMUL=0", "0"),
    ({"PATH": os.path.dirname(sys.executable), "CXX": ""}, "no C++ compiler", "1"),
])
def test_without_the_kernel_auto_falls_back_to_xla(env, why, warned, tmp_path):
    """Turned off, or on a machine without a compiler (nothing cached yet): "auto" is XLA's dot, with one
    warning when the build could not run."""
    full = dict(os.environ, SAGE_JAX_KERNEL_CACHE=str(tmp_path), JAX_PLATFORMS="cpu", **env)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _FALLBACK], env=full, cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ok, *reason, n_warned = proc.stdout.split()
    assert ok == "False" and why in " ".join(reason) and n_warned == warned
    assert not list(tmp_path.iterdir())  # nothing half-built left behind
