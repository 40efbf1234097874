"""Stateless building blocks: RMSNorm, rotary embeddings (with HF's scaling variants), grouped-query attention."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from sage_jax.models.config import RopeConfig

# Finite, so that a query row with no visible key (a padding slot) yields a uniform softmax instead of NaN.
MASK_VALUE = -1e30


def rms_norm(x: Float[Array, "..."], scale: Float[Array, " D"], eps: float, axis: int = -1) -> Float[Array, "..."]:
    """RMS norm over the feature `axis` (the last one, or 0 for feature-major activations [D, M])."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=axis, keepdims=True) + eps)
    # Explicit broadcast axes: the project runs with jax_numpy_rank_promotion="raise".
    shape = [1] * y.ndim
    shape[axis] = -1
    return (y * scale.astype(jnp.float32).reshape(shape)).astype(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies [H/2], attention scaling) for a rotary config, as transformers computes them."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv = 1.0 / rope.theta**exponents
    if rope.type == "default":
        return inv.astype(np.float32), 1.0
    if rope.type == "linear":
        return (inv / rope.factor).astype(np.float32), 1.0
    if rope.type == "llama3":
        low_wl = rope.original_max_position / rope.low_freq_factor
        high_wl = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if rope.type == "yarn":
        dim, base, factor = head_dim, rope.theta, rope.factor
        attn = rope.attention_factor if rope.attention_factor is not None else (
            0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

        def corr_dim(rot):
            return dim * math.log(rope.original_max_position / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr_dim(rope.beta_fast)), 0)
        high = min(math.ceil(corr_dim(rope.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv_interp = inv / factor
        return (inv_interp * (1 - extrapolation) + inv * extrapolation).astype(np.float32), float(attn)
    raise ValueError(f"unknown rope type {rope.type!r}")


def apply_rope(x: Float[Array, "B T N H"], positions: Int[Array, "B T"] | Int[Array, "B T 3"], inv_freq: np.ndarray,
               scale: float = 1.0, mrope_section: tuple[int, ...] = ()) -> Float[Array, "B T N H"]:
    """HF layout ("rotate half"): pairs (x[i], x[i + H/2]) rotate together.

    Positions [B, T, 3] are multimodal (Qwen2.5-VL's M-RoPE): frequency pair j turns by the temporal, height or
    width position, the stream of the `mrope_section` run that holds j (runs cycle t, h, w, t, ...)."""
    if positions.ndim == 3:
        if sum(mrope_section) != len(inv_freq):
            raise ValueError(f"positions [B, T, 3] need an mrope_section summing to {len(inv_freq)}, "
                             f"got {mrope_section}")
        stream = np.concatenate([np.full(n, i % 3) for i, n in enumerate(mrope_section)])
        pos = jnp.take(positions, jnp.asarray(stream), axis=-1).astype(jnp.float32)  # [B, T, H/2]
        angles = pos * jnp.asarray(inv_freq)[None, None]
    else:
        angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None]  # [B, T, H/2]
    cos = (jnp.cos(angles) * scale)[:, :, None, :]
    sin = (jnp.sin(angles) * scale)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attention(q: Float[Array, "B T N H"], k: Float[Array, "B S K H"], v: Float[Array, "B S K H"],
              mask: Bool[Array, "B T S"]) -> Float[Array, "B T N H"]:
    """Grouped-query attention of T queries over S keys under an arbitrary boolean visibility mask.

    The mask carries everything: causal order, left padding, a speculative tree's ancestor relation.
    This is the XLA path and the oracle of the Pallas kernels.
    """
    b, t, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * (h**-0.5)
    s = jnp.where(mask[:, None, None], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("BKGTS,BSKH->BTKGH", p, v)
    return o.reshape(b, t, n, h)


def attention_with_new(q: Float[Array, "B T N H"], k: Float[Array, "B S K H"], v: Float[Array, "B S K H"],
                       mask: Bool[Array, "B T S"], k_new: Float[Array, "B U K H"], v_new: Float[Array, "B U K H"],
                       mask_new: Bool[Array, "B T U"]) -> Float[Array, "B T N H"]:
    """`attention` over a cache's keys and U new tokens' keys kept apart: one softmax over both score blocks, so
    the result is `attention` over the keys concatenated, without building that concatenation (a copy of the
    whole cache)."""
    b, t, n, h = q.shape
    kh, s_len = k.shape[2], k.shape[1]
    qg = q.reshape(b, t, kh, n // kh, h)
    s_old = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * (h**-0.5)
    s_new = jnp.einsum("BTKGH,BUKH->BKGTU", qg, k_new, preferred_element_type=jnp.float32) * (h**-0.5)
    s = jnp.concatenate([jnp.where(mask[:, None, None], s_old, MASK_VALUE),
                         jnp.where(mask_new[:, None, None], s_new, MASK_VALUE)], axis=-1)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = (jnp.einsum("BKGTS,BSKH->BTKGH", p[..., :s_len], v)
         + jnp.einsum("BKGTU,BUKH->BTKGH", p[..., s_len:], v_new))
    return o.reshape(b, t, n, h)


def causal_mask(t: int, pad_left: Int[Array, " B"]) -> Bool[Array, "B T T"]:
    """Causal mask over a self-contained length-t sequence whose first `pad_left[b]` slots are padding."""
    i = jnp.arange(t)
    return (i[None, :] <= i[:, None])[None] & (i[None, None, :] >= pad_left[:, None, None])


# ******** Shape-invariant numerics (`LMConfig.matmul == "exact"`). ********
# XLA picks a matmul's (and a reduction's) blocking by its shape, so the same row rounds differently in a one-token
# decode step and in a verify forward of k + 1 rows (XLA:CPU: a one-row dot runs as a GEMV, two or more rows as a
# GEMM; every row differs in its last bits). In bfloat16 such differences flip near-tied argmaxes, and speculative
# decoding stops equalling plain decoding. The exact mode computes every row in computations whose shapes do not
# depend on the number of rows: matmuls in fixed row tiles (`pallas_kernels.row_tiled_matmul`), the row-wise rest
# in tiles of `ROW_TILE` rows (`tiled_rows`), attention one query at a time (`attention_row`); a row's bits depend
# neither on its place in a tile nor on the other rows (tests/sage_jax/models/test_exact_mode.py).

#: Rows per tile of the exact mode's row-wise computations (norms, RoPE, activations, residuals).
ROW_TILE = 8


def tiled_rows(fn, *xs):
    """fn over fixed tiles of `ROW_TILE` rows: xs [M, ...] each (rows first), padded with zero rows to whole tiles;
    fn maps the tiles [ROW_TILE, ...] to a pytree of [ROW_TILE, ...] arrays. Returns that pytree at [M, ...].

    `lax.map` keeps the tile's computation one compiled body whatever M is, so a row computes to the same bits
    at any M."""
    m = xs[0].shape[0]
    n = -(-m // ROW_TILE)
    tiles = tuple(jnp.pad(x, [(0, n * ROW_TILE - m)] + [(0, 0)] * (x.ndim - 1)).reshape(n, ROW_TILE, *x.shape[1:])
                  for x in xs)
    out = jax.lax.map(lambda t: fn(*t), tiles)
    return jax.tree.map(lambda y: y.reshape(n * ROW_TILE, *y.shape[2:])[:m], out)


#: Cache slots per block of the exact mode's attention: a row's scores and weighted sums are taken block by block
#: and the blocks added in order, so that slots past the last visible one add exact zeros and the row's bits do not
#: depend on the cache's capacity either (plain decoding and speculative decoding size their caches differently).
SLOT_BLOCK = 128


def attention_row(q: Float[Array, "N H"], k: Float[Array, "S K H"], v: Float[Array, "S K H"],
                  visible: Bool[Array, " S"]) -> Float[Array, "N H"]:
    """One query row's grouped-query attention over a whole cache, its bits a function of what it sees alone: not
    of the number of rows in the forward (it runs for one row), nor of the cache's capacity (`SLOT_BLOCK`s added
    in order; hidden slots weigh exactly 0). Scores, exponentials and sums in float32."""
    n, h = q.shape
    s_len, kh = k.shape[:2]
    pad = -s_len % SLOT_BLOCK
    if pad:
        k, v = (jnp.pad(a, ((0, pad), (0, 0), (0, 0))) for a in (k, v))
        visible = jnp.pad(visible, (0, pad))
    qg = q.reshape(kh, n // kh, h)
    blocks = [slice(i, i + SLOT_BLOCK) for i in range(0, s_len + pad, SLOT_BLOCK)]  # static, taken in order
    s = [jnp.where(visible[None, None, b], jnp.einsum("KGH,SKH->KGS", qg, k[b], preferred_element_type=jnp.float32)
                   * (h**-0.5), MASK_VALUE) for b in blocks]
    m = functools.reduce(jnp.maximum, [jnp.max(x, axis=-1, keepdims=True) for x in s])
    total, out = jnp.zeros_like(m), jnp.zeros((kh, n // kh, h), jnp.float32)
    for x, b in zip(s, blocks, strict=True):  # trailing blocks add exact zeros
        p = jnp.exp(x - m)
        total = total + jnp.sum(p, axis=-1, keepdims=True)
        out = out + jnp.einsum("KGS,SKH->KGH", p.astype(v.dtype), v[b], preferred_element_type=jnp.float32)
    return (out / total).reshape(n, h).astype(q.dtype)
