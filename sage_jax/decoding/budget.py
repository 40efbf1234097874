"""Hardware-aware tree budgets: measure what a tree costs on this device, choose the budget that pays most.

The paper's speedup model (sage.md Eq. 6): S ≈ (E[τ] + 1) / (c_d·|T| + c_t), per step. Here the step cost is
measured, not assumed: the target's verify forward at every static width the step can run at (`widths.py`),
and the draft's forward at every frontier width, on the current device, cached per (device, models, widths).
E[τ] comes from running acceptance statistics: how often the node of each priority rank was accepted when the
budget offered it, and at which depth (`SpecState.accepted_depth`). Because a tree with a budget of N nodes is the
first N nodes of the unbudgeted tree in priority order, E[τ](N) = Σ_{i ≤ N} p_i; a depth cap D keeps those of the
N that sat no deeper than D (`AcceptanceStats.expected_tau`).
Acceptance does not depend on the device, so a draft checkpoint can ship statistics measured on held-out prompts
(`python -m sage_jax.evaluate_draft --write-prior`) as the chooser's prior: the first request is then decided by
the model, not spent exploring.

The chosen (N, D) enter the compiled loop as arrays: changing them never recompiles.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs import sharding
from sage_jax.decoding.drafters import build_drafter
from sage_jax.models.visibility import Visibility


@dataclasses.dataclass
class CostProfile:
    """Measured milliseconds per forward at each static width.

    Attributes: device; verify_widths / verify_ms: the target's verify forward (+ head + argmax) at each width
    (root included); draft_widths / draft_ms: one draft forward (+ head + top-k) at each width; ar_ms: the
    target at width 1 (a plain decoding step).
    """

    device: str
    verify_widths: list[int]
    verify_ms: list[float]
    draft_widths: list[int]
    draft_ms: list[float]
    ar_ms: float = 0.0  # one plain decoding step (width 1): the cost a tree must beat

    def verify_cost(self, nodes: int) -> float:
        """ms of verifying `nodes` tree nodes (+ the root) at the width bucket they fall in."""
        i = int(np.searchsorted(self.verify_widths, nodes + 1))
        return self.verify_ms[min(i, len(self.verify_ms) - 1)]

    def draft_cost(self, width: int) -> float:
        i = int(np.searchsorted(self.draft_widths, width))
        return self.draft_ms[min(i, len(self.draft_ms) - 1)]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def time_ms(fn, *args, repeats: int) -> float:
    """Median milliseconds of `fn(*args)` over `repeats` calls after a compile + warm-up call."""
    return time_all([(fn, *args)], repeats=repeats)[0]


def time_all(calls: list[tuple], repeats: int) -> list[float]:
    """Median milliseconds of each `fn(*args)` in `calls` ((fn, *args) tuples), timed in `repeats` interleaved
    rounds after one compile + warm-up call each: on a shared machine the load drifts, and a cost model built
    from ratios needs every width timed under the same load."""
    for fn, *args in calls:
        jax.block_until_ready(fn(*args))
    ts = [[] for _ in calls]
    for _ in range(repeats):
        for t, (fn, *args) in zip(ts, calls):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            t.append(time.perf_counter() - t0)
    return [float(np.median(t) * 1e3) for t in ts]


# Each timed call runs this many steps in one compiled loop: the cache is then carried (and written) in place and
# the call's dispatch shared, as in the decoding loops; one step per call would time a copy of the whole cache and
# the dispatch of every weight, which makes a plain step look dearer (and a tree cheaper) than it is in a loop.
LOOP_STEPS = 4


def _looped(step):
    """`step(*models, cache, tokens) -> (tokens, cache)` run `LOOP_STEPS` times under one jit, each step fed the
    tokens the last one returned (so that nothing in the loop is invariant and hoisted out of it)."""

    @jax.jit
    def run(*args):
        *models, cache, tokens = args

        def body(_, carry):
            return step(*models, carry[1], carry[0])

        return jax.lax.fori_loop(0, LOOP_STEPS, body, (tokens, cache))

    return run


def profile_calls(target, draft, draft_spec, capacity: int, verify_widths, draft_widths, *,
                  context: int | None = None) -> list[tuple]:
    """The (fn, *args) calls `measure_profile` times, for `time_all`: a plain decoding step, the verify forward at
    each of `verify_widths`, a draft forward at each of `draft_widths`, writing after a `context`-token committed
    prefix (default: half the capacity) of a batch-1 cache of `capacity` slots; each call runs `LOOP_STEPS` of
    them in a loop (`_looped`)."""
    context = capacity // 2 if context is None else context
    length, pad = jnp.full((1,), context, jnp.int32), jnp.zeros((1,), jnp.int32)

    def positions_mask(w):
        slots = context + jnp.arange(w, dtype=jnp.int32)[None]
        return slots, Visibility.chain(length, pad, w)  # as the decoding loops pass it

    def verify(target, cache, tokens):
        pos, mask = positions_mask(tokens.shape[1])
        hidden, _ = target.forward(tokens, pos, mask, cache, length, write=False)  # as the verify step runs it
        return jnp.argmax(target.head(hidden), -1).astype(jnp.int32), cache

    def ar_step(target, cache, tokens):  # a plain decoding step writes its one token into the cache
        pos, mask = positions_mask(1)
        hidden, cache = target.forward(tokens, pos, mask, cache, length)
        return jnp.argmax(target.head(hidden), -1).astype(jnp.int32), cache

    def run_draft(target, draft, cache, tokens):
        drafter = build_drafter(draft_spec, target, draft)
        pos, mask = positions_mask(tokens.shape[1])
        feats = jnp.zeros(tokens.shape + (drafter.feature_dim,), jnp.float32)
        logq, _, cache = drafter(tokens, feats, pos, mask, cache, length)
        return jax.lax.top_k(logq, 10)[1][..., 0].astype(jnp.int32), cache

    t_cache = target.init_cache(1, capacity)
    d_cache = build_drafter(draft_spec, target, draft).init_cache(1, capacity)
    tok = lambda w: jnp.full((1, w), 100, jnp.int32)  # noqa: E731
    ar_fn, verify_fn, draft_fn = _looped(ar_step), _looped(verify), _looped(run_draft)
    return ([(ar_fn, target, t_cache, tok(1))] + [(verify_fn, target, t_cache, tok(w)) for w in verify_widths]
            + [(draft_fn, target, draft, d_cache, tok(w)) for w in draft_widths])


def measure_profile(target, draft, draft_spec, capacity: int, verify_widths, draft_widths, *,
                    context: int | None = None, repeats: int = 5) -> CostProfile:
    """Times the target (serving-form `LM`) and the draft (`LM`, `EagleWeights` or None for a self-draft, built
    by `drafters.build_drafter(draft_spec, ...)`) at each width (`profile_calls`; ms per step)."""
    ms = [m / LOOP_STEPS for m in time_all(profile_calls(target, draft, draft_spec, capacity, verify_widths,
                                                         draft_widths, context=context), repeats=repeats)]
    ar, v_ms, d_ms = ms[0], ms[1: 1 + len(verify_widths)], ms[1 + len(verify_widths):]
    return CostProfile(device=jax.devices()[0].device_kind, verify_widths=list(verify_widths), verify_ms=v_ms,
                       draft_widths=list(draft_widths), draft_ms=d_ms, ar_ms=ar)


def _profile_path(key: str, directory: str) -> str:
    return os.path.join(directory, hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


def has_profile(key: str, directory: str) -> bool:
    """Whether a profile is stored under `key` in `directory` (`cached_profile` then measures nothing); in a
    multi-host run, process 0's answer."""
    return bool(sharding.from_primary(os.path.isfile(_profile_path(key, directory))))


