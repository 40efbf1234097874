"""Tree attention on TPU (Mosaic): a flash-decoding pass over the cache blocks, then the new-token block.

Grid (B, K, cache blocks). One program holds all G query heads of one kv head as rows of a [T*G, H] block and
keeps the online softmax (running max m, sum l, accumulator acc) in VMEM scratch across the cache axis. The
per-row `length` and `pad` are scalar-prefetched into SMEM: blocks outside [pad, length) are skipped with
`pl.when`, and the index maps clamp their block index to the row's first / last visible block, so the pipeline
re-uses the buffer it holds instead of fetching a block nobody reads (no out-of-range DMA either). The U new
tokens are attended in the last grid step, right before the single output write.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.tree_attention import blocks, layout
from pallas_kernels.tree_attention.reference import MASK_VALUE


def _visible_blocks(b, length_ref, pad_ref, block_s: int, n_blocks: int):
    """(first, last) cache block holding a visible slot of row b; first == last (and unread) when none is.
    `lax.div` truncates (lengths are >= 0): jnp's floor division lowers through `sign`, which asks Mosaic for the
    TPU generation and so fails to export on a machine without one."""
    first = jnp.minimum(jax.lax.div(pad_ref[b], block_s), n_blocks - 1)
    last = jnp.minimum(jax.lax.div(length_ref[b] + block_s - 1, block_s), n_blocks) - 1
    return first, jnp.maximum(last, first)


def _online_update(s, vis, v, m_sc, l_sc, acc_sc):
    """Folds one key block (scores s [TG, X] f32, visibility vis, values v [X, H]) into the running softmax.
    Invisible entries get p = 0 exactly, so a row that has seen nothing yet keeps l = 0 and acc = 0."""
    s = jnp.where(vis, s, MASK_VALUE)
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
    p = jnp.where(vis, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=-1, keepdims=True)
    acc_sc[...] = alpha * acc_sc[...] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    m_sc[...] = m_new


def _kernel(length_ref, pad_ref,  # SMEM [B] each (scalar prefetch)
            q_ref,  # [TG, H]
            k_ref, v_ref,  # [block_s, H]: one kv head's cache block
            kn_ref, vn_ref,  # [U, H]: the new tokens of that kv head
            mask_ref,  # [TG, U] int32
            o_ref,  # [TG, H]
            m_sc, l_sc, acc_sc,  # VMEM [TG, 1], [TG, 1], [TG, H] f32
            *, block_s: int, scale: float):
    b, j = pl.program_id(0), pl.program_id(2)
    length, pad = length_ref[b], pad_ref[b]

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def scores(k_blk):
        return jax.lax.dot_general(q_ref[...], k_blk, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32) * scale

    @pl.when((j * block_s < length) & ((j + 1) * block_s > pad))
    def _cache_block():
        # Slots of a partial block past S and slots outside [pad, length) may hold anything (NaN included):
        # `where` drops them from the scores and zeroes their values before the product.
        col = j * block_s + jax.lax.broadcasted_iota(jnp.int32, (1, block_s), 1)
        row = j * block_s + jax.lax.broadcasted_iota(jnp.int32, (block_s, 1), 0)
        v = jnp.where((row >= pad) & (row < length), v_ref[...], 0).astype(v_ref.dtype)
        _online_update(scores(k_ref[...]), (col >= pad) & (col < length), v, m_sc, l_sc, acc_sc)

    @pl.when(j == pl.num_programs(2) - 1)
    def _new_tokens_and_write():
        _online_update(scores(kn_ref[...]), mask_ref[...] != 0, vn_ref[...], m_sc, l_sc, acc_sc)
        l = l_sc[...]
        inv = jnp.where(l > 0, 1.0 / l, 0.0)  # a query that saw nothing (padding) gets 0, not NaN
        o_ref[...] = (acc_sc[...] * inv).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_s", "interpret"))
def tree_attention_tpu(q: Float[Array, "B T N H"], k_cache: Float[Array, "B S K H"],
                       v_cache: Float[Array, "B S K H"], length: Int[Array, " B"], pad: Int[Array, " B"],
                       k_new: Float[Array, "B U K H"], v_new: Float[Array, "B U K H"],
                       mask_new: Bool[Array, "B T U"] | Int[Array, "B T U"], *, block_s: int | None = None,
                       interpret=False) -> Float[Array, "B T N H"]:
    """`tree_attention_reference` as one Mosaic kernel (inputs checked by the caller). `block_s`: cache slots
    per grid step (default: `blocks.CACHE_BLOCK`; a multiple of 16 or at least S)."""
    b, t, n, h = q.shape
    s_len, kh = k_cache.shape[1], k_cache.shape[2]
    g = n // kh
    block_s = min(block_s or blocks.cache_block("tpu", h, q.dtype), s_len)
    n_blocks = pl.cdiv(s_len, block_s)
    k_new, v_new, mask_new = layout.pad_new(k_new, v_new, mask_new, blocks.TPU_NEW_ROWS)
    k_new, v_new = layout.hide_unseen(mask_new, k_new, v_new)
    u = k_new.shape[1]
    sq = pl.Squeezed()

    def cache_map(bi, hi, j, length_ref, pad_ref):
        first, last = _visible_blocks(bi, length_ref, pad_ref, block_s, n_blocks)
        return bi, jnp.clip(j, first, last), hi, 0, 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, kh, n_blocks),
        in_specs=[
            pl.BlockSpec((sq, sq, t * g, h), lambda bi, hi, j, *_: (bi, hi, 0, 0)),
            pl.BlockSpec((sq, block_s, sq, sq, h), cache_map),
            pl.BlockSpec((sq, block_s, sq, sq, h), cache_map),
            pl.BlockSpec((sq, u, sq, sq, h), lambda bi, hi, j, *_: (bi, 0, hi, 0, 0)),
            pl.BlockSpec((sq, u, sq, sq, h), lambda bi, hi, j, *_: (bi, 0, hi, 0, 0)),
            pl.BlockSpec((sq, t * g, u), lambda bi, hi, j, *_: (bi, 0, 0)),
        ],
        out_specs=pl.BlockSpec((sq, sq, t * g, h), lambda bi, hi, j, *_: (bi, hi, 0, 0)),
        scratch_shapes=[pltpu.VMEM((t * g, 1), jnp.float32), pltpu.VMEM((t * g, 1), jnp.float32),
                        pltpu.VMEM((t * g, h), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, block_s=block_s, scale=h**-0.5),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, kh, t * g, h), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="tree_attention_tpu",
    )(length.astype(jnp.int32), pad.astype(jnp.int32), layout.group_queries(q, kh),
      layout.head_view(k_cache), layout.head_view(v_cache), layout.head_view(k_new), layout.head_view(v_new),
      layout.row_mask(mask_new, g))
    return layout.ungroup_queries(out, t)
