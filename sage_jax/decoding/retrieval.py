"""Retrieval branches: prompt-lookup candidates merged into the draft's tree, verified in the same forward.

Copy-heavy requests (rewrite, summarise, fix this code) repeat runs of their prompt. Each step looks up the
longest recent n-gram (n = 3, 2, 1) ending at the newest token in the prompt and the text generated so far, and
proposes the L tokens that followed it there. The chain is merged into the draft's tree from the root: a token
the draft already proposed under the same parent is reused, the rest become new nodes in L reserved slots (valid
nodes stay packed at the front, parents before children, so the verify forward's width bucketing still holds).
Acceptance treats the chain as any other deterministic candidates, so greedy and sampled decoding stay exact.

A chain costs verify width whether or not it is accepted, and on free text the lookup almost always finds some
earlier unigram. So each row keeps the running precision of its chains (`precision`: how much of each chain's
leading run the target committed, measured after every step even when the chain was not merged) and merges its
chain only while that precision reaches the policy's `retrieval_gate`: on for a row that is copying, off (at no
cost) for one that is not, and back on within a step or two when it starts: `TreePolicy.retrieval_gate` beside a
draft tree, `TreePolicy.chains_gate` where the chain is verified alone (node budget 0; a held-back chain then
leaves the root alone, a plain decoding step), both 0.5 by default. And a merged chain never widens the verify
forward past the bucket that holds the draft's tree or the root and one whole chain (`merge`'s `limit`,
`speculative.chain_limit`): a chain's tail beyond it costs a wider forward than it is likely to repay.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from sage_jax.decoding.tree import Tree

NGRAMS = (3, 2, 1)  # tried longest first


def lookup(history: Int[Array, "B ctx"], valid: Bool[Array, "B ctx"], end: Int[Array, " B"], length: int,
           ngrams: tuple[int, ...] = NGRAMS) -> tuple[Int[Array, "B chain"], Int[Array, " B"]]:
    """The `length` tokens that followed the latest earlier occurrence of the n-gram ending at slot `end` (the
    newest token), for the longest n in `ngrams` that occurs; (tokens [B, L], how many are real [B])."""
    b, h = history.shape
    j = jnp.arange(h, dtype=jnp.int32)[None]
    found = jnp.zeros((b,), bool)
    at = jnp.full((b,), -1, jnp.int32)
    for n in ngrams:
        match = valid & (j < end[:, None])  # candidate n-gram ends strictly before the newest token
        for i in range(n):
            q = jnp.take_along_axis(history, jnp.maximum(end - i, 0)[:, None], 1)  # query token i from the end
            q_ok = jnp.take_along_axis(valid, jnp.maximum(end - i, 0)[:, None], 1)
            shifted = jnp.roll(history, i, axis=1)  # shifted[:, j] = history[:, j - i]
            ok = jnp.roll(valid, i, axis=1) & (j >= i)
            match = match & ok & q_ok & (shifted == q) & (end[:, None] - i >= 0)
        last = jnp.max(jnp.where(match, j, -1), axis=1)
        take = ~found & (last >= 0)
        at = jnp.where(take, last, at)
        found = found | take
    idx = at[:, None] + 1 + jnp.arange(length, dtype=jnp.int32)[None]
    real = found[:, None] & (idx <= end[:, None])
    real = real & jnp.take_along_axis(valid, jnp.clip(idx, 0, h - 1), 1)
    real = jnp.cumprod(real, axis=1).astype(bool)  # a contiguous run from the first token
    tokens = jnp.where(real, jnp.take_along_axis(history, jnp.clip(idx, 0, h - 1), 1), 0)
    return tokens, jnp.sum(real, axis=1).astype(jnp.int32)


def widen(tree: Tree, extra: int) -> Tree:
    """`tree` with `extra` empty slots appended (the room a retrieval chain may need)."""
    pad = lambda a, v: jnp.pad(a, ((0, 0), (0, extra)), constant_values=v)  # noqa: E731
    return Tree(tokens=pad(tree.tokens, 0), parent=pad(tree.parent, -1), depth=pad(tree.depth, 0),
                logp=pad(tree.logp, -jnp.inf), valid=pad(tree.valid, False),
                ancestors=jnp.pad(tree.ancestors, ((0, 0), (0, extra), (0, extra))))


def merge(tree: Tree, cand: Int[Array, "B chain"], n_cand: Int[Array, " B"],
          limit: Int[Array, " B"] | None = None) -> Tree:
    """Merges each row's chain `cand[:n_cand]` into `tree` (which has room for it: `widen`), from the root.
    `limit`: at most this many valid nodes per row after the merge; the chain stops at its first token that would
    need a node past it (up to there, tokens the tree already holds cost no node)."""
    b, w = tree.tokens.shape
    rows = jnp.arange(b)
    cur = jnp.zeros((b,), jnp.int32)  # the chain's node at the current depth (root first)
    count = jnp.sum(tree.valid, axis=1).astype(jnp.int32)
    limit = jnp.full((b,), w, jnp.int32) if limit is None else limit
    alive = jnp.ones((b,), bool)
    for d in range(cand.shape[1]):
        tok = cand[:, d]
        same = tree.valid & (tree.parent == cur[:, None]) & (tree.tokens == tok[:, None])
        have = jnp.any(same, axis=1)
        alive = alive & (have | (count < limit))
        on = (d < n_cand) & alive
        existing = jnp.argmax(same, axis=1).astype(jnp.int32)
        new = on & ~have
        slot = jnp.where(new, count, w)  # w = dropped by the scatters
        anc = jnp.take_along_axis(tree.ancestors, cur[:, None, None], 1)[:, 0] | (jnp.arange(w)[None] == slot[:, None])
        put = lambda a, v, s=slot: a.at[rows, s].set(v, mode="drop")  # noqa: E731
        tree = Tree(tokens=put(tree.tokens, tok), parent=put(tree.parent, cur),
                    depth=put(tree.depth, jnp.take_along_axis(tree.depth, cur[:, None], 1)[:, 0] + 1),
                    logp=put(tree.logp, jnp.take_along_axis(tree.logp, cur[:, None], 1)[:, 0]),
                    valid=put(tree.valid, jnp.ones((b,), bool)),
                    ancestors=tree.ancestors.at[rows, slot].set(anc, mode="drop"))
        count = count + new
        cur = jnp.where(on, jnp.where(have, existing, slot), cur)
    return tree


# How fast a row's chain precision forgets, per checked token: a step that checked m of the chain's tokens moves
# the running precision by 1 - 0.7^m of the way to its own, so one lucky 1-token check on free text does not open
# the gate, while a 4-token confirmed run does (and two short misses close it again).
PRECISION_DECAY = 0.7


def precision(cand: Int[Array, "B chain"], n_cand: Int[Array, " B"], committed: Int[Array, "B A"],
              n_committed: Int[Array, " B"]) -> tuple[Float[Array, " B"], Bool[Array, " B"]]:
    """How much of a chain the target confirmed: of its first m = min(n_cand, n_committed) tokens, the share of
    the leading run that equals the tokens this step committed (the accepted path and the bonus token); and
    how many tokens were checked (m; 0: nothing to check). Computable whether or not the chain was merged."""
    m = jnp.minimum(n_cand, n_committed)
    span = min(cand.shape[1], committed.shape[1])
    i = jnp.arange(span)[None]
    hit = (cand[:, :span] == committed[:, :span]) & (i < m[:, None])
    run = jnp.sum(jnp.cumprod(hit, axis=1), axis=1)
    return run / jnp.maximum(m, 1), m


def update_precision(score: Float[Array, " B"], prec: Float[Array, " B"], checked: Int[Array, " B"]
                     ) -> Float[Array, " B"]:
    """The running precision after a step that checked `checked` chain tokens with precision `prec`."""
    w = 1.0 - PRECISION_DECAY ** checked.astype(jnp.float32)
    return score + w * (prec - score)
