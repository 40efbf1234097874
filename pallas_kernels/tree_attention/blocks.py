"""Block sizes of the tree-attention kernels, by (backend, head dim, dtype).

First guesses sized to fit, not tuned: no accelerator has run these kernels yet. TPU: cache slots per grid step
(a multiple of 16, so bf16 sublane packing holds; the all-G query block [T*G, H] and the f32 scores [T*G, S_blk]
stay well inside the default scoped VMEM at W = 64, G = 8). GPU: cache slots per loop step and query rows per
program (powers of 2, at least 16, as Triton's dot needs).
"""

from __future__ import annotations

import jax.numpy as jnp

# (backend, head dim, dtype name) -> cache slots per step.
CACHE_BLOCK = {
    ("tpu", 64, "bfloat16"): 512, ("tpu", 128, "bfloat16"): 512,
    ("tpu", 64, "float32"): 512, ("tpu", 128, "float32"): 256,
    ("gpu", 64, "bfloat16"): 64, ("gpu", 128, "bfloat16"): 64,
    ("gpu", 64, "float32"): 64, ("gpu", 128, "float32"): 32,
}

# TPU: the new-token block is padded to a multiple of this many rows (bf16 packs 16 rows per vreg).
TPU_NEW_ROWS = 16

# GPU query rows (of the [T*G, H] layout) per program: the accumulator lives in registers.
GPU_QUERY_BLOCK = {64: 64, 128: 64}


def cache_block(backend: str, head_dim: int, dtype) -> int:
    return CACHE_BLOCK[(backend, head_dim, jnp.dtype(dtype).name)]
