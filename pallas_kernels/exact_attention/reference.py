"""Fixed-order attention in jnp: the kernels' oracle and the path where they do not run (CPU), plus input checks.

Queries q [B, T, N, H] over a cache [B, S, K, H] (GQA: query head n reads kv head n // G, G = N // K). Slot s of
row b is visible to query t
  * written mode (`k_new is None`, the cache holds every key): iff pad <= s < start, or start <= s < start + U and
    window[b, t, s - start];
  * overlay mode (`k_new`, `v_new` [B, U, K, H] given; the cache is only read, its slots from `start` on are stale):
    iff pad <= s < start + n_seen(t), where query t's seen window tokens (u with window[b, t, u], increasing) are
    laid at slots start, start + 1, ... in that order (a tree node sees its ancestors by depth, where the committed
    path will put them).
A slot at or past the capacity S is never visible.

The bits: per query head, the cache (padded with hidden slots to whole `SLOT_BLOCK`s) is read block by block, in
order, through an online softmax in float32 (`block_scores`, `block_softmax`, `block_values`, `finish`: the same
functions run inside both kernels): s = q · K_blk (unscaled), m' = max(m, max of the visible s), p = exp((s - m') *
H**-0.5) where visible else 0, alpha = exp((m - m') * H**-0.5), l' = alpha * l + sum(p), acc' = alpha * acc +
p · V_blk, and at the end acc / l (0 where l = 0). The G heads of a kv head times `query_tile` queries form the rows
of every dot, so each dot has one shape, [query_tile * G, H] x [H, SLOT_BLOCK] for the scores and
[query_tile * G, SLOT_BLOCK] x [SLOT_BLOCK, H] for the weighted sum, whatever T, U and S are. A row of such a dot
does not depend on the other rows, and a block a row does not see is an exact no-op for it (alpha = 1, p = 0), so a
query's output depends neither on the other queries, nor on T, nor on the capacity. In overlay mode the blocks
holding window slots differ per query: each query gets its own block (the cache block with its window tokens laid
over it) through the same tile dots, keeping its rows, so it computes exactly as in written mode over its path.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import checks
from pallas_kernels.exact_attention.blocks import QUERY_TILE, SLOT_BLOCK

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


# ******** One slot block of the online softmax: these exact ops run in the reference and in both kernels. ********


def dot_precision(dtype):
    """Full float32 products for float32 operands (the TPU's and Triton's default is a bf16 / tf32 pass); bfloat16
    operands multiply exactly into the float32 accumulator anyway."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def block_scores(q: Float[Array, "R H"], k: Float[Array, "C H"]) -> Float[Array, "R C"]:
    """Unscaled float32 scores (the scale is applied inside the exponentials: `block_softmax`)."""
    return lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=dot_precision(q.dtype),
                           preferred_element_type=jnp.float32)


def block_values(p: Float[Array, "R C"], v: Float[Array, "C H"]) -> Float[Array, "R H"]:
    return lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=dot_precision(v.dtype),
                           preferred_element_type=jnp.float32)


def block_softmax(m: Float[Array, "R 1"], l: Float[Array, "R 1"], s: Float[Array, "R C"], vis: Bool[Array, "R C"],
                  scale: float):
    """(m, l, p, alpha) after one block of unscaled scores s: running max (unscaled) and sum, the block's weights
    and the old state's factor (acc becomes alpha * acc + p · V). A row that has seen nothing yet (m = -inf) keeps
    l = 0 (alpha and p are 0 rather than NaN); a block a row does not see leaves its m and l unchanged and gives
    alpha = 1, p = 0.

    The scale multiplies a difference right before `exp`, never a term of a sum: compilers contract a product
    feeding an addition into one fused multiply-add where they see both in one piece of code (XLA:CPU inside a
    fusion, LLVM inside a block), and whether they do would then depend on how s was produced (one tile dot, or
    per-query dots merged by a select), changing the bits."""
    m_new = jnp.maximum(m, jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.where(vis, jnp.exp((s - m_safe) * scale), 0.0)
    alpha = jnp.exp((m - m_safe) * scale)
    return m_new, alpha * l + jnp.sum(p, axis=-1, keepdims=True), p, alpha


def finish(l: Float[Array, "R 1"], acc: Float[Array, "R H"], dtype) -> Float[Array, "R H"]:
    """The output rows; 0 for a row that saw nothing."""
    return jnp.where(l > 0, acc / l, 0.0).astype(dtype)


def init_state(rows: int, h: int):
    return (jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, h), jnp.float32))


