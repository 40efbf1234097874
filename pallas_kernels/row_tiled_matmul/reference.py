"""The row-tiled matmul in jnp: the kernels' oracle and the path where they do not run (CPU), plus input checks.

Y = X · Wᵀ for activations X [M, D] and a weight W stored [E, D] ("ED") or [D, E] ("DE"), accumulated in float32,
computed in fixed tiles of `rows` rows: the same compiled body for every tile, so a row's bits do not depend on M.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

Layout = Literal["ED", "DE"]

#: Rows per tile on CPU (XLA:CPU's GEMM: a row's bits depend neither on its place in the tile nor on the other rows).
CPU_ROWS = 8


def check_inputs(x, w, w_layout: Layout) -> tuple[int, int, int]:
    """(M, D, E); ValueError when X and W do not fit together."""
    if w_layout not in ("ED", "DE"):
        raise ValueError(f"w_layout must be 'ED' or 'DE', got {w_layout!r}")
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"row_tiled_matmul takes 2-D activations and weight, got {x.shape} and {w.shape}")
    e, d = w.shape if w_layout == "ED" else w.shape[::-1]
    if x.shape[1] != d:
        raise ValueError(f"activations {x.shape} [M, D] and weight {w.shape} [{', '.join(w_layout)}] disagree on D")
    return x.shape[0], d, e


def row_tiled_matmul_reference(x: Float[Array, "M D"], w: Float[Array, "E D"] | Float[Array, "D E"],
                               w_layout: Layout = "ED", rows: int = CPU_ROWS) -> Float[Array, "M E"]:
    m, d, _ = check_inputs(x, w, w_layout)
    n = -(-m // rows)
    tiles = jnp.pad(x, ((0, n * rows - m), (0, 0))).reshape(n, rows, d)
    spec = "MD,ED->ME" if w_layout == "ED" else "MD,DE->ME"
    y = jax.lax.map(lambda t: jnp.einsum(spec, t, w, preferred_element_type=jnp.float32), tiles)
    return y.reshape(n * rows, -1)[:m]
