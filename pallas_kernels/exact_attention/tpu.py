"""Fixed-order attention on TPU (Mosaic): grid (B, K, query tiles, slot blocks), online softmax in VMEM scratch.

A program holds one tile of `query_tile` queries of one kv head ([query_tile * G, H], all G heads as rows) and
steps through the cache one `SLOT_BLOCK` at a time, in order. pad, start and each tile's last visible block are
scalar-prefetched: blocks no query of the tile sees are skipped with `pl.when`, and the cache index maps clamp to
the visible range, so the pipeline re-uses the buffer it holds instead of fetching a block nobody reads. A block
entirely below `start` (or any block in written mode) is one shared tile dot. In overlay mode a block from the
one holding `start` on is "mixed": for each query of the tile its own block is built (the committed slots, then
its window tokens placed by a one-hot [SLOT_BLOCK, U] x [U, H] product, exact since one term is nonzero) and the
same tile dots run on it, keeping that query's rows. The output is written once, at the last block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.exact_attention import layout
from pallas_kernels.exact_attention.blocks import QUERY_TILE, SLOT_BLOCK
from pallas_kernels.exact_attention.reference import (
    block_scores,
    block_softmax,
    block_values,
    dot_precision,
    finish,
)

# The window tokens are padded to a multiple of this many (bf16 packs 16 rows per vreg).
NEW_ROWS = 16


def _kernel(pad_ref, start_ref, last_ref,  # SMEM [B], [B], [B * nT] (scalar prefetch)
            q_ref,  # [R, H]: one tile's queries (rows t * G + g)
            k_ref, v_ref,  # [SLOT_BLOCK, H]: one cache block of this kv head
            row_seen_ref,  # [R, SLOT_BLOCK] int32: window slots each row sees (in window blocks)
            tile_seen_ref,  # [SLOT_BLOCK, 1] int32: window slots any query of the tile sees
            *refs,  # overlay: dest [QT, 1, U] int32, k_new, v_new [U, H]; then o_ref [R, H]; scratch
            overlay: bool, qt: int, g: int, s_len: int, n_tiles: int, n_win: int, n_blocks: int, scale: float):
    if overlay:
        dest_ref, kn_ref, vn_ref, o_ref, m_sc, l_sc, acc_sc = refs
    else:
        o_ref, m_sc, l_sc, acc_sc = refs
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    pad, start = pad_ref[b], start_ref[b]
    first_win = jax.lax.div(start, SLOT_BLOCK)
    run = (j >= jax.lax.div(pad, SLOT_BLOCK)) & (j < last_ref[b * n_tiles + i])
    rows, h = q_ref.shape
    dtype = k_ref.dtype

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    slot_col = j * SLOT_BLOCK + jax.lax.broadcasted_iota(jnp.int32, (SLOT_BLOCK, 1), 0)
    slot_row = j * SLOT_BLOCK + jax.lax.broadcasted_iota(jnp.int32, (1, SLOT_BLOCK), 1)

    def committed(slot):
        return (slot >= pad) & (slot < start) & (slot < s_len)

    def in_win(slot):  # the window maps' slots (their blocks are clamped to them, so outside they belong elsewhere)
        return (slot >= first_win * SLOT_BLOCK) & (slot < (first_win + n_win) * SLOT_BLOCK)

    def visible():  # [R, SLOT_BLOCK]
        return committed(slot_row) | (in_win(slot_row) & (row_seen_ref[...] != 0))

    def update(s, vis, weigh):  # weigh(p) -> the block's p · V [R, H]
        m, l, p, alpha = block_softmax(m_sc[...], l_sc[...], s, vis, scale)
        acc_sc[...] = alpha * acc_sc[...] + weigh(p)
        m_sc[...], l_sc[...] = m, l

    shared = run & (j < first_win) if overlay else run

    @pl.when(shared)
    def _shared_block():
        # Slots no query of the tile sees may hold anything (NaN, a partial block past S): zeroed before the dots.
        seen = committed(slot_col) | (in_win(slot_col) & (tile_seen_ref[...] != 0))
        k = jnp.where(seen, k_ref[...], 0).astype(dtype)
        v = jnp.where(seen, v_ref[...], 0).astype(dtype)
        update(block_scores(q_ref[...], k), visible(), lambda p: block_values(p, v))

    def mixed_block():
        below = slot_col < start
        kc = jnp.where(committed(slot_col), k_ref[...], 0).astype(dtype)
        vc = jnp.where(committed(slot_col), v_ref[...], 0).astype(dtype)
        row = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)

        def laid(cache_block, new_ref, qi):  # query qi's block: its seen window tokens at their slots from `start`
            onehot = jnp.where(slot_col == dest_ref[qi], 1.0, 0.0).astype(dtype)  # [SLOT_BLOCK, U]
            placed = jax.lax.dot_general(onehot, new_ref[...], (((1,), (0,)), ((), ())),
                                         precision=dot_precision(dtype), preferred_element_type=jnp.float32)
            return jnp.where(below, cache_block, placed.astype(dtype))

        def mine(qi):
            return (row >= qi * g) & (row < qi * g + g)

        def score(qi, s):
            return jnp.where(mine(qi), block_scores(q_ref[...], laid(kc, kn_ref, qi)), s)

        s = jax.lax.fori_loop(0, qt, score, jnp.zeros((rows, SLOT_BLOCK), jnp.float32))

        def weigh(p):
            def one(qi, pv):
                return jnp.where(mine(qi), block_values(p, laid(vc, vn_ref, qi)), pv)

            return jax.lax.fori_loop(0, qt, one, jnp.zeros((rows, h), jnp.float32))

        update(s, visible(), weigh)

    if overlay:
        pl.when(run & (j >= first_win))(mixed_block)

    @pl.when(j == n_blocks - 1)
    def _write():
        o_ref[...] = finish(l_sc[...], acc_sc[...], o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("query_tile", "interpret"))
def exact_attention_tpu(q: Float[Array, "B T N H"], k_cache: Float[Array, "B S K H"],
                        v_cache: Float[Array, "B S K H"], pad: Int[Array, " B"], start: Int[Array, " B"],
                        window: Bool[Array, "B T U"], k_new: Float[Array, "B U K H"] | None = None,
                        v_new: Float[Array, "B U K H"] | None = None, *, query_tile: int = QUERY_TILE["tpu"],
                        interpret=False) -> Float[Array, "B T N H"]:
    """`exact_attention_reference` as one Mosaic kernel, `query_tile` queries per tile (inputs checked by the
    caller)."""
    b, t, n, h = q.shape
    s_len, kh = k_cache.shape[1], k_cache.shape[2]
    g, u, qt = n // kh, window.shape[2], query_tile
    rows, nt = qt * g, -(-t // qt)
    n_blocks, n_win = -(-s_len // SLOT_BLOCK), layout.window_blocks(u)
    overlay = k_new is not None
    row_seen, tile_seen, dest, last = layout.window_maps(pad, start, window, s_len, overlay=overlay, qt=qt,
                                                         rows=rows, g=g)
    sq = pl.Squeezed()

    def cache_map(bi, hi, i, j, pad_ref, start_ref, last_ref):
        first = jnp.minimum(jax.lax.div(pad_ref[bi], SLOT_BLOCK), n_blocks - 1)
        final = jnp.maximum(jnp.minimum(last_ref[bi * nt + i], n_blocks) - 1, first)
        return bi, jnp.clip(j, first, final), hi, 0, 0

    def win_block(bi, j, start_ref):
        return jnp.clip(j - jax.lax.div(start_ref[bi], SLOT_BLOCK), 0, n_win - 1)

    in_specs = [
        pl.BlockSpec((sq, sq, rows, h), lambda bi, hi, i, j, *_: (bi, hi, i, 0)),
        pl.BlockSpec((sq, SLOT_BLOCK, sq, sq, h), cache_map),
        pl.BlockSpec((sq, SLOT_BLOCK, sq, sq, h), cache_map),
        pl.BlockSpec((sq, rows, SLOT_BLOCK), lambda bi, hi, i, j, p, s, l: (bi, i, win_block(bi, j, s))),
        pl.BlockSpec((sq, sq, SLOT_BLOCK, 1), lambda bi, hi, i, j, p, s, l: (bi, i, win_block(bi, j, s), 0)),
    ]
    operands = [layout.group_queries(q, kh, qt, rows), layout.head_view(k_cache), layout.head_view(v_cache),
                row_seen, tile_seen[..., None]]
    if overlay:
        u_pad = -(-u // NEW_ROWS) * NEW_ROWS
        k_new, v_new = layout.hide_unseen(window, k_new, v_new, u_pad)
        in_specs += [pl.BlockSpec((sq, qt, 1, u_pad), lambda bi, hi, i, j, *_: (bi, i, 0, 0))]
        in_specs += [pl.BlockSpec((sq, u_pad, sq, sq, h), lambda bi, hi, i, j, *_: (bi, 0, hi, 0, 0))] * 2
        operands += [layout.dest_pad(dest, u_pad)[:, :, None, :], layout.head_view(k_new), layout.head_view(v_new)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, kh, nt, n_blocks),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((sq, sq, rows, h), lambda bi, hi, i, j, *_: (bi, hi, i, 0)),
        scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
                        pltpu.VMEM((rows, h), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, overlay=overlay, qt=qt, g=g, s_len=s_len, n_tiles=nt, n_win=n_win,
                          n_blocks=n_blocks, scale=h**-0.5),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, kh, nt * rows, h), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="exact_attention_tpu",
    )(pad.astype(jnp.int32), start.astype(jnp.int32), last.reshape(-1), *operands)
    return layout.ungroup_queries(out, t, qt, g)
