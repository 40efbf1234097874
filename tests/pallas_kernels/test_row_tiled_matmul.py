"""`pallas_kernels.row_tiled_matmul`: the Mosaic and Triton kernels (interpreted on CPU) against the jnp reference,
every implementation row-invariant (a row's bits at 1, 2, 7 and 64 rows), both weight layouts, the TPU / CUDA
lowerings, and one-line errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.row_tiled_matmul import (
    row_tiled_matmul,
    row_tiled_matmul_gpu,
    row_tiled_matmul_reference,
    row_tiled_matmul_tpu,
)

IMPLS = ("reference", "tpu", "gpu")


def _operands(layout, dtype, m=64, d=200, e=300, seed=0):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((e, d) if layout == "ED" else (d, e)), dtype)
    return jnp.asarray(rng.standard_normal((m, d)), dtype), w


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def _run(impl, x, w, layout):
    return jax.jit(lambda x, w: row_tiled_matmul(x, w, w_layout=layout, impl=impl, interpret=impl != "reference"))(
        x, w)


@pytest.mark.parametrize("layout", ["ED", "DE"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_match_the_reference_and_xlas_dot(layout, dtype):
    x, w = _operands(layout, dtype)
    ref = row_tiled_matmul_reference(x, w, layout)
    assert ref.dtype == jnp.float32 and ref.shape == (64, 300)
    dot = jnp.einsum("MD,ED->ME" if layout == "ED" else "MD,DE->ME", x, w, preferred_element_type=jnp.float32)
    assert rel_err(ref, dot) < 1e-6
    for impl in ("tpu", "gpu"):
        assert rel_err(_run(impl, x, w, layout), ref) < 1e-6, impl


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_number_of_rows(impl, dtype):
    x, w = _operands("ED", dtype, seed=1)
    first = {m: np.asarray(_run(impl, x[:m], w, "ED"))[0] for m in (1, 2, 7, 64)}
    for m in (2, 7, 64):
        np.testing.assert_array_equal(first[m], first[1], err_msg=f"{impl}: row 0 at {m} rows")


def test_xlas_own_dot_is_not_row_invariant_here():
    """What the kernels are for: XLA:CPU's dot gives row 0 other bits at 1 and 7 rows (so the test above can fail)."""
    x, w = _operands("ED", jnp.bfloat16, seed=1)
    dot = jax.jit(lambda x, w: jnp.einsum("MD,ED->ME", x, w, preferred_element_type=jnp.float32))
    assert not np.array_equal(np.asarray(dot(x[:1], w))[0], np.asarray(dot(x[:7], w))[0])


def test_kernels_lower_for_tpu_and_cuda():
    x, w = jax.ShapeDtypeStruct((25, 576), jnp.bfloat16), jax.ShapeDtypeStruct((1728, 576), jnp.bfloat16)
    tpu = jax.export.export(jax.jit(row_tiled_matmul_tpu), platforms=["tpu"])(x, w).mlir_module()
    assert "tpu_custom_call" in tpu
    # "auto" picks the Mosaic kernel when lowering for TPU, from this CPU host.
    assert "tpu_custom_call" in jax.export.export(jax.jit(row_tiled_matmul), platforms=["tpu"])(x, w).mlir_module()
    check = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    cuda = jax.export.export(jax.jit(row_tiled_matmul_gpu), platforms=["cuda"], disabled_checks=[check])(x, w)
    assert "triton" in cuda.mlir_module()


@pytest.mark.parametrize("case", ["layout", "rank", "depth", "impl"])
def test_bad_inputs_raise_one_clear_error(case):
    x, w = _operands("ED", jnp.float32, m=4, d=8, e=6)
    call = {"layout": lambda: row_tiled_matmul(x, w, w_layout="EF"),
            "rank": lambda: row_tiled_matmul(x[None], w),
            "depth": lambda: row_tiled_matmul(x[:, :5], w),
            "impl": lambda: row_tiled_matmul(x, w, impl="mosaic")}[case]
    with pytest.raises(ValueError) as e:
        call()
    assert "\n" not in str(e.value)
