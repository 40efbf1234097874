"""Tree policies as frozen configs plus the per-level admission rule each applies.

`chain` and `static` follow a template; `eagle2` expands a top-k beam by cumulative log-prob and reranks
globally to a node budget; `sage` shapes depth and width from the draft's confidence α (the paper's Eqs. 7-11).
Every value that changes per step (α, depth, widths, thresholds, the current D_max) is an array: one compile
serves them all. Where the paper can be read two ways, the reading is a field with a stated default.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from sage_jax.decoding import tree as tree_lib

PolicyName = Literal["chain", "static", "eagle2", "sage"]
POLICIES: tuple[str, ...] = ("chain", "static", "eagle2", "sage")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreePolicy:
    """Static description of how trees are built.

    Attributes:
      name: chain | static | eagle2 | sage.
      n_max: node budget W (root excluded) of the verified tree.
      d_cap: static depth cap (levels of the level loop; SAGE's D_max can move up to it).
      frontier: F, how many nodes of a level are expanded (draft forward width).
      top_k: k, candidate children per expanded node (and SAGE's entropy top-k).
      template: rank paths for chain/static.
      SAGE (paper values): d_min, d_max, w_min, w_max, theta (θ_l = theta·l/D), alpha_init.
      alpha_source: "root" (the draft's root distribution at step t shapes step t+1; default), "fresh_root"
        (the current step's own root distribution: no lookahead; an ablation), "accepted_path_mean" (mean α
        over the expanded nodes of the accepted path).
      threshold_prob: which probability must exceed θ_l = θ·l/D: "local", the candidate's own draft probability
        (the paper's prose, "each candidate whose probability exceeds"; default), or "cumulative", its path's
        probability (the paper's formal statement). The formal reading compares a probability that falls with
        depth against a threshold that rises with it, so it cuts a weak draft's trees short (docs/sage.md,
        "Which probability θ_l reads"). The node budget still admits by path probability.
      parent_prob: "local" (default) or "cumulative" probability of the parent in the width decay.
      adapt_depth / adapt_width: ablations; when off, that dimension uses α = 0.5.
      history: the sliding-window hysteresis on D_max (window, low, high; ±1 per step, floor d_min+1, cap d_cap).
      retrieval: L, the length of a prompt-lookup chain merged into every tree (`retrieval.py`; 0 = off,
        at most d_cap); the verified tree then has up to L more nodes.
      retrieval_gate: a row merges its chain only while the running precision of its recent chains (how many of
        their leading tokens the target committed, `retrieval.precision`) is at least this; the precision is
        measured whether or not the chain was merged, so a closed gate reopens when the text starts copying.
        Default 0.5 (chosen by speed, docs/sage.md, "Retrieval gate"); 0 merges every chain, which maximises
        acceptance, not speed.
      chains_gate: the gate at node budget 0, where the prompt-lookup chain is all that is verified: a closed gate
        then verifies the root alone, which costs one plain decoding step (`widths.verify_sizes`), so free text
        runs at the speed of plain decoding and copying text at prompt-lookup speed (docs/sage.md). Default 0.5.
      datastore: also merge an L-token chain from a datastore of the target's own answers (`datastore.py`; the
        loop then takes a `Datastore` argument): up to L more nodes again. Needs retrieval = L >= 1; ungated.
    """

    name: PolicyName = "sage"
    n_max: int = 64
    d_cap: int = 10
    frontier: int = 16
    top_k: int = 10
    template: tuple[tuple[int, ...], ...] = ()
    d_min: int = 3
    d_max: int = 8
    w_min: int = 2
    w_max: int = 10
    theta: float = 0.1
    alpha_init: float = 0.5
    alpha_source: Literal["root", "fresh_root", "accepted_path_mean"] = "root"
    threshold_prob: Literal["local", "cumulative"] = "local"
    parent_prob: Literal["local", "cumulative"] = "local"
    adapt_depth: bool = True
    adapt_width: bool = True
    history: bool = True
    history_window: int = 10
    history_low: float = 2.0
    history_high: float = 3.0
    retrieval: int = 0
    retrieval_gate: float = 0.5
    chains_gate: float = 0.5
    datastore: bool = False

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"unknown policy {self.name!r}; expected one of {', '.join(POLICIES)}")
        if self.name in ("chain", "static"):
            if not self.template:
                raise ValueError(f"policy {self.name!r} needs a template")
            if len(self.template) != self.n_max:
                raise ValueError(f"template has {len(self.template)} nodes but n_max={self.n_max}")
            tree_lib.template_tables(self.template, self.frontier, self.top_k, self.d_cap)  # validates
        if not 1 <= self.d_min <= self.d_max <= self.d_cap:
            raise ValueError(f"need 1 <= d_min <= d_max <= d_cap, got {self.d_min}, {self.d_max}, {self.d_cap}")
        if not 0 <= self.retrieval <= self.d_cap:
            raise ValueError(f"retrieval chain length must lie in [0, d_cap={self.d_cap}], got {self.retrieval}")
        if self.datastore and not self.retrieval:
            raise ValueError("a datastore chain needs retrieval = L >= 1 (its length)")
        for gate in ("retrieval_gate", "chains_gate"):
            if not 0.0 <= getattr(self, gate) <= 1.0:
                raise ValueError(f"{gate} must lie in [0, 1], got {getattr(self, gate)}")
        if not 1 <= self.w_min <= self.w_max <= self.top_k:
            raise ValueError(f"need 1 <= w_min <= w_max <= top_k, got {self.w_min}, {self.w_max}, {self.top_k}")

    def fitted(self, n: int, d: int) -> TreePolicy:
        """This policy at static sizes that just hold a budget of `n` nodes and depth `d`: the same trees under that
        budget from a smaller program (fewer verify widths, a shallower builder). Template policies, and a budget of
        no draft node (the chains alone), keep their sizes; retrieval chains keep their length."""
        if self.template or n < 1:
            return self
        d_cap = max(d, self.retrieval)
        d_max = min(self.d_max, d_cap)
        return dataclasses.replace(self, n_max=n, d_cap=d_cap, d_max=d_max, d_min=min(self.d_min, d_max),
                                   frontier=min(self.frontier, n))

    # ------------------------------------------------------------------ presets

    @classmethod
    def chain(cls, depth: int = 5, **kw) -> TreePolicy:
        """SD-Chain: a fixed linear draft of `depth` tokens (SpecVLM's 5)."""
        return cls(name="chain", n_max=depth, d_cap=depth, frontier=1, template=tree_lib.chain_template(depth),
                   d_min=1, d_max=depth, **kw)

    @classmethod
    def static(cls, template: tuple[tuple[int, ...], ...] = tree_lib.MC_SIM_7B_63, **kw) -> TreePolicy:
        """SD-Tree: EAGLE-1's `mc_sim_7b_63` (25 nodes, depth 5)."""
        depth = max(len(c) for c in template)
        width = max(sum(1 for c in template if len(c) == d) for d in range(depth + 1))
        return cls(name="static", n_max=len(template), d_cap=depth, frontier=max(width, 1), template=template,
                   d_min=1, d_max=depth, **kw)

    @classmethod
    def eagle2(cls, n_max: int = 60, depth: int = 6, top_k: int = 10, **kw) -> TreePolicy:
        """EAGLE-2: beam of top_k by cumulative log-prob per level, global rerank to n_max."""
        return cls(name="eagle2", n_max=n_max, d_cap=depth, frontier=top_k, top_k=top_k,
                   d_min=1, d_max=depth, w_min=1, w_max=top_k, **kw)

    @classmethod
    def sage(cls, **kw) -> TreePolicy:
        """SAGE with the paper's settings (N_max 64, D 3..8, W 2..10, k 10, θ 0.1, window 10, thresholds 2/3)."""
        return cls(name="sage", **kw)

    @classmethod
    def named(cls, name: str, **kw) -> TreePolicy:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; expected one of ar, {', '.join(POLICIES)}")
        return getattr(cls, name)(**kw)

    # ------------------------------------------------------------------ derived static sizes

    @property
    def pool_size(self) -> int:
        """Candidate pool slots incl. the root: EAGLE-2 keeps every expanded candidate, then reranks."""
        if self.name == "eagle2":
            return 1 + self.top_k + (self.d_cap - 1) * self.frontier * self.top_k
        return 1 + self.n_max

    @property
    def gated(self) -> bool:
        """Whether a row's retrieval chain may be held back by its running precision (either gate above 0)."""
        return bool(self.retrieval) and (self.retrieval_gate > 0 or self.chains_gate > 0)

    @property
    def tree_size(self) -> int:
        """Slots of the verified tree: the root, n_max draft nodes and the retrieval chains' room."""
        return 1 + self.n_max + self.retrieval * (2 if self.datastore else 1)

    @property
    def per_level(self) -> int:
        """Candidates admitted per level at most."""
        return min(self.frontier * self.top_k, self.pool_size - 1)

    @property
    def draft_slots(self) -> int:
        """Draft-cache slots one step may write past the committed prefix (root + F per expanded level)."""
        return 1 + (self.d_cap - 1) * self.frontier


@flax.struct.dataclass
class StepShape:
    """Per-step, per-row tree shape chosen by the policy (arrays, so they never recompile).

    Attributes: depth [B] levels to build; width [B] (SAGE's W(α) at the first level).
    """

    depth: Int[Array, " B"]
    width: Int[Array, " B"]


def confidence(logq: Float[Array, "... V"], k: int) -> Float[Array, "..."]:
    """α = 1 − H(top-k renormalised) / log k  (the paper's Eqs. 7–9)."""
    return confidence_topk(jax.lax.top_k(logq, k)[0])


def confidence_topk(top_logq: Float[Array, "... J"]) -> Float[Array, "..."]:
    """`confidence` from the k largest log-probabilities (already selected)."""
    k = top_logq.shape[-1]
    top = jnp.exp(top_logq)
    p = top / jnp.sum(top, axis=-1, keepdims=True)
    h = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.maximum(p, 1e-30)), 0.0), axis=-1)
    return jnp.clip(1.0 - h / math.log(k), 0.0, 1.0)


def step_shape(policy: TreePolicy, alpha: Float[Array, " B"], d_max: Int[Array, " B"],
               d_budget: Int[Array, " B"] | None = None) -> StepShape:
    """D(α) and W(α) (Eqs. 10–11), within the depth cap and top-k; fixed shapes for the other policies.
    `d_budget` (the hardware-aware depth cap, <= d_cap) bounds the depth of every policy."""
    b = alpha.shape[0]
    cap = jnp.full((b,), policy.d_cap, jnp.int32) if d_budget is None else jnp.clip(d_budget, 1, policy.d_cap)
    if policy.name != "sage":
        depth = max(len(c) for c in policy.template) if policy.template else policy.d_cap
        return StepShape(depth=jnp.minimum(jnp.full((b,), depth, jnp.int32), cap),
                         width=jnp.full((b,), policy.top_k, jnp.int32))
    a_d = alpha if policy.adapt_depth else jnp.full_like(alpha, 0.5)
    a_w = alpha if policy.adapt_width else jnp.full_like(alpha, 0.5)
    depth = jnp.round(policy.d_min + a_d * (d_max - policy.d_min)).astype(jnp.int32)
    width = jnp.floor(policy.w_min + (1.0 - a_w) * (policy.w_max - policy.w_min)).astype(jnp.int32)
    return StepShape(depth=jnp.clip(depth, 1, cap), width=jnp.clip(width, 1, policy.top_k))


def admission(
    policy: TreePolicy,
    level: Int[Array, ""],
    shape: StepShape,
    parent_valid: Bool[Array, "B R"],
    parent_local_p: Float[Array, "B R"],
    parent_cum_logp: Float[Array, "B R"],
    child_logq: Float[Array, "B R J"],
) -> tuple[Bool[Array, "B R J"], Float[Array, "B R J"]]:
    """Which rank-r children of the frontier may enter the tree at `level` (1 = children of the root), and their
    priority (higher is admitted first under the node budget). Template tables enter as static constants."""
    b, r, k = child_logq.shape
    cum = parent_cum_logp[..., None] + child_logq
    ranks = jnp.arange(k)[None, None, :]
    active = (level <= shape.depth)[:, None, None] & parent_valid[..., None]
    if policy.name in ("chain", "static"):
        allowed_t, prio_t = tree_lib.template_tables(policy.template, policy.frontier, policy.top_k, policy.d_cap)
        allowed = jnp.asarray(allowed_t)[level][None] & active
        return allowed, jnp.broadcast_to(jnp.asarray(prio_t)[level][None], (b, r, k))
    if policy.name == "eagle2":
        return active & jnp.isfinite(cum), cum
    # SAGE: width per parent (decayed below the first level), then the probability threshold θ_l.
    w1 = shape.width.astype(jnp.float32)[:, None]
    p_par = parent_local_p if policy.parent_prob == "local" else jnp.exp(parent_cum_logp)
    decayed = jnp.floor(w1 * (0.5 + p_par) / level.astype(jnp.float32))
    width = jnp.where(level == 1, w1, jnp.clip(decayed, 1, policy.top_k))
    theta = policy.theta * level.astype(jnp.float32) / shape.depth.astype(jnp.float32)
    prob = jnp.exp(cum if policy.threshold_prob == "cumulative" else child_logq)
    allowed = active & (ranks < width[..., None]) & (prob > theta[:, None, None])
    return allowed, cum