# ******** The reference. ********


def exact_attention_reference(q: Float[Array, "B T N H"], k_cache: Float[Array, "B S K H"],
                              v_cache: Float[Array, "B S K H"], pad: Int[Array, " B"], start: Int[Array, " B"],
                              window: Bool[Array, "B T U"], k_new: Float[Array, "B U K H"] | None = None,
                              v_new: Float[Array, "B U K H"] | None = None, *, query_tile: int = QUERY_TILE["cpu"]
                              ) -> Float[Array, "B T N H"]:
    """The module's attention with `query_tile` queries per tile (inputs checked by the caller). One compiled tile
    body under `lax.map` over (row, kv head, query tile), an in-order loop over the visible slot blocks inside:
    the program does not grow with T or S."""
    b, t, n, h = q.shape
    s_len, kh = k_cache.shape[1], k_cache.shape[2]
    g, u, qt = n // kh, window.shape[2], query_tile
    nt = -(-t // qt)
    rows = qt * g
    n_blocks = -(-s_len // SLOT_BLOCK)
    overlay = k_new is not None
    scale = h**-0.5
    pad, start = pad.astype(jnp.int32), start.astype(jnp.int32)
    window = jnp.pad(window.astype(bool), ((0, 0), (0, nt * qt - t), (0, 0)))  # padded queries see no window token
    qg = jnp.pad(q, ((0, 0), (0, nt * qt - t), (0, 0), (0, 0))).reshape(b, nt, qt, kh, g, h)
    qg = qg.transpose(0, 3, 1, 2, 4, 5).reshape(b * kh * nt, rows, h)  # tile rows r = t * G + g
    row_query = jnp.asarray(np.arange(rows) // g)  # [R]: a row's query within the tile
    lane = jnp.arange(SLOT_BLOCK, dtype=jnp.int32)

    def tile(args):
        qtile, idx = args  # [R, H], which (row, kv head, tile)
        bi, hi, ti = idx // (kh * nt), idx // nt % kh, idx % nt
        p0, s0 = pad[bi], start[bi]
        win = lax.dynamic_slice_in_dim(window[bi], ti * qt, qt)  # [QT, U]
        if overlay:
            n_seen = jnp.sum(win, axis=-1, dtype=jnp.int32)  # [QT]
            order = jnp.argsort(jnp.where(win, 0, 1), axis=-1, stable=True)  # [QT, U]: seen tokens first, in order
            extent = n_seen
        else:
            extent = jnp.max(jnp.where(win, jnp.arange(1, u + 1), 0), axis=-1)
        lo = p0 // SLOT_BLOCK
        hi_block = jnp.minimum(-(-(s0 + jnp.max(extent)) // SLOT_BLOCK), n_blocks)  # past it: no-op blocks

        def read(cache, j):  # [SLOT_BLOCK, H]; slots past the capacity read the last one (they are hidden)
            return cache[bi, jnp.minimum(j * SLOT_BLOCK + lane, s_len - 1), hi]

        def committed(slot):
            return (slot >= p0) & (slot < s0) & (slot < s_len)

        def visible(slot):  # [R, SLOT_BLOCK]
            off = slot - s0
            if overlay:
                seen = ((off >= 0) & (slot >= p0) & (slot < s_len))[None] & (off[None] < n_seen[:, None])
            else:
                at = jnp.broadcast_to(jnp.clip(off, 0, u - 1), (qt, SLOT_BLOCK))
                seen = ((off >= 0) & (off < u) & (slot < s_len))[None] & jnp.take_along_axis(win, at, axis=1)
            return committed(slot)[None] | seen[row_query]

        def shared(j, carry):  # one block for the whole tile; slots no row sees are zeroed (they may be NaN)
            m, l, acc = carry
            vis = visible(j * SLOT_BLOCK + lane)
            seen = jnp.any(vis, axis=0)[:, None]
            k, v = (jnp.where(seen, read(c, j), 0) for c in (k_cache, v_cache))
            m, l, p, alpha = block_softmax(m, l, block_scores(qtile, k), vis, scale)
            return m, l, alpha * acc + block_values(p, v)

        def mixed(j, carry):  # overlay: a block per query, its window tokens laid from `start`, the same tile dots
            m, l, acc = carry
            slot = j * SLOT_BLOCK + lane
            vis = visible(slot)
            off = slot - s0
            kc, vc = (jnp.where(committed(slot)[:, None], read(c, j), 0) for c in (k_cache, v_cache))

            def laid(cache_block, new, qi):  # [SLOT_BLOCK, H]: query qi's block
                on = ((off >= 0) & (off < n_seen[qi]))[:, None]
                tokens = new[bi, order[qi, jnp.clip(off, 0, u - 1)], hi]
                return jnp.where((slot < s0)[:, None], cache_block, jnp.where(on, tokens, 0))

            def score(qi, s):
                return jnp.where((row_query == qi)[:, None], block_scores(qtile, laid(kc, k_new, qi)), s)

            s = lax.fori_loop(0, qt, score, jnp.zeros((rows, SLOT_BLOCK), jnp.float32))
            m, l, p, alpha = block_softmax(m, l, s, vis, scale)

            def weigh(qi, pv):
                return jnp.where((row_query == qi)[:, None], block_values(p, laid(vc, v_new, qi)), pv)

            return m, l, alpha * acc + lax.fori_loop(0, qt, weigh, jnp.zeros((rows, h), jnp.float32))

        carry = init_state(rows, h)
        if overlay:
            first_mixed = s0 // SLOT_BLOCK  # the block holding `start`: window slots from there on
            carry = lax.fori_loop(lo, jnp.minimum(first_mixed, hi_block), shared, carry)
            carry = lax.fori_loop(jnp.maximum(lo, first_mixed), hi_block, mixed, carry)
        else:
            carry = lax.fori_loop(lo, hi_block, shared, carry)
        return finish(carry[1], carry[2], q.dtype)

    out = lax.map(tile, (qg, jnp.arange(b * kh * nt)))  # [B * K * nT, R, H]
    out = out.reshape(b, kh, nt, qt, g, h).transpose(0, 2, 3, 1, 4, 5).reshape(b, nt * qt, n, h)
    return out[:, :t]


# ******** Input checks: one ValueError per broken contract. ********


def check_inputs(q, k_cache, v_cache, pad, start, window, k_new=None, v_new=None) -> None:
    """Raises ValueError naming the first broken contract."""
    if (k_new is None) != (v_new is None):
        raise ValueError("give both k_new and v_new (overlay mode) or neither (written mode)")
    new = {} if k_new is None else {"k_new": (k_new, 4), "v_new": (v_new, 4)}
    checks.ranks(q=(q, 4), k_cache=(k_cache, 4), v_cache=(v_cache, 4), pad=(pad, 1), start=(start, 1),
                 window=(window, 3), **new)
    b, t, n, h = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    if k_new is not None and k_new.shape != v_new.shape:
        raise ValueError(f"k_new {k_new.shape} and v_new {v_new.shape} differ")
    checks.batch(b, k_cache=k_cache.shape[0], pad=pad.shape[0], start=start.shape[0], window=window.shape[0],
                 **({} if k_new is None else {"k_new": k_new.shape[0]}))
    kh = k_cache.shape[2]
    if k_cache.shape[3] != h or (k_new is not None and k_new.shape[3] != h):
        raise ValueError(f"head dims disagree: q {h}, k_cache {k_cache.shape[3]}"
                         + ("" if k_new is None else f", k_new {k_new.shape[3]}"))
    if k_new is not None and k_new.shape[2] != kh:
        raise ValueError(f"kv heads disagree: k_cache {kh}, k_new {k_new.shape[2]}")
    if n % kh:
        raise ValueError(f"query heads N={n} are not a multiple of the kv heads K={kh}")
    if window.shape[1] != t or (k_new is not None and window.shape[2] != k_new.shape[1]):
        want = f"[{b}, {t}, U]" if k_new is None else f"[{b}, {t}, {k_new.shape[1]}]"
        raise ValueError(f"window must be [B, T, U] = {want}, got {window.shape}")
    arrays = [q, k_cache, v_cache] + ([] if k_new is None else [k_new, v_new])
    dtypes = {jnp.dtype(x.dtype) for x in arrays}
    if len(dtypes) != 1 or not dtypes <= set(DTYPES):
        names = "q, k_cache, v_cache" + ("" if k_new is None else ", k_new, v_new")
        raise ValueError(f"{names} must share one dtype of float32 / bfloat16, got {sorted(str(d) for d in dtypes)}")
    for name, x in (("pad", pad), ("start", start)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {x.dtype}")
    if not (window.dtype == jnp.bool_ or jnp.issubdtype(window.dtype, jnp.integer)):
        raise ValueError(f"window must be bool or integer, got {window.dtype}")

