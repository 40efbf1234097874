"""The speculative decoding loop: draft a tree, verify it in one target forward, commit the accepted path.

One `jax.jit` around `lax.while_loop`; the policy's per-step values (α, depth, width, D_max) live in the state
as arrays. A step is five pure functions, in order: `draft` (catch the draft up, then build the tree),
`verify`, `commit`, `update_policy` and `record`.

Draft cache protocol: at the start of a step the draft has seen every committed token up to slot `length_d`; the
`pending` tokens (the previous step's accepted path and its bonus token, the last being the tree's root) are caught
up in one forward of width at most d_cap + 1 that also yields the root's distribution.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from sage_jax.decoding import datastore, policies, retrieval, sampling, visual_pruning, widths
from sage_jax.decoding import verify as verify_lib
from sage_jax.decoding.autoregressive import ARConfig, is_eos, prefill, prompt_layout
from sage_jax.decoding.drafters import Drafter
from sage_jax.decoding.tree import Tree, causal_visibility
from sage_jax.decoding.tree_builder import Pool, build_tree
from sage_jax.models.kv_cache import KVCache, NewKV
from sage_jax.models.serving_lm import LM
from sage_jax.models.visibility import Visibility


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecConfig(ARConfig):
    """Static config of a speculative run: the autoregressive one plus the tree policy.

    Attributes: policy; bucket_ratio: run the draft catch-up, each draft level and the target's verify forward
    at the smallest of the widths 1, r, r², ..., capacity that holds the step's real tokens (`widths.switch`;
    still one compile, but each width is a compiled copy of the forward); < 2 turns bucketing off.
    For multimodal prompts (`visual_pruning.Media`): draft_prompt_len, the draft's prompt bucket after visual
    pruning (0: the target's `prompt_len`, nothing pruned); prune, how the kept visual tokens are chosen.
    """

    policy: policies.TreePolicy
    bucket_ratio: int = 4
    draft_prompt_len: int = 0
    prune: visual_pruning.Method = "attention"

    @property
    def capacity(self) -> int:
        """Cache slots: prompt, output, and the largest write past the committed prefix in one step."""
        p = self.policy
        return self.prompt_len + self.max_new_tokens + max(p.tree_size, p.draft_slots, p.d_cap + 1) + 1

    @property
    def draft_capacity(self) -> int:
        """The draft cache's slots: the target's, less the prompt slots pruning removed."""
        return self.capacity - self.prompt_len + (self.draft_prompt_len or self.prompt_len)

    @property
    def max_steps(self) -> int:
        return self.max_new_tokens  # every step yields >= 1 token


@flax.struct.dataclass
class SpecState:
    """Speculative loop state (all arrays; dimension names as in `sage_jax/__init__.py`, A = d_cap + 1).

    Attributes:
      out: [B, out] generated tokens (out = max_new + A).  n_gen: [B].  done: [B].  max_new: [B] per-row limit.
      length: [B] target cache slots committed (the root sits at slot `length`).  pad: [B] left padding.
      delta: [B] position delta: target slot s past the prompt sits at position s - pad + delta.
      root: [B] last committed token (not yet in the target cache).  prompt: [B, T] the prompt's tokens (where
        retrieval branches look, with `out`).
      pending: [B, A] tokens the draft has not seen, `n_pending` [B] of them, from draft slot `length_d` on;
        `pending_feat` [B, A, X]: the target's feature of each one's predecessor (X = 0 for LM drafts).
      pad_d, delta_d: [B] the draft's own left padding and position delta: its prompt is shorter than the
        target's when visual tokens are pruned, so its slots trail the target's by a fixed offset per row while
        the positions agree (for text prompts pad_d = pad and both deltas are 0).
      t_cache, d_cache: target and draft KV caches.  key: PRNG key.
      alpha: [B] confidence that shapes the next tree.  d_max: [B] SAGE's moving depth cap.
      hist: [B, hist] recent τ, `hist_n` [B] how many were recorded.
      n_budget, d_budget: [B] the hardware-aware node budget (<= n_max) and depth cap (<= d_cap).
      steps: loop iterations.  sum_tau, n_steps: [B] committed draft tokens (bonus excluded; a last step cut at EOS or
        `max_new` counts only what it committed) and active steps per row.
      draft_forwards: draft forwards spent (batched).  draft_width, verify_width: summed static widths those
        forwards and the target's verify forwards ran at (with bucketing, what the step really paid for).
      accepted_depth: [ranks, D_cap + 1] (ranks = n_max + 1) how often a draft node of each priority rank
        (1 = admitted first) was committed at each depth, over active rows: E[τ] of a budget (N, D) sums ranks
        1..N at depths up to D, over steps (`budget.py`; a level-built tree's ranks run level by level, so a depth
        cap cuts the ranks that sat deeper out of a budget's first N). Summed over depths: `Stats.accepted_at`.
      r_score: [B] the running precision of each row's retrieval chains (the gate, `retrieval.precision`).
      r_steps, r_nodes, r_accepted: row-steps that merged a chain, the nodes the chains added to the trees, and the
        accepted tokens that sat on those nodes (what retrieval adds to E[τ] and to the verify width).
      alpha_trace, depth_trace, nodes_trace, width_trace, tau_trace: [steps] per-step values of row 0
        (width: the widest level).
    """

    out: Int[Array, "B out"]
    n_gen: Int[Array, " B"]
    done: Bool[Array, " B"]
    max_new: Int[Array, " B"]
    length: Int[Array, " B"]
    pad: Int[Array, " B"]
    delta: Int[Array, " B"]
    root: Int[Array, " B"]
    prompt: Int[Array, "B T"]
    pending: Int[Array, "B A"]
    pending_feat: Float[Array, "B A X"]
    n_pending: Int[Array, " B"]
    length_d: Int[Array, " B"]
    pad_d: Int[Array, " B"]
    delta_d: Int[Array, " B"]
    t_cache: KVCache
    d_cache: KVCache
    key: jax.Array
    alpha: Float[Array, " B"]
    d_max: Int[Array, " B"]
    hist: Float[Array, "B hist"]
    hist_n: Int[Array, " B"]
    n_budget: Int[Array, " B"]
    d_budget: Int[Array, " B"]
    steps: Int[Array, ""]
    sum_tau: Int[Array, " B"]
    n_steps: Int[Array, " B"]
    draft_forwards: Int[Array, ""]
    draft_width: Int[Array, ""]
    verify_width: Int[Array, ""]
    accepted_depth: Int[Array, "ranks levels"]
    r_score: Float[Array, " B"]
    r_steps: Int[Array, ""]
    r_nodes: Int[Array, ""]
    r_accepted: Int[Array, ""]
    alpha_trace: Float[Array, " steps"]
    depth_trace: Int[Array, " steps"]
    nodes_trace: Int[Array, " steps"]
    width_trace: Int[Array, " steps"]
    tau_trace: Int[Array, " steps"]


def spec_prefill(cfg: SpecConfig, target: LM, drafter: Drafter, tokens: Int[Array, "B T"], pad: Int[Array, " B"],
                 temperature: Float[Array, " B"], max_new: Int[Array, " B"], key: jax.Array,
                 alpha0: Float[Array, " B"], n_budget: Int[Array, " B"] | None = None,
                 d_budget: Int[Array, " B"] | None = None, media: visual_pruning.Media | None = None) -> SpecState:
    """Prefills both caches with the prompt; the target's first token becomes the first root. `alpha0`: the
    confidence that shapes the first tree; `n_budget` / `d_budget`: node budget (0 with retrieval chains: they
    alone are verified) and depth cap (default: the policy's static n_max / d_cap). All per-request values, so
    arrays. `media`: a multimodal prompt; the draft then reads the visual tokens `media.keep` says, compacted into
    `cfg.draft_prompt_len` slots."""
    b, t = tokens.shape
    pol = cfg.policy
    a = pol.d_cap + 1
    t_cache = target.init_cache(b, cfg.capacity)
    d_cache = drafter.init_cache(b, cfg.draft_capacity)
    delta = jnp.zeros((b,), jnp.int32)
    if media is None:
        hidden, t_cache, *tapped = prefill(target, tokens, pad, t_cache, taps=drafter.taps)
        feats = tapped[0] if drafter.taps else hidden
        positions, mask = prompt_layout(tokens, pad, cfg.capacity)
        d_cache = drafter.prefill(tokens, positions, mask, feats, d_cache)
        pad_d, delta_d, t_d = pad, delta, t
    else:
        hidden, t_cache, keep, feats = target_prefill_media(cfg, target, tokens, pad, media, t_cache, drafter.taps)
        pad_d, delta_d, d_cache = draft_prefill_media(cfg, drafter, tokens, pad, media, feats, keep, d_cache)
        delta, t_d = media.delta.astype(jnp.int32), cfg.draft_prompt_len or t
    key, sub = jax.random.split(key)
    first = sampling.sample(sub, target.head(hidden[:, -1:])[:, 0], temperature, cfg.sampling)
    root_feat = drafter.read(feats[:, -1:])[:, 0]
    feat = jnp.zeros((b, a, drafter.feature_dim), root_feat.dtype).at[:, 0].set(root_feat)
    out = jnp.full((b, cfg.max_new_tokens + a), cfg.pad_id, jnp.int32).at[:, 0].set(first)
    n_steps = cfg.max_steps
    n_budget = jnp.full((b,), pol.n_max, jnp.int32) if n_budget is None else n_budget
    d_budget = jnp.full((b,), pol.d_cap, jnp.int32) if d_budget is None else d_budget
    return SpecState(
        out=out, n_gen=jnp.ones((b,), jnp.int32), done=is_eos(first, cfg.eos_ids) | (max_new <= 1),
        max_new=max_new, length=jnp.full((b,), t, jnp.int32), pad=pad, delta=delta, root=first, prompt=tokens,
        pending=jnp.zeros((b, a), jnp.int32).at[:, 0].set(first), pending_feat=feat,
        n_pending=jnp.ones((b,), jnp.int32), length_d=jnp.full((b,), t_d, jnp.int32), pad_d=pad_d,
        delta_d=delta_d, t_cache=t_cache, d_cache=d_cache, key=key,
        alpha=alpha0.astype(jnp.float32), d_max=jnp.full((b,), pol.d_max, jnp.int32),
        hist=jnp.zeros((b, pol.history_window), jnp.float32), hist_n=jnp.zeros((b,), jnp.int32),
        n_budget=jnp.clip(n_budget, 0 if pol.retrieval else 1, pol.n_max).astype(jnp.int32),
        d_budget=jnp.clip(d_budget, 1, pol.d_cap).astype(jnp.int32),
        steps=jnp.int32(0), sum_tau=jnp.zeros((b,), jnp.int32), n_steps=jnp.zeros((b,), jnp.int32),
        draft_forwards=jnp.int32(1), draft_width=jnp.int32(t_d), verify_width=jnp.int32(0),
        accepted_depth=jnp.zeros((pol.n_max + 1, pol.d_cap + 1), jnp.int32), r_score=jnp.ones((b,), jnp.float32),
        r_steps=jnp.int32(0), r_nodes=jnp.int32(0), r_accepted=jnp.int32(0),
        alpha_trace=jnp.full((n_steps,), jnp.nan, jnp.float32),
        depth_trace=jnp.zeros((n_steps,), jnp.int32), nodes_trace=jnp.zeros((n_steps,), jnp.int32),
        width_trace=jnp.zeros((n_steps,), jnp.int32), tau_trace=jnp.zeros((n_steps,), jnp.int32),
    )


def target_prefill_media(cfg: SpecConfig, target: LM, tokens: Int[Array, "B T"], pad: Int[Array, " B"],
                         media: visual_pruning.Media, t_cache: KVCache, taps: tuple[int, ...] = ()
                         ) -> tuple[Float[Array, "B T D"], KVCache, Bool[Array, "B T"], Float[Array, "B T Z"]]:
    """The target's prefill over every visual token, and which prompt slots the draft keeps (ranked by this
    prefill's attention for `prune="attention"`): (hidden, cache, keep [B, T], the features the draft reads:
    the inputs of the `taps` layers, or `hidden` without taps)."""
    t = tokens.shape[1]
    slot = jnp.arange(t, dtype=jnp.int32)[None]
    probe = None
    if cfg.draft_prompt_len and cfg.prune == "attention":
        probe = visual_pruning.probe_rows(media.kind, pad)
    hidden, t_cache, *extra = prefill(target, tokens, pad, t_cache, media, probe, taps=taps)
    feats = extra[-1] if taps else hidden
    if not cfg.draft_prompt_len:  # nothing pruned: the draft reads the target's prompt as it is
        return hidden, t_cache, slot >= pad[:, None], feats
    score = extra[0][:, :t] if probe is not None else None
    return hidden, t_cache, visual_pruning.keep_mask(cfg.prune, media.kind, pad, media.keep, score), feats


def draft_prefill_media(cfg: SpecConfig, drafter: Drafter, tokens: Int[Array, "B T"], pad: Int[Array, " B"],
                        media: visual_pruning.Media, hidden: Float[Array, "B T Z"], keep: Bool[Array, "B T"],
                        d_cache: KVCache) -> tuple[Int[Array, " B"], Int[Array, " B"], KVCache]:
    """The draft's prefill over the kept slots, compacted to `cfg.draft_prompt_len` at their original positions
    (`hidden`: the target's features the draft reads): (the draft's left padding, its position delta, its
    cache)."""
    t = tokens.shape[1]
    t_d = cfg.draft_prompt_len or t
    idx, pad_d = visual_pruning.compact_index(keep, t_d)
    emb = media.embeddings if media.draft_embeddings is None else media.draft_embeddings
    slots = jnp.broadcast_to(jnp.arange(t_d, dtype=jnp.int32), idx.shape)
    mask = causal_visibility(slots, pad_d, cfg.draft_capacity)
    pick = lambda x: visual_pruning.gather(x, idx)  # noqa: E731
    d_cache = drafter.prefill(pick(tokens), pick(media.positions), mask, pick(hidden), d_cache,
                              embeddings=pick(emb))
    pruned = (t - pad) - (t_d - pad_d)
    return pad_d, media.delta.astype(jnp.int32) + pruned, d_cache


# ******** Draft: catch up on the pending tokens, then build the tree. ********


@flax.struct.dataclass
class Draft:
    """One step's draft.

    Attributes: tree (the verified view, valid nodes packed first); pool (every candidate, for α statistics);
    cache: the draft cache after the catch-up and the tree's levels; alpha: [B] the confidence of this step's root
    distribution; alpha_used: [B] the α that shaped this tree; forwards, width: draft forwards spent and their
    summed static widths; cand / n_cand: [B, L] / [B] the retrieval lookup's chain (L = 0 without retrieval);
    n_merged: [B] how many of its tokens were offered (0 where the gate was shut); n_stored: [B] the tokens of the
    datastore's chain (`TreePolicy.datastore`; 0 without); n_head: [B] the tree's nodes before the chains were
    merged (root included: slots from n_head on are the chains' own).
    """

    tree: Tree
    pool: Pool
    cache: KVCache
    alpha: Float[Array, " B"]
    alpha_used: Float[Array, " B"]
    forwards: Int[Array, ""]
    width: Int[Array, ""]
    cand: Int[Array, "B chain"]
    n_cand: Int[Array, " B"]
    n_merged: Int[Array, " B"]
    n_stored: Int[Array, " B"]
    n_head: Int[Array, " B"]


def catch_up(cfg: SpecConfig, drafter: Drafter, s: SpecState
             ) -> tuple[Float[Array, "B V"], Float[Array, "B X"], KVCache, Int[Array, ""]]:
    """Runs the draft over the pending tokens (at the smallest static width holding them): the root's draft
    log-probabilities and predicted feature, the draft cache, and the width it ran at."""
    a = cfg.policy.d_cap + 1
    slots = s.length_d[:, None] + jnp.arange(a, dtype=jnp.int32)[None]
    mask = Visibility.chain(s.length_d, s.pad_d, a)
    positions = slots - s.pad_d[:, None] + s.delta_d[:, None]
    last = (s.n_pending - 1)[:, None, None]  # the root: the last pending token

    def at_width(w):
        def run():
            logq, feat, cache = drafter(s.pending[:, :w], s.pending_feat[:, :w], positions[:, :w],
                                        mask.first(w), s.d_cache, s.length_d)
            pick = jnp.minimum(last, w - 1)
            return (jnp.take_along_axis(logq, pick, 1)[:, 0], jnp.take_along_axis(feat, pick, 1)[:, 0], cache,
                    jnp.int32(w))
        return run

    return widths.switch(jnp.max(s.n_pending), widths.draft_sizes(a, cfg.bucket_ratio), at_width)


def draft(cfg: SpecConfig, drafter: Drafter, s: SpecState, store: datastore.Datastore | None = None) -> Draft:
    """Catches the draft up, reads α from the root distribution, shapes and builds this step's tree, and merges
    the retrieval chains into it (`store`: the datastore of a `TreePolicy.datastore` policy)."""
    pol = cfg.policy
    # Node budget 0 on every row: the chains alone are verified, so the draft need not catch up. Its cache then
    # falls behind, which is safe because a request's node budget is fixed: its draft is never asked again.
    if pol.retrieval:
        like = jax.eval_shape(lambda: catch_up(cfg, drafter, s)[:2])

        def skip():
            return (*(jnp.zeros(x.shape, x.dtype) for x in like), s.d_cache, jnp.int32(0))

        root_logq, root_feat, cache, cu_width = jax.lax.cond(jnp.all(s.n_budget == 0), skip,
                                                             lambda: catch_up(cfg, drafter, s))
    else:
        root_logq, root_feat, cache, cu_width = catch_up(cfg, drafter, s)
    alpha = policies.confidence(root_logq, pol.top_k)
    alpha_used = alpha if pol.alpha_source == "fresh_root" else s.alpha
    shape = policies.step_shape(pol, alpha_used, s.d_max, s.d_budget)
    root_slot = s.length_d + s.n_pending - 1  # the root's draft slot (its target slot is `length`)
    tree, pool, cache, n_levels, level_width = build_tree(
        pol, drafter, cache, s.root, root_logq, alpha, root_feat, shape, root_slot, s.pad_d,
        budget=s.n_budget, bucket_ratio=cfg.bucket_ratio, delta=s.delta_d)
    n_head = jnp.sum(tree.valid, axis=1).astype(jnp.int32)
    b = n_head.shape[0]
    cand, n_cand = jnp.zeros((b, 0), jnp.int32), jnp.zeros((b,), jnp.int32)
    n_merged = n_stored = n_cand
    if pol.retrieval:
        history, valid, end = _history(s)
        cand, n_cand = retrieval.lookup(history, valid, end, pol.retrieval)
        if pol.gated:  # the row's gate: chains_gate when its chains are verified alone (node budget 0)
            gate = jnp.where(s.n_budget == 0, pol.chains_gate, pol.retrieval_gate)
            n_merged = jnp.where(s.r_score >= gate, n_cand, 0)
        else:
            n_merged = n_cand
        tree = retrieval.widen(tree, pol.tree_size - tree.size)
        limit = chain_limit(cfg, tree.size, n_head)
        tree = retrieval.merge(tree, cand, n_merged, limit)
        if pol.datastore:
            if store is None:
                raise ValueError("a datastore policy needs the Datastore argument")
            stored, n_stored = datastore.lookup(store, history, valid, end, pol.retrieval)
            tree = retrieval.merge(tree, stored, n_stored, limit)
    return Draft(tree=tree, pool=pool, cache=cache, alpha=alpha, alpha_used=alpha_used,
                 forwards=(cu_width > 0).astype(jnp.int32) + n_levels,
                 width=cu_width + level_width, cand=cand, n_cand=n_cand, n_merged=n_merged, n_stored=n_stored,
                 n_head=n_head)


def chain_limit(cfg: SpecConfig, tree_size: int, n_head: Int[Array, " B"]) -> Int[Array, " B"]:
    """How many nodes the retrieval chains may fill a row's tree up to: the verify width (`widths.verify_sizes`)
    that holds the draft's tree, or the root and one whole chain, whichever is wider. A chain then never pushes the
    verify forward into a wider bucket than that: on the 2-core CPU a (3, 2) tree and a 7-token chain, 11 nodes,
    fell into the 32-row bucket at ~4.5 plain steps where 8 rows cost ~1.5. Without bucketing: no limit."""
    sizes = jnp.asarray(widths.verify_sizes(tree_size, cfg.bucket_ratio, cfg.policy.retrieval), jnp.int32)
    need = jnp.maximum(n_head, cfg.policy.retrieval + 1)
    return sizes[jnp.minimum(jnp.searchsorted(sizes, need), len(sizes) - 1)]


def _history(s: SpecState) -> tuple[Int[Array, "B ctx"], Bool[Array, "B ctx"], Int[Array, " B"]]:
    """Where retrieval looks: the prompt and the tokens generated so far, which of those slots are real, and the
    slot of the newest token (the root)."""
    t, o = s.prompt.shape[1], s.out.shape[1]
    history = jnp.concatenate([s.prompt, s.out], axis=1)
    valid = jnp.concatenate([jnp.arange(t)[None] >= s.pad[:, None], jnp.arange(o)[None] < s.n_gen[:, None]], 1)
    return history, valid, t + s.n_gen - 1


# ******** Verify: one target forward over root + tree, at the smallest width holding its nodes. ********


@flax.struct.dataclass
class Verdict:
    """What the target accepted.

    Attributes: path: [B, A] tree slots of the accepted path, root first (unused depths repeat its last node);
    tau: [B] accepted draft tokens; bonus: [B] the target's token after them; path_feat: [B, A, X] the target's
    features along the path (the draft's next inputs); new_kv: the keys/values of every tree node (the commit
    writes the path's); width: the static width the forward ran at.
    """

    path: Int[Array, "B A"]
    tau: Int[Array, " B"]
    bonus: Int[Array, " B"]
    path_feat: Float[Array, "B A X"]
    new_kv: NewKV
    width: Int[Array, ""]


def verify(cfg: SpecConfig, target: LM, s: SpecState, tree: Tree, drafter: Drafter, temperature: Float[Array, " B"],
           key: jax.Array) -> Verdict:
    """The target's forward over the tree (the cache is only read; `commit` writes the accepted rows), then greedy
    acceptance, or for rows with T > 0 sequential rejection sampling (`verify.py`). The accepted path's features
    are what `drafter` reads (`Drafter.read` of the target's hidden states or tapped layer inputs)."""
    dc = cfg.policy.d_cap
    n_tree = jnp.max(jnp.sum(tree.valid, 1))  # root included
    sizes = widths.verify_sizes(tree.size, cfg.bucket_ratio, cfg.policy.retrieval)

    def grow(x, axis=1):  # the node axis, padded back to the tree's static size
        return jnp.pad(x, [(0, tree.size - x.shape[axis]) if i == axis else (0, 0) for i in range(x.ndim)])

    def forward_at(w):
        def run():
            t = tree.prefix(w)
            positions = (s.length - s.pad + s.delta)[:, None] + t.depth
            hidden, kv, *tapped = target.forward(t.tokens, positions, t.visibility(s.length, s.pad), s.t_cache,
                                                 s.length, write=False, taps=drafter.taps)
            best = jnp.argmax(target.head(hidden), axis=-1).astype(jnp.int32)
            feats = tapped[0] if drafter.taps else hidden[..., :0]  # without taps the features are `hidden`'s
            return (grow(hidden), grow(feats), grow(best), jax.tree.map(lambda x: grow(x, 2), kv), jnp.int32(w))
        return run

    hidden, tapped, best, new_kv, width = widths.switch(n_tree, sizes, forward_at)
    greedy = verify_lib.accept_greedy_best(tree, best, dc)

    def sampled(_):  # T > 0 rows: the target's processed log-probs at the verified width, -inf padded
        def logp_at(w):
            def run():
                logp = sampling.processed_logprobs(target.head(hidden[:, :w]), temperature, cfg.sampling)
                return jnp.pad(logp, ((0, 0), (0, tree.size - w), (0, 0)), constant_values=-jnp.inf)
            return run

        drawn = verify_lib.accept_sampled(key, tree, widths.switch(n_tree, sizes, logp_at), dc)
        pick = temperature > 0
        return tuple(jnp.where(pick.reshape((-1,) + (1,) * (g.ndim - 1)), x, g) for x, g in zip(drawn, greedy))

    path, tau, bonus = jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: greedy, None)
    path_feat = drafter.read(jnp.take_along_axis(tapped if drafter.taps else hidden, path[:, :, None], 1))
    return Verdict(path=path, tau=tau, bonus=bonus, path_feat=path_feat, new_kv=new_kv, width=width)


# ******** Commit: the accepted path and its bonus token, cut at EOS and at the row's token limit. ********


def _keep(active: Bool[Array, " B"], new, old):
    """`new` on the rows still decoding, `old` on the finished ones."""
    return jnp.where(active.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)


def accepted_tokens(cfg: SpecConfig, tree: Tree, v: Verdict) -> Int[Array, "B A"]:
    """The step's new tokens: the accepted path (root excluded), then the bonus token, then `pad_id`."""
    b, a = v.tau.shape[0], cfg.policy.d_cap + 1
    i = jnp.arange(a, dtype=jnp.int32)[None]
    path_tokens = jnp.take_along_axis(tree.tokens, v.path, 1)  # root first
    shifted = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], 1)
    return jnp.where(i < v.tau[:, None], shifted, jnp.where(i == v.tau[:, None], v.bonus[:, None], cfg.pad_id))


def commit(cfg: SpecConfig, s: SpecState, tree: Tree, v: Verdict, active: Bool[Array, " B"]) -> SpecState:
    """Appends the accepted tokens to `out`, writes their keys/values to the target cache, and queues them (the
    bonus last, the next root) as the draft's pending tokens."""
    a = cfg.policy.d_cap + 1
    i = jnp.arange(a, dtype=jnp.int32)[None]
    new = accepted_tokens(cfg, tree, v)
    eos = is_eos(new, cfg.eos_ids) & (i <= v.tau[:, None])
    n_new = jnp.where(jnp.any(eos, 1), jnp.argmax(eos, 1) + 1, v.tau + 1)
    n_new = jnp.where(active, jnp.minimum(n_new, s.max_new - s.n_gen), 0).astype(jnp.int32)
    emitted = jnp.where(i < n_new[:, None], new, cfg.pad_id)
    out = jax.vmap(lambda o, u, at: jax.lax.dynamic_update_slice_in_dim(o, u, at, 0))(s.out, emitted, s.n_gen)
    n_gen = s.n_gen + n_new
    done = s.done | (active & jnp.any(eos & (i < n_new[:, None]), 1)) | (n_gen >= s.max_new)
    return s.replace(
        out=out, n_gen=n_gen, done=done, t_cache=s.t_cache.commit(v.new_kv, v.path, s.length),
        length=_keep(active, s.length + 1 + v.tau, s.length), root=_keep(active, v.bonus, s.root),
        pending=_keep(active, jnp.where(i <= v.tau[:, None], emitted, 0), s.pending),
        n_pending=_keep(active, v.tau + 1, s.n_pending), pending_feat=_keep(active, v.path_feat, s.pending_feat),
        length_d=_keep(active, s.length_d + s.n_pending, s.length_d))


# ******** Policy state: α for the next tree, and the τ history that moves D_max. ********


def update_policy(cfg: SpecConfig, s: SpecState, d: Draft, v: Verdict, active: Bool[Array, " B"]) -> SpecState:
    pol = cfg.policy
    if pol.alpha_source == "accepted_path_mean":
        node_alpha = jnp.take_along_axis(d.pool.alpha, v.path, 1)
        on = (jnp.arange(v.path.shape[1])[None] <= v.tau[:, None]) & ~jnp.isnan(node_alpha)
        alpha = jnp.sum(jnp.where(on, node_alpha, 0), 1) / jnp.maximum(jnp.sum(on, 1), 1)
    else:
        alpha = d.alpha
    hist = jax.vmap(lambda h, n, t: h.at[n % pol.history_window].set(t))(s.hist, s.hist_n, v.tau.astype(jnp.float32))
    hist_n = s.hist_n + 1
    mean_tau = jnp.mean(hist, axis=1)
    full = hist_n >= pol.history_window
    move = jnp.where(full & (mean_tau < pol.history_low), -1, jnp.where(full & (mean_tau > pol.history_high), 1, 0))
    d_max = jnp.clip(s.d_max + move, pol.d_min + 1, pol.d_cap) if pol.history else s.d_max
    r_score = s.r_score
    if pol.gated:  # the gate's precision, from what the target committed (merged or not)
        prec, checked = retrieval.precision(d.cand, d.n_cand, accepted_tokens(cfg, d.tree, v), v.tau + 1)
        r_score = jnp.where(active, retrieval.update_precision(s.r_score, prec, checked), s.r_score)
    return s.replace(alpha=_keep(active, alpha, s.alpha), d_max=_keep(active, d_max, s.d_max),
                     hist=_keep(active, hist, s.hist), hist_n=_keep(active, hist_n, s.hist_n), r_score=r_score)


# ******** Statistics: counters, per-rank acceptance (`budget.py`) and row 0's traces. ********


def record(pol: policies.TreePolicy, s: SpecState, d: Draft, v: Verdict, active: Bool[Array, " B"],
           kept: Int[Array, " B"]) -> SpecState:
    """Counts the step. `kept`: the draft tokens each row committed (`v.tau`, less what EOS or the row's token limit
    cut off on its last step): τ and the per-rank acceptance count what reached the output, not what verified."""
    tree = d.tree
    depth_of_level = jnp.arange(1, pol.d_cap + 1)[:, None]
    level_sizes = jnp.sum(tree.valid[0][None, :] & (tree.depth[0][None, :] == depth_of_level), 1)
    chain = jnp.arange(tree.size)[None] >= d.n_head[:, None]  # the retrieval chain's own nodes: no draft rank
    # Priority rank of each draft node: pool order for level-built trees, cumulative log-prob for EAGLE-2.
    if pol.name == "eagle2":
        score = jnp.where(tree.valid & ~chain, tree.logp, -jnp.inf)
        slot = jnp.arange(tree.size)
        ahead = (score[:, None, :] > score[:, :, None]) | (
            (score[:, None, :] == score[:, :, None]) & (slot[None, None, :] < slot[None, :, None]))
        rank = jnp.sum(ahead, 2)
    else:
        rank = jnp.broadcast_to(jnp.arange(tree.size), tree.valid.shape)
    rank = jnp.where(chain, pol.n_max + 1, rank)
    i = jnp.arange(v.path.shape[1])[None]
    on_path = (i >= 1) & (i <= kept[:, None]) & active[:, None]
    path_rank = jnp.where(on_path, jnp.take_along_axis(rank, v.path, 1), pol.n_max + 1)
    path_depth = jnp.broadcast_to(i, path_rank.shape)  # a path's i-th node sits at depth i
    on_chain = on_path & jnp.take_along_axis(chain, v.path, 1)
    chain_nodes = jnp.sum(tree.valid & chain, axis=1)
    at = s.steps
    return s.replace(
        steps=s.steps + 1, sum_tau=s.sum_tau + jnp.where(active, kept, 0), n_steps=s.n_steps + active,
        draft_forwards=s.draft_forwards + d.forwards, draft_width=s.draft_width + d.width,
        verify_width=s.verify_width + v.width,
        accepted_depth=s.accepted_depth.at[path_rank.reshape(-1), path_depth.reshape(-1)].add(1, mode="drop"),
        r_steps=s.r_steps + jnp.sum(active & ((d.n_merged > 0) | (d.n_stored > 0))),
        r_nodes=s.r_nodes + jnp.sum(jnp.where(active, chain_nodes, 0)), r_accepted=s.r_accepted + jnp.sum(on_chain),
        alpha_trace=s.alpha_trace.at[at].set(d.alpha_used[0]),
        depth_trace=s.depth_trace.at[at].set(jnp.max(jnp.where(tree.valid[0], tree.depth[0], 0))),
        nodes_trace=s.nodes_trace.at[at].set(jnp.sum(tree.valid[0]) - 1),
        width_trace=s.width_trace.at[at].set(jnp.max(level_sizes)), tau_trace=s.tau_trace.at[at].set(kept[0]))


# ******** The loop. ********


def spec_step(cfg: SpecConfig, target: LM, drafter: Drafter, s: SpecState, temperature: Float[Array, " B"],
              store: datastore.Datastore | None = None) -> SpecState:
    return traced_step(cfg, target, drafter, s, temperature, store)[0]


def traced_step(cfg: SpecConfig, target: LM, drafter: Drafter, s: SpecState, temperature: Float[Array, " B"],
                store: datastore.Datastore | None = None) -> tuple[SpecState, Draft, Verdict]:
    """One step, with its draft (tree) and verdict: what `bench/tree_view.py` draws."""
    active = ~s.done
    key, sub = jax.random.split(s.key)
    d = draft(cfg, drafter, s, store)
    v = verify(cfg, target, s, d.tree, drafter, temperature, sub)
    committed = commit(cfg, s.replace(d_cache=d.cache, key=key), d.tree, v, active)
    kept = committed.n_gen - s.n_gen - active  # draft tokens committed (0 on finished rows)
    committed = update_policy(cfg, committed, d, v, active)
    return record(cfg.policy, committed, d, v, active, kept), d, v


def spec_decode(cfg: SpecConfig, target: LM, drafter: Drafter, state: SpecState, temperature: Float[Array, " B"],
                store: datastore.Datastore | None = None) -> SpecState:
    """Steps until every row hit EOS or its `max_new` tokens. `store`: the datastore a `TreePolicy.datastore`
    policy draws its second chain from (an argument of the loop, not a constant baked into it)."""

    def cond(s: SpecState):
        return (s.steps < cfg.max_steps) & ~jnp.all(s.done)

    return jax.lax.while_loop(cond, lambda s: spec_step(cfg, target, drafter, s, temperature, store), state)
