"""Row-tiled matmul: activations [M, D] times a weight, every row computed the same way whatever M is.

    from pallas_kernels.row_tiled_matmul import row_tiled_matmul
    y = row_tiled_matmul(x, w)                   # x [M, D], w [E, D] -> y [M, E] float32
    logits = row_tiled_matmul(h, lm_head, w_layout="DE")   # w [D, E]

The matmuls of the exact mode (`LMConfig.matmul == "exact"`): XLA picks a dot's blocking by its shape, so a row
rounds differently in a one-row decode step and in a verify forward of k + 1 rows. Here the rows run in tiles of a
fixed size and the reduction in fixed blocks taken in order, so a row's bits depend on nothing but its own data
(and the platform). Picked when lowering (`lax.platform_dependent`): Mosaic on TPU (`tpu.py`, 128-row tiles), Triton
on CUDA / ROCm (`gpu.py`, 128-row tiles), elsewhere the jnp reference (`reference.py`, 8-row tiles under `lax.map`),
which is also the kernels' oracle in tests.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
from jaxtyping import Array, Float

from pallas_kernels.row_tiled_matmul.gpu import GPU_ROWS, row_tiled_matmul_gpu
from pallas_kernels.row_tiled_matmul.reference import CPU_ROWS, Layout, check_inputs, row_tiled_matmul_reference
from pallas_kernels.row_tiled_matmul.tpu import TPU_ROWS, row_tiled_matmul_tpu

__all__ = ["CPU_ROWS", "GPU_ROWS", "TPU_ROWS", "row_tiled_matmul", "row_tiled_matmul_gpu",
           "row_tiled_matmul_reference", "row_tiled_matmul_tpu"]

Impl = Literal["auto", "reference", "tpu", "gpu"]


def row_tiled_matmul(x: Float[Array, "M D"], w: Float[Array, "E D"] | Float[Array, "D E"], *,
                     w_layout: Layout = "ED", impl: Impl = "auto", interpret: bool = False) -> Float[Array, "M E"]:
    """X [M, D] times W ([E, D], or [D, E] with `w_layout="DE"`) -> [M, E] float32, row-invariant.

    impl: "auto" (chosen when lowering: the TPU kernel on TPU, the GPU kernel on CUDA / ROCm, the reference
    elsewhere) or one by name; `interpret`: run a kernel in Pallas interpret mode (a check on CPU)."""
    if impl not in ("auto", "reference", "tpu", "gpu"):
        raise ValueError(f"impl must be one of auto, reference, tpu, gpu; got {impl!r}")
    check_inputs(x, w, w_layout)
    ref = functools.partial(row_tiled_matmul_reference, w_layout=w_layout)
    tpu = functools.partial(row_tiled_matmul_tpu, w_layout=w_layout, interpret=interpret)
    gpu = functools.partial(row_tiled_matmul_gpu, w_layout=w_layout, interpret=interpret)
    if impl != "auto":
        return {"reference": ref, "tpu": tpu, "gpu": gpu}[impl](x, w)
    return jax.lax.platform_dependent(x, w, tpu=tpu, cuda=gpu, rocm=gpu, default=ref)
