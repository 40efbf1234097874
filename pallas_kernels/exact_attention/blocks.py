"""Tile sizes of the fixed-order attention (`pallas_kernels.exact_attention`), by platform.

A query's bits are a function of its own data only because every dot it takes part in has one fixed shape: rows are
`QUERY_TILE[platform]` queries times the G query heads of one kv head, keys come in `SLOT_BLOCK`-slot blocks added in
order. The slot block is the same everywhere (a cache's capacity then never changes a row's bits: trailing blocks are
exact no-ops); the query tile is the platform's (MXU / tensor-core friendly on TPU / GPU, small on CPU). The GPU
kernel pads a tile's rows to a power of 2 (Triton's block shapes), so its dots are [pow2(QUERY_TILE * G), H] there.
"""

from __future__ import annotations

#: Cache slots per block: scores, weights and weighted sums are taken block by block, the blocks folded in order.
SLOT_BLOCK = 128

#: Queries per tile (each with its G heads as rows) on each platform; "cpu" is the jnp reference's.
QUERY_TILE = {"tpu": 16, "gpu": 16, "cpu": 8}
