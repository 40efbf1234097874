"""Fixed-order ("exact") attention: a query's output bits depend on nothing but what it sees.

    from pallas_kernels.exact_attention import exact_attention
    out = exact_attention(q, k_cache, v_cache, pad, start, window)                 # written mode
    out = exact_attention(q, k_cache, v_cache, pad, start, window, k_new, v_new)   # overlay mode
    # q [B, T, N, H]; caches [B, S, K, H]; pad, start [B]; window [B, T, U]; k_new, v_new [B, U, K, H] -> [B, T, N, H]

The attention of the exact mode (`LMConfig.matmul == "exact"`): a row of a forward has the same bits whatever the
number of rows, so a speculative tree verified in one forward computes every node as plain decoding would.
Written mode: the cache holds every key; query t sees slots [pad, start) and window slot start + u where
window[b, t, u]. Overlay mode: the cache is only read (slots from `start` on are stale) and query t's seen window
tokens are laid at start, start + 1, ... in order, where its committed path will put them; a query then computes
exactly as the same query in written mode over that committed path (`reference.py` gives the full contract).

Each query runs in tiles of `blocks.QUERY_TILE[platform]` queries over `blocks.SLOT_BLOCK`-slot blocks taken in
order, every dot one fixed shape. "auto" picks when lowering (`lax.platform_dependent`): Mosaic on TPU (`tpu.py`),
Triton on CUDA / ROCm (`gpu.py`), elsewhere the jnp reference (`reference.py`), which is the kernels' oracle: the
kernels interpreted on CPU with the reference's tile give its bits. Bits differ across platforms.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.exact_attention.blocks import QUERY_TILE, SLOT_BLOCK
from pallas_kernels.exact_attention.gpu import exact_attention_gpu
from pallas_kernels.exact_attention.reference import check_inputs, exact_attention_reference
from pallas_kernels.exact_attention.tpu import exact_attention_tpu

__all__ = ["QUERY_TILE", "SLOT_BLOCK", "exact_attention", "exact_attention_gpu", "exact_attention_reference",
           "exact_attention_tpu"]

Impl = Literal["auto", "reference", "tpu", "gpu"]


def exact_attention(q: Float[Array, "B T N H"], k_cache: Float[Array, "B S K H"], v_cache: Float[Array, "B S K H"],
                    pad: Int[Array, " B"], start: Int[Array, " B"], window: Bool[Array, "B T U"],
                    k_new: Float[Array, "B U K H"] | None = None, v_new: Float[Array, "B U K H"] | None = None, *,
                    impl: Impl = "auto", interpret: bool = False) -> Float[Array, "B T N H"]:
    """GQA attention of q over the cache slots each query sees, in q's dtype (float32 or bfloat16, shared by all
    the float inputs). A query that sees no slot gets 0.

    impl: "auto" (chosen when lowering: the TPU kernel on TPU, the GPU kernel on CUDA / ROCm, the reference
    elsewhere) or one by name, each with its platform's query tile; `interpret`: run a kernel in Pallas interpret
    mode (a check on CPU)."""
    if impl not in ("auto", "reference", "tpu", "gpu"):
        raise ValueError(f"impl must be one of auto, reference, tpu, gpu; got {impl!r}")
    check_inputs(q, k_cache, v_cache, pad, start, window, k_new, v_new)
    kernels = {
        "reference": functools.partial(exact_attention_reference, query_tile=QUERY_TILE["cpu"]),
        "tpu": functools.partial(exact_attention_tpu, query_tile=QUERY_TILE["tpu"], interpret=interpret),
        "gpu": functools.partial(exact_attention_gpu, query_tile=QUERY_TILE["gpu"], interpret=interpret),
    }
    if impl != "auto":
        return kernels[impl](q, k_cache, v_cache, pad, start, window, k_new, v_new)
    run = {name: functools.partial(fn, k_new=k_new, v_new=v_new) for name, fn in kernels.items()}
    return jax.lax.platform_dependent(q, k_cache, v_cache, pad, start, window, tpu=run["tpu"], cuda=run["gpu"],
                                      rocm=run["gpu"], default=run["reference"])