def cached_profile(key: str, measure, directory: str) -> CostProfile:
    """The profile stored under `key` (device, models and widths) in `directory`, measured by `measure()` on
    first use.

    In a multi-host run every process uses process 0's profile (its stored one, or else the one it measures while
    every process measures alongside): budgets chosen from it then agree, and so do the programs the hosts run."""
    path = _profile_path(key, directory)
    stored = None
    if os.path.isfile(path):
        with open(path) as f:
            stored = json.load(f)["profile"]
    stored = sharding.from_primary(stored)
    if stored is not None:
        return CostProfile(**stored)
    prof = CostProfile(**sharding.from_primary(measure().to_json()))
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = path + f".tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"key": key, "profile": prof.to_json()}, f)
        os.replace(tmp, path)
    except OSError:  # an unwritable cache only costs a re-measure next time
        pass
    return prof


# Bumped whenever the model code's cost curve changes, so no cached profile outlives it (3: feature-major layers;
# 4: the verify forward reads the cache and returns the new keys/values; widths timed in interleaved rounds;
# 5: the skinny CPU matmul kernel and the width-4 verify bucket; 6: steps timed in a loop, `LOOP_STEPS`; 7: the
# kernel prefetches its weight stream, which made 2-4 columns cost about one, and takes up to 12 columns).
PROFILE_VERSION = 7


