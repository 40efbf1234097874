"""Building the draft tree level by level: one draft forward per level over the frontier, under a tree mask.

A candidate pool of C slots (policy-sized) grows level by level; the policy's admission rule decides which of the
J = top_k children of each frontier node enter, in priority order, under the node budget; the best R = `frontier`
newcomers become the next level's frontier. The draft keys/values of level-d frontier nodes live in the draft
cache at slot `length + 1 + (d - 1)·R + r` (the root at `length`), so every query sees exactly its ancestors.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from sage_jax.decoding import policies, widths
from sage_jax.decoding import tree as tree_lib
from sage_jax.decoding.drafters import Drafter
from sage_jax.models.kv_cache import KVCache
from sage_jax.models.visibility import Visibility


@flax.struct.dataclass
class Pool:
    """Candidate nodes of one step (slot 0 = root).

    Attributes:
      tokens, parent, depth, logp (cumulative), local_p (own draft probability), valid: [B, C].
      ancestors: [B, C, C].  dslot: [B, C] draft-cache offset of an expanded node (-1 if never expanded).
      alpha: [B, C] confidence of an expanded node's draft distribution (NaN if never expanded).
      feature: [B, C, X] the draft's predicted feature at an expanded node (X = 0 for LM drafts): the input
        feature of its children.  count: [B] slots in use.
    """

    tokens: Int[Array, "B C"]
    parent: Int[Array, "B C"]
    depth: Int[Array, "B C"]
    logp: Float[Array, "B C"]
    local_p: Float[Array, "B C"]
    valid: Bool[Array, "B C"]
    ancestors: Bool[Array, "B C C"]
    dslot: Int[Array, "B C"]
    alpha: Float[Array, "B C"]
    feature: Float[Array, "B C X"]
    count: Int[Array, " B"]

    @classmethod
    def start(cls, root: Int[Array, " B"], root_alpha: Float[Array, " B"], root_feature: Float[Array, "B X"],
              size: int) -> Pool:
        b = root.shape[0]
        zeros_i = jnp.zeros((b, size), jnp.int32)
        first = jnp.arange(size) == 0
        return cls(
            tokens=zeros_i.at[:, 0].set(root), parent=zeros_i - 1, depth=zeros_i,
            logp=jnp.zeros((b, size), jnp.float32), local_p=jnp.zeros((b, size), jnp.float32).at[:, 0].set(1.0),
            valid=jnp.broadcast_to(first, (b, size)), ancestors=jnp.zeros((b, size, size), bool).at[:, 0, 0].set(True),
            dslot=jnp.broadcast_to(jnp.where(first, 0, -1), (b, size)).astype(jnp.int32),
            alpha=jnp.full((b, size), jnp.nan, jnp.float32).at[:, 0].set(root_alpha),
            feature=jnp.zeros((b, size) + root_feature.shape[1:], root_feature.dtype).at[:, 0].set(root_feature),
            count=jnp.ones((b,), jnp.int32),
        )


@flax.struct.dataclass
class _Frontier:
    idx: Int[Array, "B R"]  # pool slots of the nodes to expand (valid ones packed at the front)
    valid: Bool[Array, "B R"]
    top_logq: Float[Array, "B R J"]  # their draft's top-k log-probabilities
    top_ids: Int[Array, "B R J"]  # and tokens


def _expand(policy: policies.TreePolicy, level, shape: policies.StepShape, pool: Pool, fr: _Frontier,
            budget: Int[Array, " B"]) -> tuple[Pool, Int[Array, "B R"], Bool[Array, "B R"], Int[Array, "B R"]]:
    """Admits one level of children (the pool never exceeds 1 + `budget` slots). Returns the pool and the new
    frontier's (slots, validity, tokens)."""
    b, r = fr.idx.shape
    k, kc, size = policy.top_k, policy.per_level, pool.tokens.shape[1]
    logq, ids = fr.top_logq, fr.top_ids  # [B,R,J]
    par_cum = jnp.take_along_axis(pool.logp, fr.idx, 1)
    par_local = jnp.take_along_axis(pool.local_p, fr.idx, 1)
    allowed, prio = policies.admission(policy, level, shape, fr.valid, par_local, par_cum, logq)
    score = jnp.where(allowed, prio, -jnp.inf).reshape(b, r * k)
    top, cand = jax.lax.top_k(score, kc)  # [B,Kc], best first
    room = jnp.minimum(size, 1 + budget) - pool.count
    j = jnp.arange(kc)[None, :]
    admit = jnp.isfinite(top) & (j < room[:, None])
    n_admit = jnp.sum(admit, axis=1).astype(jnp.int32)
    slot = jnp.where(admit, pool.count[:, None] + j, size)  # `size` = dropped by the scatter
    parent = jnp.take_along_axis(fr.idx, cand // k, 1)
    token = jnp.take_along_axis(ids.reshape(b, r * k), cand, 1)
    lq = jnp.take_along_axis(logq.reshape(b, r * k), cand, 1)
    cum = jnp.take_along_axis(par_cum, cand // k, 1) + lq
    anc_rows = jnp.take_along_axis(pool.ancestors, parent[:, :, None], 1) | jax.nn.one_hot(slot, size, dtype=bool)

    def put(a, v):
        return jax.vmap(lambda a_, s_, v_: a_.at[s_].set(v_, mode="drop"))(a, slot, v)

    pool = pool.replace(
        tokens=put(pool.tokens, token), parent=put(pool.parent, parent),
        depth=put(pool.depth, jnp.broadcast_to(level, slot.shape).astype(jnp.int32)),
        logp=put(pool.logp, cum), local_p=put(pool.local_p, jnp.exp(lq)), valid=put(pool.valid, admit),
        ancestors=put(pool.ancestors, anc_rows), count=pool.count + n_admit,
    )
    new_valid = admit[:, :r] if kc >= r else jnp.pad(admit, ((0, 0), (0, r - kc)))
    pad_to_r = (lambda a: a[:, :r]) if kc >= r else (lambda a: jnp.pad(a, ((0, 0), (0, r - kc))))
    return pool, jnp.where(new_valid, pad_to_r(slot), 0), new_valid, pad_to_r(token)


def build_tree(
    policy: policies.TreePolicy,
    drafter: Drafter,
    cache: KVCache,
    root: Int[Array, " B"],
    root_logq: Float[Array, "B V"],
    root_alpha: Float[Array, " B"],
    root_feature: Float[Array, "B X"],
    shape: policies.StepShape,
    length: Int[Array, " B"],
    pad: Int[Array, " B"],
    budget: Int[Array, " B"] | None = None,
    bucket_ratio: int = 4,
    delta: Int[Array, " B"] | None = None,
) -> tuple[tree_lib.Tree, Pool, KVCache, Int[Array, ""], Int[Array, ""]]:
    """Drafts one tree. `length`: the draft's committed prefix (the root's slot; position `length - pad + delta`,
    `delta` 0 by default); the root's own draft distribution is
    `root_logq`; `budget` [B]: node cap (<= n_max; default n_max). Each level's draft forward runs at the
    smallest of the widths 1, 2, q, q², ..., R holding its frontier (q = `bucket_ratio`; < 2: always R;
    `widths.draft_sizes`).
    Returns the verified-tree view (valid nodes packed at the front), the pool (for α statistics), the cache,
    the number of draft forwards spent on levels >= 2 and the total width they ran at."""
    b = root.shape[0]
    r, k = policy.frontier, policy.top_k
    delta = jnp.zeros((b,), jnp.int32) if delta is None else delta
    budget = jnp.full((b,), policy.n_max, jnp.int32) if budget is None else jnp.clip(budget, 0, policy.n_max)
    pool = Pool.start(root, root_alpha, root_feature, policy.pool_size)
    top_v, top_i = jax.lax.top_k(root_logq, k)
    first = _Frontier(idx=jnp.zeros((b, r), jnp.int32), valid=(jnp.arange(r) == 0)[None].repeat(b, 0),
                      top_logq=jnp.zeros((b, r, k), top_v.dtype).at[:, 0].set(top_v),
                      top_ids=jnp.zeros((b, r, k), jnp.int32).at[:, 0].set(top_i))
    pool, f_idx, f_valid, f_tok = _expand(policy, jnp.int32(1), shape, pool, first, budget)
    max_depth = jnp.minimum(jnp.max(shape.depth), policy.d_cap)
    sizes = widths.draft_sizes(r, bucket_ratio)

    def cond(carry):
        level, _, _, f_valid, _, _, _, _ = carry
        return (level <= max_depth) & jnp.any(f_valid)

    def body(carry):
        level, pool, f_idx, f_valid, f_tok, cache, n_fwd, n_width = carry
        # The frontier holds depth (level-1) nodes: give them draft slots, then score them in one forward.
        base = 1 + (level - 2) * r
        dslot = jax.vmap(lambda d, s, v: d.at[s].set(v, mode="drop"))(
            pool.dslot, jnp.where(f_valid, f_idx, pool.dslot.shape[1]), base + jnp.arange(r)[None].repeat(b, 0))
        pool = pool.replace(dslot=dslot)
        anc = jnp.take_along_axis(pool.ancestors, f_idx[:, :, None], 1)  # [B,R,C]
        onehot = jax.nn.one_hot(dslot, policy.draft_slots, dtype=jnp.float32)  # [B,C,U]; -1 -> all zeros
        vis = jnp.einsum("BRC,BCU->BRU", anc.astype(jnp.float32), onehot) > 0
        mask = Visibility(pad=pad, start=length, window=vis)
        positions = (length - pad + delta)[:, None] + (level - 1) + jnp.zeros((b, r), jnp.int32)
        parents = jnp.maximum(jnp.take_along_axis(pool.parent, f_idx, 1), 0)
        feat_in = jnp.take_along_axis(pool.feature, parents[:, :, None], 1)
        n_front = jnp.max(jnp.sum(f_valid, 1))

        def at_width(w):
            def run():
                logq, feat_out, c = drafter(f_tok[:, :w], feat_in[:, :w], positions[:, :w], mask.first(w), cache,
                                            length + base)
                tv, ti = jax.lax.top_k(logq, k)
                alpha = policies.confidence_topk(tv)
                pad_r = lambda a: jnp.pad(a, ((0, 0), (0, r - w)) + ((0, 0),) * (a.ndim - 2))  # noqa: E731
                return pad_r(tv), pad_r(ti), pad_r(alpha), pad_r(feat_out), c, jnp.int32(w)
            return run

        tv, ti, alpha, feat_out, cache, w_run = widths.switch(n_front, sizes, at_width)
        store = jnp.where(f_valid, f_idx, pool.alpha.shape[1])  # out of range = dropped
        pool = pool.replace(
            alpha=jax.vmap(lambda a, s, v: a.at[s].set(v, mode="drop"))(pool.alpha, store, alpha),
            feature=jax.vmap(lambda a, s, v: a.at[s].set(v, mode="drop"))(pool.feature, store, feat_out))
        pool, f_idx, f_valid, f_tok = _expand(policy, level, shape, pool, _Frontier(f_idx, f_valid, tv, ti), budget)
        return level + 1, pool, f_idx, f_valid, f_tok, cache, n_fwd + 1, n_width + w_run

    carry = (jnp.int32(2), pool, f_idx, f_valid, f_tok, cache, jnp.int32(0), jnp.int32(0))
    _, pool, _, _, _, cache, n_fwd, n_width = jax.lax.while_loop(cond, body, carry)
    if policy.pool_size == policy.n_max + 1:
        t = tree_lib.Tree(tokens=pool.tokens, parent=jnp.where(pool.valid, pool.parent, -1), depth=pool.depth,
                          logp=pool.logp, valid=pool.valid, ancestors=pool.ancestors)
    else:
        t = tree_lib.select_nodes(pool.tokens, pool.parent, pool.depth, pool.logp, pool.valid, pool.ancestors,
                                  policy.n_max, budget)
    return t, pool, cache, n_fwd, n_width
