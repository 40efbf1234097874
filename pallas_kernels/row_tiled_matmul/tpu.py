"""The row-tiled matmul on TPU (Mosaic): grid (row tiles, output blocks, reduction blocks), float32 accumulator in
VMEM, the reduction blocks taken in order.

A row tile is `TPU_ROWS` rows whatever M is (a one-row decode step is one tile, mostly zero rows: the MXU streams
the weight block once either way), the reduction split into fixed `block_d` blocks added in order, so a row's bits
depend neither on M nor on the other rows. A verify of up to `TPU_ROWS` rows reads each weight once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float

from pallas_kernels.row_tiled_matmul.reference import Layout

TPU_ROWS = 128


def _kernel(x_ref, w_ref, o_ref, acc_ref, *, w_layout: Layout):
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    contract = (((1,), (1,)), ((), ())) if w_layout == "ED" else (((1,), (0,)), ((), ()))
    acc_ref[...] += jax.lax.dot_general(x_ref[...], w_ref[...], contract, preferred_element_type=jnp.float32)

    @pl.when(k == pl.num_programs(2) - 1)
    def _write():
        o_ref[...] = acc_ref[...]


def _block(n: int, most: int) -> int:
    """A lane-aligned block for a dimension of n: `most`, or n rounded up to 128 when smaller."""
    return min(most, -(-n // 128) * 128)


@functools.partial(jax.jit, static_argnames=("w_layout", "block_e", "block_d", "interpret"))
def row_tiled_matmul_tpu(x: Float[Array, "M D"], w: Float[Array, "E D"] | Float[Array, "D E"], *,
                         w_layout: Layout = "ED", block_e: int = 512, block_d: int = 512, interpret=False
                         ) -> Float[Array, "M E"]:
    """`row_tiled_matmul_reference` with `TPU_ROWS`-row tiles as one Mosaic kernel (inputs checked by the caller).
    D and E are zero-padded to whole blocks (padding adds exact zeros)."""
    m, d = x.shape
    e = w.shape[0] if w_layout == "ED" else w.shape[1]
    be, bd = _block(e, block_e), _block(d, block_d)
    mp, dp, ep = -(-m // TPU_ROWS) * TPU_ROWS, -(-d // bd) * bd, -(-e // be) * be
    x = jnp.pad(x, ((0, mp - m), (0, dp - d)))
    if w_layout == "ED":
        w = jnp.pad(w, ((0, ep - e), (0, dp - d)))
        w_spec = pl.BlockSpec((be, bd), lambda i, j, k: (j, k))
    else:
        w = jnp.pad(w, ((0, dp - d), (0, ep - e)))
        w_spec = pl.BlockSpec((bd, be), lambda i, j, k: (k, j))
    out = pl.pallas_call(
        functools.partial(_kernel, w_layout=w_layout),
        grid=(mp // TPU_ROWS, ep // be, dp // bd),
        in_specs=[pl.BlockSpec((TPU_ROWS, bd), lambda i, j, k: (i, k)), w_spec],
        out_specs=pl.BlockSpec((TPU_ROWS, be), lambda i, j, k: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, ep), jnp.float32),
        scratch_shapes=[pltpu.VMEM((TPU_ROWS, be), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="row_tiled_matmul_tpu",
    )(x, w)
    return out[:m, :e]