def profile_key(target_cfg, draft_desc: str, capacity: int, verify_widths, draft_widths) -> str:
    dev = jax.devices()[0]
    return json.dumps({"version": PROFILE_VERSION, "device": dev.device_kind, "platform": dev.platform,
                       "target": repr(target_cfg), "draft": draft_desc, "capacity": capacity,
                       "verify": list(verify_widths), "draft_widths": list(draft_widths)}, sort_keys=True)


def parse(text: str) -> str | tuple[int, int] | None:
    """A budget as a user writes it: "auto", "static" (the policy's full sizes: None) or "NODES,DEPTH" (both >= 1).
    ValueError otherwise."""
    if text in ("auto", "static"):
        return None if text == "static" else "auto"
    try:
        n, d = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"a budget is auto, static or NODES,DEPTH, got {text!r}") from None
    if n < 1 or d < 1:
        raise ValueError(f"a budget needs NODES >= 1 and DEPTH >= 1, got {text!r}")
    return n, d


@dataclasses.dataclass
class AcceptanceStats:
    """How one policy's trees were accepted, summed over requests (device-independent).

    Attributes: n_max, d_cap: the policy's static sizes; accepted / offered: per priority rank, accepted nodes and
    steps whose budget offered that rank; accepted_depth: [rank, depth] the accepted nodes by their depth as well
    (`Stats.accepted_depth`; zeros in a prior written before it was counted); depth_hist: how many steps accepted
    exactly τ = d tokens (each request's first row while it decoded: `Stats.tau_trace`); levels / steps: draft
    levels run and steps; requests: requests added; retrieval_nodes / retrieval_accepted: the nodes retrieval
    chains added and the tokens accepted on them (over the same row-steps as `offered[1]`).
    """

    n_max: int
    d_cap: int
    accepted: np.ndarray = None
    offered: np.ndarray = None
    accepted_depth: np.ndarray = None
    depth_hist: np.ndarray = None
    levels: float = 0.0
    steps: int = 0
    requests: int = 0
    retrieval_nodes: float = 0.0
    retrieval_accepted: float = 0.0

    def __post_init__(self):
        self.accepted = np.zeros(self.n_max + 1) if self.accepted is None else np.asarray(self.accepted, float)
        self.offered = np.zeros(self.n_max + 1) if self.offered is None else np.asarray(self.offered, float)
        self.accepted_depth = (np.zeros((self.n_max + 1, self.d_cap + 1)) if self.accepted_depth is None
                               else np.asarray(self.accepted_depth, float))
        self.depth_hist = np.zeros(self.d_cap + 1) if self.depth_hist is None else np.asarray(self.depth_hist, float)

    def update(self, stats) -> None:
        """Adds one `engine.Stats` (its budget, accepted_at, tau_trace, draft forwards). `accepted_at` counts over a
        batch's rows, so every row's step offered the budget's ranks (`row_steps`)."""
        n_b, _ = stats.budget
        if n_b == 0:  # the chains alone were verified (`BudgetChooser.chains`): nothing about the draft's ranks
            return
        accepted = np.asarray(stats.accepted_at[: self.n_max + 1], float)  # shorter from a fitted policy
        self.accepted[: len(accepted)] += accepted
        by_depth = np.asarray(getattr(stats, "accepted_depth", None) or [[]], float)
        by_depth = by_depth[: self.n_max + 1, : self.d_cap + 1]  # smaller from a fitted policy
        self.accepted_depth[: by_depth.shape[0], : by_depth.shape[1]] += by_depth
        self.offered[1: n_b + 1] += stats.row_steps
        for t in stats.tau_trace:
            self.depth_hist[min(int(t), self.d_cap)] += 1
        self.levels += max(0, stats.draft_forwards - 1 - stats.steps)  # minus prefill and catch-ups
        self.steps += stats.steps
        self.requests += 1
        self.retrieval_nodes += stats.retrieval_nodes
        self.retrieval_accepted += stats.retrieval_accepted

    def add(self, other: AcceptanceStats) -> None:
        """Adds another record of the same policy sizes (e.g. a prior measured on held-out prompts)."""
        if (other.n_max, other.d_cap) != (self.n_max, self.d_cap):
            raise ValueError(f"statistics of a policy with n_max={other.n_max}, d_cap={other.d_cap} do not fit "
                             f"n_max={self.n_max}, d_cap={self.d_cap}")
        self.accepted += other.accepted
        self.offered += other.offered
        self.accepted_depth += other.accepted_depth
        self.depth_hist += other.depth_hist
        self.levels += other.levels
        self.steps += other.steps
        self.requests += other.requests
        self.retrieval_nodes += other.retrieval_nodes
        self.retrieval_accepted += other.retrieval_accepted

    def expected_tau(self, n: int, d: int) -> float:
        """E[τ] of a tree cut to `n` nodes and depth `d`.

        Where every accepted node was counted by its depth too (`accepted_depth`), exactly: the sum over the top
        `n` priority ranks of how often the node of that rank was accepted at a depth of at most `d`. A level-built
        tree (SAGE, static, chain) ranks its nodes level by level, so the cut's nodes are the unbudgeted tree's
        first `n` less those deeper than `d`, and the ones it keeps are accepted exactly as often as before.
        Otherwise (a prior written before depths were counted) the lesser of what the top `n` ranks accepted
        (Σ p_rank) and what the trees accepted within depth `d` (E[min(τ, d)]): an upper bound, exact where one cut
        does not bind, which takes a wide shallow cut for as good as the full tree's first `n` nodes."""
        p = np.divide(self.accepted, self.offered, out=np.zeros_like(self.accepted), where=self.offered > 0)
        e_n = float(np.sum(p[1: n + 1]))
        if self.accepted.sum() > 0 and np.allclose(self.accepted_depth.sum(1), self.accepted):
            kept = self.accepted_depth[1: n + 1, : d + 1].sum(1)
            return float(np.sum(np.divide(kept, self.offered[1: n + 1], out=np.zeros_like(kept),
                                          where=self.offered[1: n + 1] > 0)))
        tot = self.depth_hist.sum()
        if tot == 0:
            return e_n
        at_least = np.cumsum(self.depth_hist[::-1])[::-1] / tot  # P(τ >= d)
        return min(e_n, float(np.sum(at_least[1: d + 1])))

    def retrieval_per_step(self) -> tuple[float, float]:
        """(nodes, accepted tokens) that retrieval chains add per row-step. Measured under the budgets the
        requests ran at (a smaller tree shares fewer of a chain's tokens), which the chooser takes as given."""
        rows = self.offered[1] if self.offered.size > 1 else 0.0
        if rows <= 0:
            return 0.0, 0.0
        return self.retrieval_nodes / rows, self.retrieval_accepted / rows

    def to_json(self) -> dict:
        return {"n_max": self.n_max, "d_cap": self.d_cap, "accepted": self.accepted.tolist(),
                "offered": self.offered.tolist(), "accepted_depth": self.accepted_depth.tolist(),
                "depth_hist": self.depth_hist.tolist(), "levels": self.levels,
                "steps": self.steps, "requests": self.requests, "retrieval_nodes": self.retrieval_nodes,
                "retrieval_accepted": self.retrieval_accepted}

    @classmethod
    def from_json(cls, d: dict) -> AcceptanceStats:
        return cls(**d)


