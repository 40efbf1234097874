"""Fixed-order attention on GPU (Pallas on Triton): one program per (row, kv head, query tile).

A program holds one tile of `query_tile` queries of one kv head (rows t * G + g, padded to a power of 2 as
Triton's dot needs; the padding rows see nothing) and loops over the slot blocks its tile sees, in order: the loop
bounds come from pad and the tile's last visible block, so no other block is loaded. The cache stays in the
model's layout; a block past the capacity is read with a masked load. Blocks below `start` (every block in
written mode) are one shared tile dot; in overlay mode the blocks from the one holding `start` on are "mixed":
for each query its own block is built (committed slots, then its window tokens placed by a one-hot
[SLOT_BLOCK, U] x [U, H] product, exact since one term is nonzero) and the same tile dots run on it, keeping that
query's rows. Triton's lowering is picked by its `CompilerParams` (Pallas's GPU default is Mosaic GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.exact_attention import layout
from pallas_kernels.exact_attention.blocks import QUERY_TILE, SLOT_BLOCK
from pallas_kernels.exact_attention.reference import (
    block_scores,
    block_softmax,
    block_values,
    dot_precision,
    finish,
    init_state,
)


def next_pow2(x: int, least: int = 16) -> int:
    return max(least, 1 << (x - 1).bit_length())


def _kernel(pad_ref, start_ref, last_ref,  # [] int32: this row's pad and start, this tile's last block + 1
            q_ref,  # [R, H]
            k_ref, v_ref,  # [S, H]: this kv head's whole cache row (only the tile's visible blocks are loaded)
            row_seen_ref,  # [R, C] int32: window slots each row sees, C = n_win * SLOT_BLOCK from the start block
            tile_seen_ref,  # [C] int32: window slots any query of the tile sees
            *refs,  # overlay: dest [QT, U] int32, k_new, v_new [U, H]; then o_ref [R, H]
            overlay: bool, qt: int, g: int, s_len: int, n_win: int, scale: float):
    if overlay:
        dest_ref, kn_ref, vn_ref, o_ref = refs
    else:
        (o_ref,) = refs
    pad, start, last = pad_ref[...], start_ref[...], last_ref[...]
    q = q_ref[...]
    rows, h = q.shape
    dtype = k_ref.dtype
    first_win = jax.lax.div(start, SLOT_BLOCK)
    lane = jnp.arange(SLOT_BLOCK, dtype=jnp.int32)

    def committed(slot):
        return (slot >= pad) & (slot < start) & (slot < s_len)

    def read(ref, j):  # [SLOT_BLOCK, H]; slots past the capacity read as 0
        inside = jnp.broadcast_to(((j * SLOT_BLOCK + lane) < s_len)[:, None], (SLOT_BLOCK, h))
        return pltriton.load(ref.at[pl.ds(j * SLOT_BLOCK, SLOT_BLOCK), :], mask=inside,
                             other=jnp.zeros((), dtype))

    def window_slots(j):  # (in_win, the window-map column block of slot block j)
        return (j >= first_win) & (j < first_win + n_win), jnp.clip(j - first_win, 0, n_win - 1) * SLOT_BLOCK

    def visible(j):  # [R, SLOT_BLOCK]
        in_win, col = window_slots(j)
        return committed(j * SLOT_BLOCK + lane)[None, :] | (in_win & (row_seen_ref[:, pl.ds(col, SLOT_BLOCK)] != 0))

    def shared(j, carry):
        m, l, acc = carry
        in_win, col = window_slots(j)
        seen = committed(j * SLOT_BLOCK + lane) | (in_win & (tile_seen_ref[pl.ds(col, SLOT_BLOCK)] != 0))
        k = jnp.where(seen[:, None], read(k_ref, j), 0).astype(dtype)  # slots no query sees may be NaN
        v = jnp.where(seen[:, None], read(v_ref, j), 0).astype(dtype)
        m, l, p, alpha = block_softmax(m, l, block_scores(q, k), visible(j), scale)
        return m, l, alpha * acc + block_values(p, v)

    def mixed(j, carry):
        m, l, acc = carry
        slot = (j * SLOT_BLOCK + lane)[:, None]  # [SLOT_BLOCK, 1]
        kc = jnp.where(committed(slot), read(k_ref, j), 0).astype(dtype)
        vc = jnp.where(committed(slot), read(v_ref, j), 0).astype(dtype)
        row = jnp.arange(rows, dtype=jnp.int32)[:, None]

        def laid(cache_block, new, qi):  # query qi's block: its seen window tokens at their slots from `start`
            onehot = jnp.where(slot == dest_ref[pl.ds(qi, 1), :], 1.0, 0.0).astype(dtype)  # [SLOT_BLOCK, U]
            placed = jax.lax.dot_general(onehot, new, (((1,), (0,)), ((), ())), precision=dot_precision(dtype),
                                         preferred_element_type=jnp.float32)
            return jnp.where(slot < start, cache_block, placed.astype(dtype))

        def mine(qi):
            return (row >= qi * g) & (row < qi * g + g)

        def score(qi, s):
            return jnp.where(mine(qi), block_scores(q, laid(kc, kn_ref[...], qi)), s)

        s = jax.lax.fori_loop(0, qt, score, jnp.zeros((rows, SLOT_BLOCK), jnp.float32))
        m, l, p, alpha = block_softmax(m, l, s, visible(j), scale)

        def weigh(qi, pv):
            return jnp.where(mine(qi), block_values(p, laid(vc, vn_ref[...], qi)), pv)

        return m, l, alpha * acc + jax.lax.fori_loop(0, qt, weigh, jnp.zeros((rows, h), jnp.float32))

    lo = jax.lax.div(pad, SLOT_BLOCK)
    carry = init_state(rows, h)
    if overlay:
        carry = jax.lax.fori_loop(lo, jnp.minimum(first_win, last), shared, carry)
        carry = jax.lax.fori_loop(jnp.maximum(lo, first_win), last, mixed, carry)
    else:
        carry = jax.lax.fori_loop(lo, last, shared, carry)
    o_ref[...] = finish(carry[1], carry[2], o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("query_tile", "interpret"))
def exact_attention_gpu(q: Float[Array, "B T N H"], k_cache: Float[Array, "B S K H"],
                        v_cache: Float[Array, "B S K H"], pad: Int[Array, " B"], start: Int[Array, " B"],
                        window: Bool[Array, "B T U"], k_new: Float[Array, "B U K H"] | None = None,
                        v_new: Float[Array, "B U K H"] | None = None, *, query_tile: int = QUERY_TILE["gpu"],
                        interpret=False) -> Float[Array, "B T N H"]:
    """`exact_attention_reference` as one Triton kernel, `query_tile` queries per tile (inputs checked by the
    caller). A head dim that is not a power of 2 (>= 16) is zero-padded to one (a copy of the cache; exact)."""
    b, t, n, h = q.shape
    s_len, kh = k_cache.shape[1], k_cache.shape[2]
    g, u, qt = n // kh, window.shape[2], query_tile
    rows, nt = next_pow2(qt * g), -(-t // qt)
    overlay = k_new is not None
    hp = next_pow2(h)
    if hp != h:
        widen = lambda x: jnp.pad(x, ((0, 0),) * 3 + ((0, hp - h),))  # noqa: E731
        q, k_cache, v_cache = widen(q), widen(k_cache), widen(v_cache)
        k_new, v_new = (None, None) if k_new is None else (widen(k_new), widen(v_new))
    row_seen, tile_seen, dest, last = layout.window_maps(pad, start, window, s_len, overlay=overlay, qt=qt,
                                                         rows=rows, g=g)
    c = row_seen.shape[2]
    sq = pl.Squeezed()
    in_specs = [
        pl.BlockSpec((sq,), lambda bi, hi, i: (bi,)),
        pl.BlockSpec((sq,), lambda bi, hi, i: (bi,)),
        pl.BlockSpec((sq, sq), lambda bi, hi, i: (bi, i)),
        pl.BlockSpec((sq, sq, rows, hp), lambda bi, hi, i: (bi, hi, i, 0)),
        pl.BlockSpec((sq, s_len, sq, sq, hp), lambda bi, hi, i: (bi, 0, hi, 0, 0)),
        pl.BlockSpec((sq, s_len, sq, sq, hp), lambda bi, hi, i: (bi, 0, hi, 0, 0)),
        pl.BlockSpec((sq, rows, c), lambda bi, hi, i: (bi, i, 0)),
        pl.BlockSpec((sq, sq, c), lambda bi, hi, i: (bi, i, 0)),
    ]
    operands = [pad.astype(jnp.int32), start.astype(jnp.int32), last, layout.group_queries(q, kh, qt, rows),
                layout.head_view(k_cache), layout.head_view(v_cache), row_seen, tile_seen]
    if overlay:
        u_pad = next_pow2(u)
        k_new, v_new = layout.hide_unseen(window, k_new, v_new, u_pad)
        in_specs += [pl.BlockSpec((sq, qt, u_pad), lambda bi, hi, i: (bi, i, 0))]
        in_specs += [pl.BlockSpec((sq, u_pad, sq, sq, hp), lambda bi, hi, i: (bi, 0, hi, 0, 0))] * 2
        operands += [layout.dest_pad(dest, u_pad), layout.head_view(k_new), layout.head_view(v_new)]
    out = pl.pallas_call(
        functools.partial(_kernel, overlay=overlay, qt=qt, g=g, s_len=s_len, n_win=layout.window_blocks(u),
                          scale=h**-0.5),
        grid=(b, kh, nt),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((sq, sq, rows, hp), lambda bi, hi, i: (bi, hi, i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kh, nt * rows, hp), q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="exact_attention_gpu",
    )(*operands)
    return layout.ungroup_queries(out, t, qt, g)[..., :h]
