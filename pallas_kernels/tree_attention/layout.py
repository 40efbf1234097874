"""The kernels' array layouts, shared by the TPU and GPU kernels.

Queries of one kv head are laid out as rows r = t*G + g of a [T*G, H] matrix, so one kernel block holds every
query head that reads the same keys (GQA: each cache block is fetched once per kv head, not once per query head).
The cache stays in the model's [B, S, K, H] layout; `head_view` adds a unit axis so a block spec can pick one kv
head (a Mosaic block's last two dims must equal the array's or be (8, 128)-aligned, and [.., K, H] with K squeezed
is neither, while [.., 1, H] is).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def group_queries(q: Float[Array, "B T N H"], kh: int) -> Float[Array, "B K TG H"]:
    b, t, n, h = q.shape
    return q.reshape(b, t, kh, n // kh, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * (n // kh), h)


def ungroup_queries(o: Float[Array, "B K TG H"], t: int) -> Float[Array, "B T N H"]:
    b, kh, tg, h = o.shape
    g = tg // t
    return o.reshape(b, kh, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, kh * g, h)


def row_mask(mask_new: Bool[Array, "B T U"] | Int[Array, "B T U"], g: int) -> Int[Array, "B TG U"]:
    """mask_new per query row of the [T*G, H] layout, int32 (Mosaic's safe mask type)."""
    return jnp.repeat(mask_new.astype(bool).astype(jnp.int32), g, axis=1)


def hide_unseen(mask_new, k_new: Float[Array, "B U K H"], v_new: Float[Array, "B U K H"]):
    """Zeroes new tokens no query sees (tree padding): an unseen NaN key or value would still reach every output
    through the 0 · NaN of the probability-value product."""
    seen = jnp.any(mask_new.astype(bool), axis=1)[:, :, None, None]  # [B, U, 1, 1]
    return jnp.where(seen, k_new, 0).astype(k_new.dtype), jnp.where(seen, v_new, 0).astype(v_new.dtype)


def pad_new(k_new: Float[Array, "B U K H"], v_new: Float[Array, "B U K H"], mask_new, multiple: int):
    """Pads the new tokens to a multiple of `multiple` (hidden from every query). Mosaic's dot with a 1-row
    bf16 operand fails to lower (a mixed-dtype vector.broadcast), and aligned rows suit the matrix unit anyway."""
    u = k_new.shape[1]
    extra = -u % multiple
    if not extra:
        return k_new, v_new, mask_new
    widen = ((0, 0), (0, extra), (0, 0), (0, 0))
    return (jnp.pad(k_new, widen), jnp.pad(v_new, widen),
            jnp.pad(mask_new.astype(bool), ((0, 0), (0, 0), (0, extra))))


def head_view(x: Float[Array, "B S K H"]) -> Float[Array, "B S K 1 H"]:
    b, s, kh, h = x.shape
    return x.reshape(b, s, kh, 1, h)