@dataclasses.dataclass
class BudgetChooser:
    """Chooses (node budget N, depth cap D) maximising (E[τ] + 1) / step cost from running statistics.

    Attributes: profile; n_max, d_cap: the policy's static sizes; frontier: its draft width per level;
    explore_every: every k-th request speculates even when the model says it does not pay (fresh statistics);
    min_gain: the predicted speedup a tree must reach to be chosen over plain decoding (timings on a shared
    machine are noisy by a few percent, and a tree that accepts nothing never pays, whatever the timings say);
    acceptance: the statistics so far (a prior measured elsewhere may seed it, `AcceptanceStats.add`);
    chains: the policy merges retrieval chains, so where no tree pays the chooser verifies them alone (node budget
    0, gated by `TreePolicy.chains_gate`: a closed gate costs one plain decoding step) instead of decoding plainly;
    choices: budgets chosen.
    """

    profile: CostProfile
    n_max: int
    d_cap: int
    frontier: int
    explore_every: int = 16
    min_gain: float = 1.05
    acceptance: AcceptanceStats = None
    chains: bool = False
    choices: int = 0

    def __post_init__(self):
        self.acceptance = self.acceptance or AcceptanceStats(self.n_max, self.d_cap)

    def update(self, stats) -> None:
        """Adds one `engine.Stats` to the acceptance statistics."""
        self.acceptance.update(stats)

    def expected_tau(self, n: int, d: int) -> float:
        """E[τ] of the draft's tree cut to (n, d), plus what retrieval chains were seen to add."""
        return self.acceptance.expected_tau(n, d) + self.acceptance.retrieval_per_step()[1]

    def step_cost(self, n: int, d: int) -> float:
        a = self.acceptance
        mean_levels = a.levels / a.steps if a.steps else d - 1
        levels = min(d - 1, mean_levels)
        width = min(self.frontier, n)
        chain_nodes = a.retrieval_per_step()[0]  # the verify forward also carries the chains' own nodes
        return (self.profile.draft_cost(2) + levels * self.profile.draft_cost(width)
                + self.profile.verify_cost(n + round(chain_nodes)))

    def candidates(self) -> list[tuple[int, int]]:
        ns = sorted({min(w - 1, self.n_max) for w in self.profile.verify_widths if w >= 2} | {self.n_max})
        return [(n, d) for n in ns for d in range(1, self.d_cap + 1)]

    def speedup(self, n: int, d: int) -> float:
        """Model speedup over autoregressive decoding (one verify-width-1 forward per token)."""
        ar = self.profile.ar_ms or self.profile.verify_ms[0]
        return (self.expected_tau(n, d) + 1.0) * ar / self.step_cost(n, d)

    def best(self) -> tuple[int, int]:
        return max(self.candidates(), key=lambda nd: (self.speedup(*nd), -nd[0], -nd[1]))

    def choose(self) -> tuple[int, int] | None:
        """(N, D) for the next request; where no tree is predicted to beat plain decoding on this device, (0,
        d_cap) with `chains` (the chains verified alone), else None (the caller then decodes autoregressively).
        Without statistics: the full budget. Every
        `explore_every`-th request speculates at the best budget even when it does not pay, so that the
        acceptance statistics (and with them the choice) can recover."""
        self.choices += 1
        if self.acceptance.steps == 0:
            return self.n_max, self.d_cap
        nd = self.best()
        pays = self.expected_tau(*nd) > 0 and self.speedup(*nd) >= self.min_gain
        if pays or (self.explore_every and self.choices % self.explore_every == 0):
            return nd
        return (0, self.d_cap) if self.chains else None
