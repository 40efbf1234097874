"""The speculative tree as fixed-shape arrays, static tree templates, and tree-shaped attention masks.

Every policy (chain, static, EAGLE-2, SAGE) only fills a `Tree`; verification and KV compaction never know which
policy built it. Node 0 is the root: the last committed token, whose keys/values are not yet in the target cache.
Nodes are in breadth-first order (parents before children, siblings by descending draft probability).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from sage_jax.models.visibility import Visibility

# EAGLE-1 `mc_sim_7b_63` (25 draft nodes, depth 5, per-level 4/8/8/3/2): SpecVLM's and SAGE's initial tree.
# Each entry is the path of top-k ranks from the root.
MC_SIM_7B_63: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)  # fmt: skip


def chain_template(depth: int) -> tuple[tuple[int, ...], ...]:
    return tuple((0,) * d for d in range(1, depth + 1))


@flax.struct.dataclass
class Tree:
    """A draft tree of W slots per row (slot 0 = the root; W = n_max + 1).

    Attributes:
      tokens: [B, W] token ids.  parent: [B, W] parent slot (-1 for the root and for invalid slots).
      depth: [B, W] root 0.  logp: [B, W] cumulative draft log-probability (root 0).
      valid: [B, W] whether the slot holds a node.  ancestors: [B, W, W] ancestors[b, i, j]: j is i or an
      ancestor of i.
    """

    tokens: Int[Array, "B W"]
    parent: Int[Array, "B W"]
    depth: Int[Array, "B W"]
    logp: Float[Array, "B W"]
    valid: Bool[Array, "B W"]
    ancestors: Bool[Array, "B W W"]

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def prefix(self, w: int) -> Tree:
        """The first `w` slots. Valid nodes are packed at the front and parents precede children, so a prefix
        holding every valid node is the same tree at a smaller static width."""
        if w == self.size:
            return self
        return Tree(tokens=self.tokens[:, :w], parent=self.parent[:, :w], depth=self.depth[:, :w],
                    logp=self.logp[:, :w], valid=self.valid[:, :w], ancestors=self.ancestors[:, :w, :w])

    def visibility(self, start: Int[Array, " B"], pad: Int[Array, " B"]) -> Visibility:
        """What the tree's queries see when node i sits at slot start + i: the committed prefix [pad, start) plus
        the node's own ancestors (and itself)."""
        return Visibility(pad=pad, start=start, window=self.ancestors)

    def attention_mask(self, start: Int[Array, " B"], pad: Int[Array, " B"], capacity: int) -> Bool[Array, "B W S"]:
        """`visibility` as a dense [B, W, S] mask over a cache of `capacity` slots."""
        return self.visibility(start, pad).dense(capacity)


def template_tables(choices: tuple[tuple[int, ...], ...], frontier: int, top_k: int, max_depth: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Static per-level tables for a template tree.

    Returns allowed[l, f, r] and priority[l, f, r] for creating depth-l nodes from the f-th depth-(l-1) node
    (template order) through its rank-r child; priority is minus the template index so that nodes are admitted
    and expanded in template order.
    """
    by_depth: dict[int, list[tuple[int, ...]]] = {0: [()]}
    for c in choices:
        by_depth.setdefault(len(c), []).append(tuple(c))
    allowed = np.zeros((max_depth + 1, frontier, top_k), bool)
    priority = np.full((max_depth + 1, frontier, top_k), -np.inf, np.float32)
    for idx, c in enumerate(choices):
        d = len(c)
        if d > max_depth:
            raise ValueError(f"template node {c} deeper than the depth cap {max_depth}")
        if c[:-1] not in by_depth.get(d - 1, []):
            raise ValueError(f"template node {c} has no parent {c[:-1]} in the template")
        f = by_depth[d - 1].index(c[:-1])
        if f >= frontier or c[-1] >= top_k:
            raise ValueError(f"template node {c} needs frontier > {f} and top_k > {c[-1]}")
        allowed[d, f, c[-1]] = True
        priority[d, f, c[-1]] = -idx
    return allowed, priority


def select_nodes(tokens, parent, depth, logp, valid, ancestors, n_keep: int,
                 budget: Int[Array, " B"] | None = None) -> Tree:
    """Keeps the root and the `n_keep` valid nodes of highest cumulative log-prob (at most `budget[b]` of them),
    re-indexed in pool order with the kept nodes packed at the front.

    Ancestor-closed because a child's cumulative log-prob never exceeds its parent's and ties go to the lower
    (parent-first) index.
    """
    b, p = tokens.shape
    score = jnp.where(valid, logp, -jnp.inf).at[:, 0].set(jnp.inf)
    _, sel = jax.lax.top_k(score, n_keep + 1)
    if budget is not None:  # beyond the budget: -inf (dropped), and sorted behind every kept node
        over = jnp.arange(n_keep + 1)[None, :] > budget[:, None]
        score = jax.vmap(lambda s_, i_, o_: s_.at[i_].set(jnp.where(o_, -jnp.inf, s_[i_])))(score, sel, over)
        sel = jnp.take_along_axis(sel, jnp.argsort(jnp.where(over, sel + p, sel), axis=-1), 1)
    else:
        sel = jnp.sort(sel, axis=-1)  # pool order keeps parents before children
    take = lambda a: jnp.take_along_axis(a, sel, axis=1)  # noqa: E731
    new_of_old = jnp.full((b, p), -1, jnp.int32)
    new_of_old = jax.vmap(lambda m, s: m.at[s].set(jnp.arange(n_keep + 1, dtype=jnp.int32)))(new_of_old, sel)
    old_parent = take(parent)
    new_parent = jnp.where(old_parent >= 0, jnp.take_along_axis(new_of_old, jnp.maximum(old_parent, 0), 1), -1)
    keep_valid = take(valid) & (take(score) > -jnp.inf)
    anc = jnp.take_along_axis(ancestors, sel[:, :, None], axis=1)
    anc = jnp.take_along_axis(anc, jnp.broadcast_to(sel[:, None, :], anc.shape[:2] + (n_keep + 1,)), axis=2)
    return Tree(tokens=take(tokens), parent=jnp.where(keep_valid, new_parent, -1), depth=take(depth),
                logp=take(logp), valid=keep_valid, ancestors=anc & keep_valid[:, None, :] & keep_valid[:, :, None])


def causal_visibility(query_slots: Int[Array, "B T"], pad: Int[Array, " B"], capacity: int) -> Bool[Array, "B T S"]:
    """[B,T,S] mask for a chain of queries at `query_slots`: every slot in [pad, own slot]."""
    j = jnp.arange(capacity)[None, None, :]
    return (j >= pad[:, None, None]) & (j <= query_slots[:, :, None])
