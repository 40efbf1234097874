"""Width buckets: run a forward at the smallest static width that holds the nodes a step actually has.

Trees, frontiers and pending tokens are padded to static capacities, but their valid entries are packed at the
front. One `lax.switch` over a few static widths makes a step pay for the entries it has, with every branch
compiled once up front (no recompiles: the branch index is an array). On a CPU a 65-wide target forward costs
~9x a 1-wide one, so this is the difference between speculation paying or not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int


def sizes(capacity: int, smallest: int = 1, ratio: int = 4) -> tuple[int, ...]:
    """Widths smallest, smallest·ratio, ... below `capacity`, then `capacity` itself; just (capacity,) when
    ratio < 2 (bucketing off). Every width is one more compiled copy of a forward, hence ratio 4 by default:
    (2, 8, 32, 65) for a 64-node tree."""
    if ratio < 2:
        return (capacity,)
    out, w = [], max(1, smallest)
    while w < capacity:
        out.append(w)
        w *= ratio
    return tuple(out) + (capacity,)


def draft_sizes(capacity: int, ratio: int = 4) -> tuple[int, ...]:
    """The draft's widths (catch-up, tree levels) for up to `capacity` rows: `sizes(capacity, 1, ratio)` and
    width 2 (with bucketing on): a catch-up after one accepted token has two rows, and a two-row forward is the
    cheapest one past a single row wherever matmuls cost by their columns (XLA's dot on any backend)."""
    base = sizes(capacity, 1, ratio)
    if len(base) > 1 and capacity > 2:
        base = tuple(sorted(set(base) | {2}))
    return base


def verify_sizes(tree_size: int, ratio: int = 4, retrieval: int = 0) -> tuple[int, ...]:
    """The target's verify widths for trees of `tree_size` slots (root included): `sizes(tree_size, 2, ratio)` and
    width 4 (with bucketing on): on CPU the skinny matmul kernel makes a 4-row verify cost about 1.1 one-row steps
    against 1.5 for the 8-row bucket, so small trees need a bucket of their own (`cpu_kernels/skinny_matmul`). A
    policy with retrieval chains of length L (`TreePolicy.retrieval`) also gets width 1 and the root + one whole
    chain rounded up to a multiple of 8. With node budget 0 only the chains are verified: a step whose chain is
    gated off or missing is then the root alone, which costs a plain decoding step at width 1 instead of 1.4-1.5
    of one at width 2 (2-core CPU). The rounding, because XLA:CPU's matmuls run whole 8-row tiles: 7 and 9 rows
    cost 63 and 76 ms there against 60 for 8 (16 rows: 78)."""
    base = sizes(tree_size, 2, ratio)
    if len(base) > 1 and tree_size > 4:
        base = tuple(sorted(set(base) | {4}))
    if not retrieval or len(base) == 1:
        return base
    return tuple(sorted(set(base) | {1, min(-(-(retrieval + 1) // 8) * 8, tree_size)}))


def switch(n: Int[Array, ""], widths: tuple[int, ...], branch: Callable[[int], Callable[[], Any]]) -> Any:
    """Runs `branch(w)()` for the smallest `w` in `widths` with w >= n (the largest if none).

    `branch(w)` must return a zero-argument function whose outputs have the same shapes for every `w` (pad or
    gather back to the static capacity inside it). With one width this is a plain call.
    """
    if len(widths) == 1:
        return branch(widths[0])()
    idx = jnp.searchsorted(jnp.asarray(widths, jnp.int32), n.astype(jnp.int32), side="left")
    idx = jnp.minimum(idx, len(widths) - 1)
    return jax.lax.switch(idx, [lambda _, w=w: branch(w)() for w in widths], None)
