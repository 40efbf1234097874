"""The speculative decoding loop: draft a tree, verify it in one target forward, commit the accepted path.

One `jax.jit` around `lax.while_loop`; the policy's per-step values (α, depth, width, D_max) live in the state
as arrays. Draft cache protocol: at the start of a step the draft has seen every committed token up to slot
`length_d`; the `pending` tokens (the previous step's accepted path and its bonus token, the last being the
tree's root) are caught up in one forward of width d_cap + 1 that also yields the root's distribution.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from sage_jax.decoding import policies, sampling, verify, widths
from sage_jax.decoding.autoregressive import ARConfig, is_eos, prefill, prompt_layout
from sage_jax.decoding.drafting import build_tree
from sage_jax.decoding.drafts import Drafter
from sage_jax.decoding.tree import causal_visibility
from sage_jax.models.kv_cache import KVCache
from sage_jax.models.lm import LM


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecConfig(ARConfig):
    """Static config of a speculative run: the autoregressive one plus the tree policy.

    Attributes: policy; bucket_ratio: run the draft catch-up, each draft level and the target's verify forward
    at the smallest of the widths 1, r, r², ..., capacity that holds the step's real tokens (`widths.switch`;
    still one compile, but each width is a compiled copy of the forward); < 2 turns bucketing off.
    """

    policy: policies.TreePolicy
    bucket_ratio: int = 4

    @property
    def capacity(self) -> int:
        """Cache slots: prompt, output, and the largest write past the committed prefix in one step."""
        p = self.policy
        return self.prompt_len + self.max_new_tokens + max(p.n_max + 1, p.draft_slots, p.d_cap + 1) + 1

    @property
    def max_steps(self) -> int:
        return self.max_new_tokens  # every step yields >= 1 token


@flax.struct.dataclass
class SpecState:
    """Speculative loop state (all arrays).

    Attributes:
      out: [B, max_new + d_cap + 1] generated tokens.  n_gen: [B].  done: [B].  max_new: [B] per-row limit.
      length: [B] target cache slots committed (the root sits at slot `length`).  pad: [B] left padding.
      root: [B] last committed token (not yet in the target cache).
      pending: [B, d_cap + 1] tokens the draft has not seen, `n_pending` [B] of them, from slot `length_d` on;
        `pending_feat` [B, d_cap + 1, F]: the target's feature of each one's predecessor (F = 0 for LM drafts).
      t_cache, d_cache: target and draft KV caches.  key: PRNG key.
      alpha: [B] confidence that shapes the next tree.  d_max: [B] SAGE's moving depth cap.
      hist: [B, window] recent τ, `hist_n` [B] how many were recorded.
      n_budget, d_budget: [B] the hardware-aware node budget (<= n_max) and depth cap (<= d_cap).
      steps: loop iterations.  sum_tau, n_steps: [B] accepted tokens (bonus excluded) and active steps per row.
      draft_forwards: draft forwards spent (batched).  draft_width, verify_width: summed static widths those
        forwards and the target's verify forwards ran at (with bucketing, what the step really paid for).
      accepted_at: [n_max + 1] how often a node of each priority rank (1 = admitted first) was accepted, over
        active rows: E[τ] of a budget N is sum(accepted_at[1 : N + 1]) / steps (`budget.py`).
      alpha_trace, depth_trace, nodes_trace, width_trace, tau_trace: [max_steps] per-step values of row 0
        (width: the widest level).
    """

    out: Int[Array, "B N"]
    n_gen: Int[Array, " B"]
    done: Bool[Array, " B"]
    max_new: Int[Array, " B"]
    length: Int[Array, " B"]
    pad: Int[Array, " B"]
    root: Int[Array, " B"]
    pending: Int[Array, "B D"]
    pending_feat: Float[Array, "B D F"]
    n_pending: Int[Array, " B"]
    length_d: Int[Array, " B"]
    t_cache: KVCache
    d_cache: KVCache
    key: jax.Array
    alpha: Float[Array, " B"]
    d_max: Int[Array, " B"]
    hist: Float[Array, "B H"]
    hist_n: Int[Array, " B"]
    n_budget: Int[Array, " B"]
    d_budget: Int[Array, " B"]
    steps: Int[Array, ""]
    sum_tau: Int[Array, " B"]
    n_steps: Int[Array, " B"]
    draft_forwards: Int[Array, ""]
    draft_width: Int[Array, ""]
    verify_width: Int[Array, ""]
    accepted_at: Int[Array, " R"]
    alpha_trace: Float[Array, " M"]
    depth_trace: Int[Array, " M"]
    nodes_trace: Int[Array, " M"]
    width_trace: Int[Array, " M"]
    tau_trace: Int[Array, " M"]


def spec_prefill(cfg: SpecConfig, target: LM, drafter: Drafter, tokens, pad, temperature, max_new, key,
                 alpha0: Float[Array, " B"], n_budget: Int[Array, " B"] | None = None,
                 d_budget: Int[Array, " B"] | None = None) -> SpecState:
    """Prefills both caches with the prompt; the target's first token becomes the first root. `alpha0`: the
    confidence that shapes the first tree; `n_budget` / `d_budget`: node budget and depth cap (default: the
    policy's static n_max / d_cap). All per-request values, so arrays."""
    b, p = tokens.shape
    pol = cfg.policy
    t_cache = target.init_cache(b, cfg.capacity)
    hidden, t_cache = prefill(target, tokens, pad, t_cache)
    positions, mask = prompt_layout(tokens, pad, cfg.capacity)
    d_cache = drafter.prefill(tokens, positions, mask, hidden, drafter.init_cache(b, cfg.capacity))
    key, sub = jax.random.split(key)
    first = sampling.sample(sub, target.head(hidden[:, -1:])[:, 0], temperature, cfg.sampling)
    feat = jnp.zeros((b, pol.d_cap + 1, drafter.feature_dim), hidden.dtype)
    feat = feat.at[:, 0].set(hidden[:, -1, : drafter.feature_dim])
    out = jnp.full((b, cfg.max_new_tokens + pol.d_cap + 1), cfg.pad_id, jnp.int32).at[:, 0].set(first)
    m = cfg.max_steps
    n_budget = jnp.full((b,), pol.n_max, jnp.int32) if n_budget is None else n_budget
    d_budget = jnp.full((b,), pol.d_cap, jnp.int32) if d_budget is None else d_budget
    return SpecState(
        out=out, n_gen=jnp.ones((b,), jnp.int32), done=is_eos(first, cfg.eos_ids) | (max_new <= 1),
        max_new=max_new, length=jnp.full((b,), p, jnp.int32), pad=pad, root=first,
        pending=jnp.zeros((b, pol.d_cap + 1), jnp.int32).at[:, 0].set(first), pending_feat=feat,
        n_pending=jnp.ones((b,), jnp.int32),
        length_d=jnp.full((b,), p, jnp.int32), t_cache=t_cache, d_cache=d_cache, key=key,
        alpha=alpha0.astype(jnp.float32), d_max=jnp.full((b,), pol.d_max, jnp.int32),
        hist=jnp.zeros((b, pol.history_window), jnp.float32), hist_n=jnp.zeros((b,), jnp.int32),
        n_budget=jnp.clip(n_budget, 1, pol.n_max).astype(jnp.int32),
        d_budget=jnp.clip(d_budget, 1, pol.d_cap).astype(jnp.int32),
        steps=jnp.int32(0), sum_tau=jnp.zeros((b,), jnp.int32), n_steps=jnp.zeros((b,), jnp.int32),
        draft_forwards=jnp.int32(1), draft_width=jnp.int32(p), verify_width=jnp.int32(0),
        accepted_at=jnp.zeros((pol.n_max + 1,), jnp.int32), alpha_trace=jnp.full((m,), jnp.nan, jnp.float32),
        depth_trace=jnp.zeros((m,), jnp.int32), nodes_trace=jnp.zeros((m,), jnp.int32),
        width_trace=jnp.zeros((m,), jnp.int32), tau_trace=jnp.zeros((m,), jnp.int32),
    )


def spec_step(cfg: SpecConfig, target: LM, drafter: Drafter, s: SpecState, temperature) -> SpecState:
    pol = cfg.policy
    b, dc = s.root.shape[0], pol.d_cap
    capacity = s.t_cache.capacity
    active = ~s.done

    # ******** Draft: catch up on the pending tokens; the last one is the root. ********
    cu_slots = s.length_d[:, None] + jnp.arange(dc + 1, dtype=jnp.int32)[None]
    cu_mask = causal_visibility(cu_slots, s.pad, capacity)
    last = (s.n_pending - 1)[:, None, None]

    def catch_up(w):
        def run():
            logq, feat, c = drafter(s.pending[:, :w], s.pending_feat[:, :w], (cu_slots - s.pad[:, None])[:, :w],
                                    cu_mask[:, :w], s.d_cache, s.length_d)
            root_logq = jnp.take_along_axis(logq, jnp.minimum(last, w - 1), 1)[:, 0]
            root_feat = jnp.take_along_axis(feat, jnp.minimum(last, w - 1), 1)[:, 0]
            return root_logq, root_feat, c, jnp.int32(w)
        return run

    cu_sizes = widths.sizes(dc + 1, 1, cfg.bucket_ratio)
    root_logq, root_feat, d_cache, cu_width = widths.switch(jnp.max(s.n_pending), cu_sizes, catch_up)
    alpha_now = policies.confidence(root_logq, pol.top_k)
    alpha_use = alpha_now if pol.alpha_source == "fresh_root" else s.alpha
    shape = policies.step_shape(pol, alpha_use, s.d_max, s.d_budget)
    tree, pool, d_cache, n_levels, level_width = build_tree(
        pol, drafter, d_cache, s.root, root_logq, alpha_now, root_feat, shape, s.length, s.pad,
        budget=s.n_budget, bucket_ratio=cfg.bucket_ratio)

    # ******** Verify: one target forward over root + tree (at the smallest width holding its nodes). ********
    key, sub = jax.random.split(s.key)
    n_tree = jnp.max(jnp.sum(tree.valid, 1))  # root included
    v_sizes = widths.sizes(tree.size, 2, cfg.bucket_ratio)

    def verify_at(w):
        def run():
            t = tree.prefix(w)
            positions = (s.length - s.pad)[:, None] + t.depth
            # The cache is only read here; the accepted rows of `kv` are written at the commit, outside the
            # switch (`LM.forward`, write=False).
            hidden, kv = target.forward(t.tokens, positions, t.attention_mask(s.length, s.pad, capacity),
                                        s.t_cache, s.length, write=False)
            best = jnp.argmax(target.head(hidden), axis=-1).astype(jnp.int32)
            def grow(a, axis=1):  # the token axis, padded to the tree's size
                return jnp.pad(a, [(0, tree.size - w) if i == axis else (0, 0) for i in range(a.ndim)])

            return grow(hidden), grow(best), jax.tree.map(lambda a: grow(a, 2), kv), jnp.int32(w)
        return run

    hidden, best, tree_kv, v_width = widths.switch(n_tree, v_sizes, verify_at)
    greedy = verify.accept_greedy_best(tree, best, dc)

    def sampled(_):  # T > 0 rows: the target's processed log-probs at the verified width, -inf padded
        def head_at(w):
            def run():
                logp = sampling.processed_logprobs(target.head(hidden[:, :w]), temperature, cfg.sampling)
                return jnp.pad(logp, ((0, 0), (0, tree.size - w), (0, 0)), constant_values=-jnp.inf)
            return run

        s_ = verify.accept_sampled(sub, tree, widths.switch(n_tree, v_sizes, head_at), dc)
        pick = temperature > 0
        return tuple(jnp.where(pick.reshape((-1,) + (1,) * (g.ndim - 1)), x, g) for x, g in zip(s_, greedy))

    path, tau, bonus = jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: greedy, None)
    path_feat = jnp.take_along_axis(hidden, path[:, :, None], 1)[..., : drafter.feature_dim]

    # ******** Commit: accepted path + bonus, cut at EOS and at the row's token limit. ********
    i = jnp.arange(dc + 1, dtype=jnp.int32)[None]
    path_tokens = jnp.take_along_axis(tree.tokens, path, 1)  # [B, dc+1], root first
    shifted = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], 1)
    new = jnp.where(i < tau[:, None], shifted, jnp.where(i == tau[:, None], bonus[:, None], cfg.pad_id))
    eos = is_eos(new, cfg.eos_ids) & (i <= tau[:, None])
    n_new = jnp.where(jnp.any(eos, 1), jnp.argmax(eos, 1) + 1, tau + 1)
    n_new = jnp.where(active, jnp.minimum(n_new, s.max_new - s.n_gen), 0).astype(jnp.int32)
    new = jnp.where(i < n_new[:, None], new, cfg.pad_id)
    out = jax.vmap(lambda o, u, at: jax.lax.dynamic_update_slice_in_dim(o, u, at, 0))(s.out, new, s.n_gen)
    n_gen = s.n_gen + n_new
    done = s.done | (active & jnp.any(eos & (i < n_new[:, None]), 1)) | (n_gen >= s.max_new)
    t_cache = s.t_cache.commit(tree_kv, path, s.length)

    # ******** Policy state: α for the next tree, τ history moving D_max. ********
    if pol.alpha_source == "accepted_path_mean":
        node_alpha = jnp.take_along_axis(pool.alpha, path, 1)
        on = (i <= tau[:, None]) & ~jnp.isnan(node_alpha)
        alpha_next = jnp.sum(jnp.where(on, node_alpha, 0), 1) / jnp.maximum(jnp.sum(on, 1), 1)
    else:
        alpha_next = alpha_now
    hist = jax.vmap(lambda h, n, t: h.at[n % pol.history_window].set(t))(s.hist, s.hist_n, tau.astype(jnp.float32))
    hist_n = s.hist_n + 1
    mean_tau = jnp.mean(hist, axis=1)
    full = hist_n >= pol.history_window
    move = jnp.where(full & (mean_tau < pol.history_low), -1, jnp.where(full & (mean_tau > pol.history_high), 1, 0))
    d_max = jnp.clip(s.d_max + move, pol.d_min + 1, pol.d_cap) if pol.history else s.d_max

    def keep(new_v, old_v):
        return jnp.where(active.reshape((-1,) + (1,) * (old_v.ndim - 1)), new_v, old_v)

    n_nodes = jnp.sum(tree.valid[0]) - 1
    level_sizes = jnp.sum(tree.valid[0][None, :] & (tree.depth[0][None, :] == jnp.arange(1, dc + 1)[:, None]), 1)
    # Priority rank of the accepted nodes: pool order for level-built trees, cumulative log-prob for EAGLE-2.
    if pol.name == "eagle2":
        score = jnp.where(tree.valid, tree.logp, -jnp.inf)
        rank = jnp.sum((score[:, None, :] > score[:, :, None]) | (
            (score[:, None, :] == score[:, :, None]) & (jnp.arange(tree.size)[None, None, :] <
                                                        jnp.arange(tree.size)[None, :, None])), 2)
    else:
        rank = jnp.broadcast_to(jnp.arange(tree.size), tree.valid.shape)
    on_path = (i >= 1) & (i <= tau[:, None]) & active[:, None]
    path_rank = jnp.where(on_path, jnp.take_along_axis(rank, path, 1), pol.n_max + 1)
    accepted_at = s.accepted_at.at[path_rank.reshape(-1)].add(1, mode="drop")
    return s.replace(
        out=out, n_gen=n_gen, done=done, t_cache=t_cache, d_cache=d_cache, key=key,
        length=keep(s.length + 1 + tau, s.length), root=keep(bonus, s.root),
        pending=keep(jnp.where(i <= tau[:, None], new, 0), s.pending), n_pending=keep(tau + 1, s.n_pending),
        pending_feat=keep(path_feat, s.pending_feat),
        length_d=keep(s.length + 1, s.length_d),
        alpha=keep(alpha_next, s.alpha), d_max=keep(d_max, s.d_max), hist=keep(hist, s.hist),
        hist_n=keep(hist_n, s.hist_n), steps=s.steps + 1, sum_tau=s.sum_tau + jnp.where(active, tau, 0),
        n_steps=s.n_steps + active, draft_forwards=s.draft_forwards + 1 + n_levels,
        draft_width=s.draft_width + cu_width + level_width, verify_width=s.verify_width + v_width,
        accepted_at=accepted_at, alpha_trace=s.alpha_trace.at[s.steps].set(alpha_use[0]),
        depth_trace=s.depth_trace.at[s.steps].set(jnp.max(jnp.where(tree.valid[0], tree.depth[0], 0))),
        nodes_trace=s.nodes_trace.at[s.steps].set(n_nodes), width_trace=s.width_trace.at[s.steps].set(
            jnp.max(level_sizes)), tau_trace=s.tau_trace.at[s.steps].set(tau[0]),
    )


def spec_decode(cfg: SpecConfig, target: LM, drafter: Drafter, state: SpecState, temperature) -> SpecState:
    def cond(s: SpecState):
        return (s.steps < cfg.max_steps) & ~jnp.all(s.done)

    return jax.lax.while_loop(cond, lambda s: spec_step(cfg, target, drafter, s, temperature), state)
