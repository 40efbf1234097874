"""Verification of a draft tree against the target's distributions at every node.

Greedy: the accepted path is the unique root-to-node chain whose tokens equal the target's argmax at each
parent; the bonus token is the argmax at its last node. Temperature > 0: sequential rejection over the
deterministic siblings (EAGLE-2/3 rule, sage.md §2.3): at node c with target distribution p, try the children
x_1, x_2, ... in slot order, accepting x_j with probability p(x_j) / (1 − Σ_{i<j} p(x_i)); on acceptance descend,
otherwise sample the bonus token from p with every child removed. This draws exactly from p, for any tree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sage_jax.decoding.tree import Tree


def _path_from(tree: Tree, last: Int[Array, " B"], max_depth: int) -> Int[Array, "B A"]:
    """Slots of the root-to-`last` path, indexed by depth ([B, A], A = max_depth + 1; unused depths hold `last`)."""
    on_path = jnp.take_along_axis(tree.ancestors, last[:, None, None], 1)[:, 0]  # [B,W]
    depth_of = jnp.where(on_path, tree.depth, max_depth + 1)
    path = jnp.broadcast_to(last[:, None], (last.shape[0], max_depth + 1))
    return jax.vmap(lambda p, d, n: p.at[d].set(n, mode="drop"))(
        path, depth_of, jnp.broadcast_to(jnp.arange(tree.size), depth_of.shape))


def accept_greedy(tree: Tree, target_logits: Float[Array, "B W V"], max_depth: int
                  ) -> tuple[Int[Array, "B A"], Int[Array, " B"], Int[Array, " B"]]:
    """(path slots [B, A] (A = max_depth + 1), accepted length τ [B], bonus token [B])."""
    return accept_greedy_best(tree, jnp.argmax(target_logits, axis=-1).astype(jnp.int32), max_depth)


def accept_greedy_best(tree: Tree, best: Int[Array, "B W"], max_depth: int
                       ) -> tuple[Int[Array, "B A"], Int[Array, " B"], Int[Array, " B"]]:
    """`accept_greedy` from the target's argmax token at every slot."""
    parent = jnp.maximum(tree.parent, 0)
    match = tree.valid & (tree.tokens == jnp.take_along_axis(best, parent, 1))
    accepted = jnp.arange(tree.size)[None, :] == 0
    for d in range(1, max_depth + 1):  # static, ≤ d_cap: one gather per level
        accepted = accepted | ((tree.depth == d) & match & jnp.take_along_axis(accepted, parent, 1))
    last = jnp.argmax(jnp.where(accepted, tree.depth, -1), axis=1).astype(jnp.int32)
    tau = jnp.take_along_axis(tree.depth, last[:, None], 1)[:, 0]
    bonus = jnp.take_along_axis(best, last[:, None], 1)[:, 0]
    return _path_from(tree, last, max_depth), tau, bonus


def accept_sampled(key: jax.Array, tree: Tree, target_logp: Float[Array, "B W V"], max_depth: int
                   ) -> tuple[Int[Array, "B A"], Int[Array, " B"], Int[Array, " B"]]:
    """As `accept_greedy`, for draws from `target_logp` (already temperature / top-k / top-p processed)."""
    b, w, _ = target_logp.shape
    probs = jnp.exp(target_logp)
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    keys = jax.random.split(key, max_depth + 1)
    for d in range(1, max_depth + 1):
        children = tree.valid & (tree.parent == cur[:, None]) & (tree.depth == d)
        p_cur = jnp.take_along_axis(probs, cur[:, None, None], 1)[:, 0]  # [B,V]
        px = jnp.where(children, jnp.take_along_axis(p_cur, tree.tokens, 1), 0.0)
        before = jnp.cumsum(px, axis=1) - px
        a = px / jnp.maximum(1.0 - before, 1e-30)
        u = jax.random.uniform(keys[d], (b, w))
        hit = children & (u < a) & alive[:, None]
        any_hit = jnp.any(hit, axis=1)
        first = jnp.argmax(hit, axis=1).astype(jnp.int32)
        cur = jnp.where(any_hit, first, cur)
        alive = any_hit
    # Bonus from p at the last node with all of its children removed (they were all rejected, or there are none).
    rejected = tree.valid & (tree.parent == cur[:, None])
    p_cur = jnp.take_along_axis(target_logp, cur[:, None, None], 1)[:, 0]
    removed = jnp.zeros_like(p_cur, dtype=bool)
    removed = jax.vmap(lambda r, t, m: r.at[t].max(m))(removed, tree.tokens, rejected)
    bonus = jax.random.categorical(keys[0], jnp.where(removed, -jnp.inf, p_cur), axis=-1).astype(jnp.int32)
    tau = jnp.take_along_axis(tree.depth, cur[:, None], 1)[:, 0]
    return _path_from(tree, cur, max_depth), tau, bonus
