"""The kernels' array layouts, built by their wrappers (plain jnp, O(B·T·U) work, no copy of the cache).

Queries of one kv head are laid out in tiles of `query_tile` queries, each tile a [rows, H] matrix whose row
r = t * G + g (r < query_tile * G; the GPU kernel pads a tile to a power of 2 rows, and its extra rows see
nothing). The window is turned into slot coordinates over the `window_blocks(U)` slot blocks from the one holding
`start` (every window slot lies in them): per query row, which of those slots it sees beyond the committed prefix
[pad, start); per tile, which slots any of its queries sees (the others are zeroed before a dot); and in overlay
mode, per query, the slot each of its seen window tokens lands on (`dest`, -1 for a token it does not see).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.exact_attention.blocks import SLOT_BLOCK


def window_blocks(u: int) -> int:
    """The most slot blocks that a run of u slots can touch."""
    return (u + SLOT_BLOCK - 2) // SLOT_BLOCK + 1


def group_queries(q: Float[Array, "B T N H"], kh: int, qt: int, rows: int) -> Float[Array, "B K R H"]:
    """[B, K, nT * rows, H]: tile i's query t, head g at row i * rows + t * G + g (zero rows pad T and the tile)."""
    b, t, n, h = q.shape
    g, nt = n // kh, -(-t // qt)
    q = jnp.pad(q, ((0, 0), (0, nt * qt - t), (0, 0), (0, 0))).reshape(b, nt, qt, kh, g, h)
    q = q.transpose(0, 3, 1, 2, 4, 5).reshape(b, kh, nt, qt * g, h)
    return jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, rows - qt * g), (0, 0))).reshape(b, kh, nt * rows, h)


def ungroup_queries(o: Float[Array, "B K R H"], t: int, qt: int, g: int) -> Float[Array, "B T N H"]:
    b, kh, nr, h = o.shape
    nt = -(-t // qt)
    o = o.reshape(b, kh, nt, nr // nt, h)[:, :, :, : qt * g].reshape(b, kh, nt, qt, g, h)
    return o.transpose(0, 2, 3, 1, 4, 5).reshape(b, nt * qt, kh * g, h)[:, :t]


def window_maps(pad: Int[Array, " B"], start: Int[Array, " B"], window: Bool[Array, "B T U"], s_len: int, *,
                overlay: bool, qt: int, rows: int, g: int):
    """(row_seen [B, nT * rows, C] int32, tile_seen [B, nT, C] int32, dest [B, nT * qt, U] int32 or None,
    last_block [B, nT] int32) over the C = window_blocks(U) * SLOT_BLOCK slots from block start // SLOT_BLOCK:
    window slots each query row sees, the union over a tile, overlay destinations, and one past the last slot
    block any query of a tile sees (0 when none)."""
    b, t, u = window.shape
    nt = -(-t // qt)
    window = jnp.pad(window.astype(bool), ((0, 0), (0, nt * qt - t), (0, 0)))
    pad, start = pad.astype(jnp.int32)[:, None], start.astype(jnp.int32)[:, None]
    slot = (start // SLOT_BLOCK) * SLOT_BLOCK + jnp.arange(window_blocks(u) * SLOT_BLOCK, dtype=jnp.int32)[None]
    off = slot - start  # [B, C]
    if overlay:
        n_seen = jnp.sum(window, axis=-1, dtype=jnp.int32)  # [B, Tp]
        seen = ((off >= 0) & (slot >= pad) & (slot < s_len))[:, None] & (off[:, None] < n_seen[:, :, None])
        dest = jnp.where(window, start[:, :, None] + jnp.cumsum(window, axis=-1, dtype=jnp.int32) - 1, -1)
    else:
        at = jnp.broadcast_to(jnp.clip(off, 0, u - 1)[:, None], (b, nt * qt, off.shape[1]))
        seen = ((off >= 0) & (off < u) & (slot < s_len))[:, None] & jnp.take_along_axis(window, at, axis=2)
        dest = None
    per_tile = seen.reshape(b, nt, qt, -1)  # [B, nT, QT, C]
    row_seen = jnp.repeat(per_tile, g, axis=2)
    row_seen = jnp.pad(row_seen, ((0, 0), (0, 0), (0, rows - qt * g), (0, 0))).reshape(b, nt * rows, -1)
    tile_seen = jnp.any(per_tile, axis=2)  # [B, nT, C]
    end = jnp.max(jnp.where(tile_seen, slot[:, None] + 1, 0), axis=-1)  # [B, nT]
    committed_end = jnp.where(pad < jnp.minimum(start, s_len), jnp.minimum(start, s_len), 0)  # [B, 1]
    last_block = -(-jnp.maximum(end, committed_end) // SLOT_BLOCK)
    return row_seen.astype(jnp.int32), tile_seen.astype(jnp.int32), dest, last_block.astype(jnp.int32)


def hide_unseen(window: Bool[Array, "B T U"], k_new: Float[Array, "B U K H"], v_new: Float[Array, "B U K H"],
                u_pad: int):
    """Window tokens no query sees zeroed (they may be NaN, and the one-hot products would carry 0 · NaN), padded
    with zero tokens to u_pad."""
    seen = jnp.any(window.astype(bool), axis=1)[:, :, None, None]
    widen = ((0, 0), (0, u_pad - k_new.shape[1]), (0, 0), (0, 0))
    return tuple(jnp.pad(jnp.where(seen, x, 0).astype(x.dtype), widen) for x in (k_new, v_new))


def dest_pad(dest: Int[Array, "B T U"], u_pad: int) -> Int[Array, "B T U"]:
    return jnp.pad(dest, ((0, 0), (0, 0), (0, u_pad - dest.shape[2])), constant_values=-1)


def head_view(x: Float[Array, "B S K H"]) -> Float[Array, "B S K 1 H"]:
    """A unit axis so a Mosaic block can pick one kv head ([.., 1, H] blocks are legal, [.., K, H] with K squeezed
    are not)."""
    b, s, kh, h = x.shape
    return x.reshape(b, s, kh, 1, h)
