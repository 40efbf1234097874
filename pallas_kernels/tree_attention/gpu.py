"""Tree attention on GPU (Pallas on Triton): one program per (row, kv head, block of query rows).

Pallas's default GPU lowering on this jax is Mosaic GPU, whose `pallas_call` path is deprecated and
Hopper-specific; passing Triton's `CompilerParams` selects the Triton lowering, which runs on any CUDA (or ROCm)
GPU. A program holds `block_q` rows of the [T*G, H] query layout (all G heads of a kv head side by side) and
loops over the row's visible cache blocks only: the loop bounds come from (pad, length), so no block outside
[pad, length) is loaded. Then the new-token block, then one output write.

Triton needs power-of-2 block shapes (at least 16 for its dot), so the wrapper pads the query rows and the new
tokens (padding is hidden) and, for a cache shorter than one block, the cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.tree_attention import blocks, layout
from pallas_kernels.tree_attention.reference import MASK_VALUE


def _next_pow2(x: int, least: int = 16) -> int:
    return max(least, 1 << (x - 1).bit_length())


def _fold(q, k, v, vis, carry, scale: float):
    """One key block into the running softmax; vis [BQ, X] (or broadcastable), invisible entries get p = 0."""
    m, l, acc = carry
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    s = jnp.where(vis, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    acc = acc * alpha[:, None] + jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                                     preferred_element_type=jnp.float32)
    return m_new, alpha * l + jnp.sum(p, axis=-1), acc


def _kernel(length_ref, pad_ref,  # [] int32: this row's committed length and left padding
            q_ref,  # [BQ, H]
            k_ref, v_ref,  # [S, H]: this kv head's whole cache row (only visible blocks are loaded)
            kn_ref, vn_ref,  # [U, H]
            mask_ref,  # [BQ, U] int32
            o_ref,  # [BQ, H]
            *, block_s: int, s_len: int, scale: float):
    length, pad = length_ref[...], pad_ref[...]
    q = q_ref[...]
    bq, h = q.shape
    first = jax.lax.div(pad, block_s)
    stop = jnp.maximum(jax.lax.div(length + block_s - 1, block_s), first)

    def cache_block(j, carry):
        # The last block may run past S: read the S - block_s.. tail instead and hide the slots already seen.
        start = jnp.minimum(j * block_s, s_len - block_s)
        slot = start + jnp.arange(block_s, dtype=jnp.int32)
        seen = (slot >= jnp.maximum(pad, j * block_s)) & (slot < length)  # [block_s]
        k = k_ref[pl.ds(start, block_s), :]
        v = jnp.where(seen[:, None], v_ref[pl.ds(start, block_s), :], 0).astype(v_ref.dtype)  # NaN-safe
        return _fold(q, k, v, seen[None, :], carry, scale)

    carry = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32), jnp.zeros((bq, h), jnp.float32))
    carry = jax.lax.fori_loop(first, stop, cache_block, carry)
    _, l, acc = _fold(q, kn_ref[...], vn_ref[...], mask_ref[...] != 0, carry, scale)
    inv = jnp.where(l > 0, 1.0 / l, 0.0)  # a query that saw nothing (padding) gets 0, not NaN
    o_ref[...] = (acc * inv[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_s", "block_q", "interpret"))
def tree_attention_gpu(q: Float[Array, "B T N H"], k_cache: Float[Array, "B S K H"],
                       v_cache: Float[Array, "B S K H"], length: Int[Array, " B"], pad: Int[Array, " B"],
                       k_new: Float[Array, "B U K H"], v_new: Float[Array, "B U K H"],
                       mask_new: Bool[Array, "B T U"] | Int[Array, "B T U"], *, block_s: int | None = None,
                       block_q: int | None = None, interpret=False) -> Float[Array, "B T N H"]:
    """`tree_attention_reference` as one Triton kernel (inputs checked by the caller). `block_s` / `block_q`:
    cache slots per loop step / query rows per program (powers of 2; defaults from `blocks`)."""
    b, t, n, h = q.shape
    kh = k_cache.shape[2]
    g = n // kh
    block_s = block_s or blocks.cache_block("gpu", h, q.dtype)
    block_q = min(block_q or blocks.GPU_QUERY_BLOCK[h], _next_pow2(t * g))
    if k_cache.shape[1] < block_s:  # a toy cache: pad it to one block (its extra slots are past `length`)
        widen = ((0, 0), (0, block_s - k_cache.shape[1]), (0, 0), (0, 0))
        k_cache, v_cache = jnp.pad(k_cache, widen), jnp.pad(v_cache, widen)
    s_len = k_cache.shape[1]
    u = _next_pow2(k_new.shape[1])
    k_new, v_new, mask_new = layout.pad_new(k_new, v_new, mask_new, u)
    k_new, v_new = layout.hide_unseen(mask_new, k_new, v_new)
    tg = t * g
    rows = -(-tg // block_q) * block_q
    qg = jnp.pad(layout.group_queries(q, kh), ((0, 0), (0, 0), (0, rows - tg), (0, 0)))
    mask = jnp.pad(layout.row_mask(mask_new, g), ((0, 0), (0, rows - tg), (0, 0)))
    sq = pl.Squeezed()
    out = pl.pallas_call(
        functools.partial(_kernel, block_s=block_s, s_len=s_len, scale=h**-0.5),
        grid=(b, kh, rows // block_q),
        in_specs=[
            pl.BlockSpec((sq,), lambda bi, hi, i: (bi,)),
            pl.BlockSpec((sq,), lambda bi, hi, i: (bi,)),
            pl.BlockSpec((sq, sq, block_q, h), lambda bi, hi, i: (bi, hi, i, 0)),
            pl.BlockSpec((sq, s_len, sq, sq, h), lambda bi, hi, i: (bi, 0, hi, 0, 0)),
            pl.BlockSpec((sq, s_len, sq, sq, h), lambda bi, hi, i: (bi, 0, hi, 0, 0)),
            pl.BlockSpec((sq, u, sq, sq, h), lambda bi, hi, i: (bi, 0, hi, 0, 0)),
            pl.BlockSpec((sq, u, sq, sq, h), lambda bi, hi, i: (bi, 0, hi, 0, 0)),
            pl.BlockSpec((sq, block_q, u), lambda bi, hi, i: (bi, i, 0)),
        ],
        out_specs=pl.BlockSpec((sq, sq, block_q, h), lambda bi, hi, i: (bi, hi, i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kh, rows, h), q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="tree_attention_gpu",
    )(length.astype(jnp.int32), pad.astype(jnp.int32), qg, layout.head_view(k_cache), layout.head_view(v_cache),
      layout.head_view(k_new), layout.head_view(v_new), mask)
    return layout.ungroup_queries(out[:, :, :tg], t)
