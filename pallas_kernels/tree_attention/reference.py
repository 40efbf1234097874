"""Tree attention in plain jnp: the oracle of the Pallas kernels and the XLA path, plus the input checks.

Queries [B, T, N, H] attend to two key blocks at once:
  * the cache [B, S, K, H], where slot s is visible to every query of row b iff pad[b] <= s < length[b] (left
    padding, then the committed prefix; slots from `length` on hold stale or unwritten entries);
  * U new tokens [B, U, K, H] (this forward's own keys, not yet written to the cache) under `mask_new` [B, T, U],
    the tree's ancestor relation (a node sees itself and its ancestors; a chain is the causal mask).
One softmax runs over both blocks, so the result equals attention over the keys concatenated. This is
`sage_jax.models.layers.attention_with_new` with the cache mask given by (pad, length) instead of an array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import checks

# Finite (as in sage_jax.models.layers), so a query that sees no key gets a uniform softmax instead of NaN.
MASK_VALUE = -1e30

KERNEL_HEAD_DIMS = (64, 128)
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def tree_attention_reference(q: Float[Array, "B T N H"], k_cache: Float[Array, "B S K H"],
                             v_cache: Float[Array, "B S K H"], length: Int[Array, " B"], pad: Int[Array, " B"],
                             k_new: Float[Array, "B U K H"], v_new: Float[Array, "B U K H"],
                             mask_new: Bool[Array, "B T U"] | Int[Array, "B T U"]) -> Float[Array, "B T N H"]:
    """GQA attention over the visible cache slots and the new tokens; scale H**-0.5, f32 scores, output in q's
    dtype. Hidden cache slots are multiplied by exact zeros, so they must be finite here (the kernels never read
    them into the output). A query that sees no key at all gets the uniform average of every key (the XLA
    path's padding rows); the kernels give it 0."""
    b, t, n, h = q.shape
    s_len, kh = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)
    s_old = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k_cache, preferred_element_type=jnp.float32) * (h**-0.5)
    s_new = jnp.einsum("BTKGH,BUKH->BKGTU", qg, k_new, preferred_element_type=jnp.float32) * (h**-0.5)
    slot = jnp.arange(s_len, dtype=jnp.int32)[None, :]
    seen = (slot >= pad[:, None]) & (slot < length[:, None])  # [B, S]
    s = jnp.concatenate([jnp.where(seen[:, None, None, None, :], s_old, MASK_VALUE),
                         jnp.where(mask_new.astype(bool)[:, None, None], s_new, MASK_VALUE)], axis=-1)
    p = jax.nn.softmax(s, axis=-1).astype(v_cache.dtype)
    o = (jnp.einsum("BKGTS,BSKH->BTKGH", p[..., :s_len], v_cache)
         + jnp.einsum("BKGTU,BUKH->BTKGH", p[..., s_len:], v_new))
    return o.reshape(b, t, n, h).astype(q.dtype)


# ******** Input checks: one ValueError per broken contract. ********


def check_inputs(q, k_cache, v_cache, length, pad, k_new, v_new, mask_new, *, kernel: bool) -> None:
    """Raises ValueError naming the first broken contract; `kernel`: also the kernels' head-dim limit."""
    checks.ranks(q=(q, 4), k_cache=(k_cache, 4), v_cache=(v_cache, 4), length=(length, 1), pad=(pad, 1),
                 k_new=(k_new, 4), v_new=(v_new, 4), mask_new=(mask_new, 3))
    b, t, n, h = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    if k_new.shape != v_new.shape:
        raise ValueError(f"k_new {k_new.shape} and v_new {v_new.shape} differ")
    checks.batch(b, k_cache=k_cache.shape[0], k_new=k_new.shape[0], mask_new=mask_new.shape[0],
                 length=length.shape[0], pad=pad.shape[0])
    if k_cache.shape[3] != h or k_new.shape[3] != h:
        raise ValueError(f"head dims disagree: q {h}, k_cache {k_cache.shape[3]}, k_new {k_new.shape[3]}")
    if k_cache.shape[2] != k_new.shape[2]:
        raise ValueError(f"kv heads disagree: k_cache {k_cache.shape[2]}, k_new {k_new.shape[2]}")
    if n % k_cache.shape[2]:
        raise ValueError(f"query heads N={n} are not a multiple of the kv heads K={k_cache.shape[2]}")
    if mask_new.shape[1:] != (t, k_new.shape[1]):
        raise ValueError(f"mask_new must be [B, T, U] = [{b}, {t}, {k_new.shape[1]}], got {mask_new.shape}")
    if kernel and h not in KERNEL_HEAD_DIMS:
        raise ValueError(f"the kernels support head dims {KERNEL_HEAD_DIMS}, got {h} (use impl='reference')")
    dtypes = {jnp.dtype(x.dtype) for x in (q, k_cache, v_cache, k_new, v_new)}
    if len(dtypes) != 1 or not dtypes <= set(DTYPES):
        raise ValueError(f"q, k_cache, v_cache, k_new, v_new must share one dtype of float32 / bfloat16, "
                         f"got {sorted(str(d) for d in dtypes)}")
    for name, x in (("length", length), ("pad", pad)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {x.dtype}")
    if not (mask_new.dtype == jnp.bool_ or jnp.issubdtype(mask_new.dtype, jnp.integer)):
        raise ValueError(f"mask_new must be bool or integer, got {mask_new.dtype}")
