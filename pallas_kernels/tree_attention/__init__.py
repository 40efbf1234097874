"""Tree attention: W tree queries over a committed KV cache plus the ancestor mask among the W new tokens.

    from pallas_kernels.tree_attention import tree_attention
    out = tree_attention(q, k_cache, v_cache, length, pad, k_new, v_new, mask_new)   # [B, T, N, H]

Cache slot s is visible to every query of row b iff pad[b] <= s < length[b]; new token u is visible to query t
iff mask_new[b, t, u]. No [B, T, S] mask is built: the kernels read only the visible cache blocks.
`reference.tree_attention_reference` is the oracle and the XLA path; `tpu.py` (Mosaic) and `gpu.py` (Triton)
are the kernels.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.tree_attention.gpu import tree_attention_gpu
from pallas_kernels.tree_attention.reference import check_inputs, tree_attention_reference
from pallas_kernels.tree_attention.tpu import tree_attention_tpu

__all__ = ["tree_attention", "tree_attention_gpu", "tree_attention_reference", "tree_attention_tpu"]

Impl = Literal["auto", "reference", "tpu", "gpu"]


def _pick(impl: Impl, interpret) -> str:
    """auto: the backend's kernel; on CPU the reference, or the TPU kernel when asked to interpret."""
    if impl not in ("auto", "reference", "tpu", "gpu"):
        raise ValueError(f"impl must be one of auto, reference, tpu, gpu; got {impl!r}")
    if impl != "auto":
        return impl
    backend = jax.default_backend()
    if backend in ("tpu", "gpu"):
        return backend
    return "tpu" if interpret else "reference"


@functools.partial(jax.jit, static_argnames=("impl", "interpret", "block_s"))
def tree_attention(q: Float[Array, "B T N H"], k_cache: Float[Array, "B S K H"], v_cache: Float[Array, "B S K H"],
                   length: Int[Array, " B"], pad: Int[Array, " B"], k_new: Float[Array, "B U K H"],
                   v_new: Float[Array, "B U K H"], mask_new: Bool[Array, "B T U"] | Int[Array, "B T U"], *,
                   impl: Impl = "auto", interpret=False, block_s: int | None = None) -> Float[Array, "B T N H"]:
    """GQA attention of q over the cache slots [pad, length) of each row and the new tokens under `mask_new`.

    impl: "auto" (tpu / gpu kernel by backend; the reference on CPU unless `interpret`), or one by name.
    interpret: run a kernel in Pallas interpret mode (True, or `pltpu.InterpretParams()` for the TPU
    simulator). block_s: cache slots per kernel step (default: `blocks.CACHE_BLOCK`).
    A query that sees no key at all (padding) gets 0 from the kernels and a uniform average from the reference.
    """
    which = _pick(impl, interpret)
    check_inputs(q, k_cache, v_cache, length, pad, k_new, v_new, mask_new, kernel=which != "reference")
    if which == "reference":
        return tree_attention_reference(q, k_cache, v_cache, length, pad, k_new, v_new, mask_new)
    kernel = tree_attention_tpu if which == "tpu" else tree_attention_gpu
    return kernel(q, k_cache, v_cache, length, pad, k_new, v_new, mask_new, block_s=block_s, interpret=interpret)
