"""The skinny matmul in plain jnp: the oracle of the CPU kernel and the path everywhere else, plus the input checks.

Y = W · X for a weight W [E, D] stored [out, in] and M activation columns, X feature-major [D, M] or token-major
[M, D], Y [E, M] or [M, E] (`x_tokens_major`, `y_tokens_major`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float


def check_inputs(w, x, x_tokens_major: bool) -> int:
    """M, the number of columns; ValueError when W and X do not fit together."""
    if w.ndim != 2 or x.ndim != 2:
        raise ValueError(f"skinny_matmul takes a 2-D weight and 2-D activations, got {w.shape} and {x.shape}")
    m, d = x.shape if x_tokens_major else x.shape[::-1]
    if d != w.shape[1]:
        raise ValueError(f"weight {w.shape} [E, D] and activations {x.shape} "
                         f"({'[M, D]' if x_tokens_major else '[D, M]'}) disagree on D")
    return m


def skinny_matmul_reference(w: Float[Array, "E D"], x: Float[Array, "D M"] | Float[Array, "M D"], *,
                            x_tokens_major: bool = False, y_tokens_major: bool = False
                            ) -> Float[Array, "E M"] | Float[Array, "M E"]:
    check_inputs(w, x, x_tokens_major)
    y = "ME" if y_tokens_major else "EM"
    # Operand order as the models write them (a serving layer "ED,DM->EM", the tied head "MD,ED->ME"): XLA:CPU
    # lays the dot out by it.
    if x_tokens_major:
        return jnp.einsum(f"MD,ED->{y}", x, w)
    return jnp.einsum(f"ED,DM->{y}", w, x)
