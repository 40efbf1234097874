"""The row-tiled matmul on GPU (Pallas on Triton): one program per (row tile, output block), looping over the
reduction in fixed blocks, in order, into a float32 accumulator.

A row tile is `GPU_ROWS` rows whatever M is, the reduction split into `block_d` blocks, so a row's bits depend
neither on M nor on the other rows. Each row tile streams the whole weight, so the tile is as tall as a speculative
verify (a paper-sized tree of 64 nodes and its root fits one), and a one-row decode step's padded rows cost tensor
core time the weight stream hides: at a 72B model's shapes an H100 stays memory-bound up to about 200 rows
(`sage_jax.decoding.cost_model`). Triton needs power-of-2 blocks: D and E are
zero-padded to whole blocks (padding adds exact zeros).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float

from pallas_kernels.row_tiled_matmul.reference import Layout

GPU_ROWS = 128


def _kernel(x_ref, w_ref, o_ref, *, block_d: int, n_d: int, w_layout: Layout):
    def step(i, acc):
        xs = x_ref[:, pl.ds(i * block_d, block_d)]
        if w_layout == "ED":
            return acc + jax.lax.dot_general(xs, w_ref[:, pl.ds(i * block_d, block_d)], (((1,), (1,)), ((), ())),
                                             preferred_element_type=jnp.float32)
        return acc + jax.lax.dot_general(xs, w_ref[pl.ds(i * block_d, block_d), :], (((1,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32)

    o_ref[...] = jax.lax.fori_loop(0, n_d, step, jnp.zeros(o_ref.shape, jnp.float32))


@functools.partial(jax.jit, static_argnames=("w_layout", "block_e", "block_d", "interpret"))
def row_tiled_matmul_gpu(x: Float[Array, "M D"], w: Float[Array, "E D"] | Float[Array, "D E"], *,
                         w_layout: Layout = "ED", block_e: int = 64, block_d: int = 64, interpret=False
                         ) -> Float[Array, "M E"]:
    """`row_tiled_matmul_reference` with `GPU_ROWS`-row tiles as one Triton kernel (inputs checked by the caller)."""
    m, d = x.shape
    e = w.shape[0] if w_layout == "ED" else w.shape[1]
    mp, dp, ep = -(-m // GPU_ROWS) * GPU_ROWS, -(-d // block_d) * block_d, -(-e // block_e) * block_e
    x = jnp.pad(x, ((0, mp - m), (0, dp - d)))
    if w_layout == "ED":
        w = jnp.pad(w, ((0, ep - e), (0, dp - d)))
        w_spec = pl.BlockSpec((block_e, dp), lambda i, j: (j, 0))
    else:
        w = jnp.pad(w, ((0, dp - d), (0, ep - e)))
        w_spec = pl.BlockSpec((dp, block_e), lambda i, j: (0, j))
    out = pl.pallas_call(
        functools.partial(_kernel, block_d=block_d, n_d=dp // block_d, w_layout=w_layout),
        grid=(mp // GPU_ROWS, ep // block_e),
        in_specs=[pl.BlockSpec((GPU_ROWS, dp), lambda i, j: (i, 0)), w_spec],
        out_specs=pl.BlockSpec((GPU_ROWS, block_e), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, ep), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="row_tiled_matmul_gpu",
    )(x, w)
    return out[:m, :e]
