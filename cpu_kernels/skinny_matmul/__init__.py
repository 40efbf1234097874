"""Skinny matmul: a weight [E, D] times a few activation columns, the matmul of every decode and verify step.

    from cpu_kernels.skinny_matmul import skinny_matmul
    y = skinny_matmul(w, x)                           # w [E, D] ([out, in]), x [D, M] -> y [E, M]
    logits = skinny_matmul(embed, h, x_tokens_major=True, y_tokens_major=True)   # h [M, D] -> [M, V]

On XLA:CPU it is a C++ FFI kernel (`kernel.cc`, built for the host once and cached by `build.py`), because
XLA:CPU's dot handles one column as a memory-bound GEMV but 2-8 columns as a GEMM built for large M (2-core EPYC,
SmolLM2-135M's matmuls: 2 columns cost 1.7x one; the kernel, which streams each weight row once with the stream
prefetched ahead: 1.03x, four columns 1.04x, and one column 0.8x of XLA's). Elsewhere (TPU, GPU, a sharded model,
bfloat16, many columns, no compiler, an unsafe cache) it is the jnp reference, `reference.skinny_matmul_reference`,
which is also the kernel's oracle in tests.

The kernel's column results do not depend on M or on the other columns, bit for bit (kernel.cc, "Numerics"): a
verify step's rows equal the one-token decode step's. Differentiable (the tangents go through the reference) and
exportable for other platforms (`jax.lax.platform_dependent` picks the reference there).

`prepare()` builds (once per machine) and loads the kernel; it runs eagerly where a serving model is set up
(`Decoder.serving`, `Engine`), never inside a trace. "auto" takes the kernel only once it has (`kernel_usable`
never builds); `impl="kernel"` prepares it on demand.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from cpu_kernels.skinny_matmul import build
from cpu_kernels.skinny_matmul.build import prepare
from cpu_kernels.skinny_matmul.reference import check_inputs, skinny_matmul_reference

__all__ = ["MAX_COLUMNS", "kernel_usable", "prepare", "skinny_matmul", "skinny_matmul_reference"]

Impl = Literal["auto", "kernel", "reference"]

#: Up to this many columns "auto" takes the kernel: on the 2-core EPYC the real target's verify forward costs 1.05
#: / 1.10 / 1.53 / 2.40 of its own plain decoding step at 2 / 4 / 8 / 12 rows with it against 1.55 / 1.65 / 1.89 /
#: 2.49 with XLA's dot, and the kernel's 16 columns cost 4.0x its one where XLA's GEMM is flat from 12 to 16
#: (benchmarks/sage/results/skinny_matmul/table.md).
MAX_COLUMNS = 12


def _multi_device_mesh() -> bool:
    from configs.sharding import current

    mesh = current()[0]
    if mesh is not None and mesh.size > 1:
        return True
    abstract = jax.sharding.get_abstract_mesh()
    return not abstract.empty and abstract.size > 1


def kernel_usable(w, x, x_tokens_major: bool = False) -> bool:
    """Whether "auto" runs the CPU kernel for these operands: float32, at most `MAX_COLUMNS` columns, a CPU
    backend, no multi-device mesh current (the partitioner cannot cut an FFI call), and the kernel made available
    by an earlier `prepare()` in this process. Safe inside a trace: it never builds."""
    m = check_inputs(w, x, x_tokens_major)
    return (w.dtype == jnp.float32 and x.dtype == jnp.float32 and 1 <= m <= MAX_COLUMNS
            and jax.default_backend() == "cpu" and not _multi_device_mesh() and build.ready())


def _ffi(w, x, x_tokens_major: bool, y_tokens_major: bool):
    m = x.shape[0] if x_tokens_major else x.shape[1]
    shape = (m, w.shape[0]) if y_tokens_major else (w.shape[0], m)
    call = jax.ffi.ffi_call(build.TARGET, jax.ShapeDtypeStruct(shape, jnp.float32), vmap_method="sequential")
    return call(w, x, x_tokens_major=x_tokens_major, y_tokens_major=y_tokens_major)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _kernel(w, x, x_tokens_major: bool, y_tokens_major: bool):
    ref = functools.partial(skinny_matmul_reference, x_tokens_major=x_tokens_major, y_tokens_major=y_tokens_major)
    # The FFI target exists on CPU only; lowering for another platform (jax.export on a CPU host) takes the
    # reference.
    return jax.lax.platform_dependent(
        w, x, cpu=functools.partial(_ffi, x_tokens_major=x_tokens_major, y_tokens_major=y_tokens_major),
        default=ref)


@_kernel.defjvp
def _kernel_jvp(x_tokens_major, y_tokens_major, primals, tangents):
    w, x = primals
    dw, dx = tangents
    ref = functools.partial(skinny_matmul_reference, x_tokens_major=x_tokens_major, y_tokens_major=y_tokens_major)
    return _kernel(w, x, x_tokens_major, y_tokens_major), ref(dw, x) + ref(w, dx)


def skinny_matmul(w: Float[Array, "E D"], x: Float[Array, "D M"] | Float[Array, "M D"], *,
                  x_tokens_major: bool = False, y_tokens_major: bool = False, impl: Impl = "auto"
                  ) -> Float[Array, "E M"] | Float[Array, "M E"]:
    """W [E, D] times X ([D, M], or [M, D] with `x_tokens_major`) -> [E, M] (or [M, E] with `y_tokens_major`).

    impl: "auto" (the CPU kernel where `kernel_usable`, else the reference), "kernel" (`prepare`s it if needed;
    RuntimeError where it cannot run) or "reference"."""
    if impl not in ("auto", "kernel", "reference"):
        raise ValueError(f"impl must be one of auto, kernel, reference; got {impl!r}")
    check_inputs(w, x, x_tokens_major)
    if impl == "kernel":
        if w.dtype != jnp.float32 or x.dtype != jnp.float32:
            raise ValueError(f"the skinny_matmul kernel takes float32, got {w.dtype} and {x.dtype}")
        if not build.prepare():
            raise RuntimeError(f"the skinny_matmul kernel is unavailable: {build.reason()}")
    elif impl == "reference" or not kernel_usable(w, x, x_tokens_major):
        return skinny_matmul_reference(w, x, x_tokens_major=x_tokens_major, y_tokens_major=y_tokens_major)
    return _kernel(w, x, x_tokens_major, y_tokens_major)
