"""Hardware-aware budgets: the chooser's speedup model, the profile cache, and budgets as arrays (no
recompiles; a budget cuts the tree to its first N nodes; output still equals AR)."""

import dataclasses

import numpy as np
import pytest

from sage_jax.decoding import budget, widths
from sage_jax.decoding.drafters import DraftSpec
from sage_jax.decoding.policies import TreePolicy
from sage_jax.engine import Engine


def test_widths():
    assert widths.sizes(65, 2) == (2, 8, 32, 65)
    assert widths.sizes(11, 1, 2) == (1, 2, 4, 8, 11)
    assert widths.sizes(16, 1, 1) == (16,)
    # Verify widths add 4 (the skinny CPU kernel's small trees); a retrieval policy's verify also runs the root
    # alone (width 1) and root + one whole chain (L + 1, rounded up to 8 rows).
    assert widths.verify_sizes(65, 4) == (2, 4, 8, 32, 65)
    assert widths.verify_sizes(73, 4, 8) == (1, 2, 4, 8, 16, 32, 73)
    assert widths.verify_sizes(72, 4, 7) == (1, 2, 4, 8, 32, 72)
    assert widths.verify_sizes(12, 4, 3) == (1, 2, 4, 8, 12)
    assert widths.verify_sizes(16, 1, 4) == (16,)  # bucketing off


def _chooser(verify_ms, accept_p, retrieval=(0, 0)):
    """A chooser after 100 steps at the full budget; `retrieval`: (nodes, accepted tokens) of retrieval chains."""
    prof = budget.CostProfile(device="cpu", verify_widths=[2, 8, 32, 65], verify_ms=verify_ms,
                              draft_widths=[1, 4, 16], draft_ms=[1.0, 1.0, 1.0], ar_ms=verify_ms[0] * 0.8)
    ch = budget.BudgetChooser(prof, n_max=64, d_cap=8, frontier=16)
    stats = type("S", (), dict(budget=(64, 8), steps=100, row_steps=100, tau_trace=[], draft_forwards=101 + 100 * 3,
                               accepted_at=[0] + [int(100 * p) for p in accept_p], retrieval_nodes=retrieval[0],
                               retrieval_accepted=retrieval[1]))
    ch.update(stats)
    return ch


def test_expected_tau_is_the_lesser_of_the_rank_and_depth_cuts():
    """100 steps of full trees that accepted τ = 0, 1, 2, 3 in 40 / 30 / 20 / 10 of them, by priority rank 0.6 / 0.25
    / 0.15. A one-node tree accepts rank 1's 0.6 at any depth cap (the rank-1 node is a depth-1 node; the product of
    the two cuts gave 0.36), a depth cap alone gives E[min(τ, d)], the full tree its τ."""
    acc = budget.AcceptanceStats(n_max=8, d_cap=4)
    acc.accepted[1:4] = [60, 25, 15]
    acc.offered[1:] = 100
    acc.depth_hist[:] = [40, 30, 20, 10, 0]
    want = {(1, 1): 0.6, (1, 4): 0.6, (8, 1): 0.6, (2, 2): 0.85, (3, 2): 0.9, (8, 4): 1.0}
    for (n, d), tau in want.items():
        np.testing.assert_allclose(acc.expected_tau(n, d), tau, rtol=1e-9, err_msg=str((n, d)))


def test_expected_tau_counts_the_ranks_a_depth_cap_keeps():
    """Counted by depth as well, a cut keeps the top ranks that sat no deeper than its cap, exactly: over 100 full
    trees rank 1 (a depth-1 node) was accepted 50 times, rank 2 (depth 1) 20, rank 3 5 times as a third depth-1
    sibling and 25 times as a depth-2 child. A 3-node tree capped at depth 1 accepts 0.75, not the 1.0 the two
    cuts' lesser bound gives; a prior without depths keeps that bound."""
    acc = budget.AcceptanceStats(n_max=4, d_cap=3)
    acc.accepted[1:4] = [50, 20, 30]
    acc.offered[1:] = 100
    acc.accepted_depth[1, 1], acc.accepted_depth[2, 1], acc.accepted_depth[3, 1:3] = 50, 20, [5, 25]
    acc.depth_hist[:] = [20, 55, 25, 0]
    want = {(1, 1): 0.5, (2, 1): 0.7, (3, 1): 0.75, (3, 2): 1.0, (4, 3): 1.0}
    back = budget.AcceptanceStats.from_json(acc.to_json())
    for (n, d), tau in want.items():
        np.testing.assert_allclose(back.expected_tau(n, d), tau, rtol=1e-9, err_msg=str((n, d)))
    old = acc.to_json()
    del old["accepted_depth"]  # a prior written before depths were counted
    np.testing.assert_allclose(budget.AcceptanceStats.from_json(old).expected_tau(3, 1), 0.8)  # min(1.0, P(τ ≥ 1))


def test_chooser_follows_the_cost_curve():
    p = [0.6, 0.3, 0.1, 0.05] + [0.02] * 60  # acceptance by priority rank
    flat = _chooser([10.0, 10.0, 10.5, 11.0], p)  # TPU-like: verify cost flat in N
    steep = _chooser([10.0, 25.0, 60.0, 120.0], p)  # this CPU: wide trees cost several single steps
    fresh = budget.BudgetChooser(flat.profile, n_max=64, d_cap=8, frontier=16)
    assert fresh.choose() == (64, 8)  # no statistics yet: the full budget
    assert flat.choose()[0] == 64
    assert steep.speedup(1, 8) > steep.speedup(64, 8)
    assert steep.choose() == steep.best() and steep.best()[0] == 1
    slow = _chooser([10.0, 40.0, 80.0, 160.0], [0.1] + [0.0] * 63)  # nothing pays: plain decoding, except to explore
    picks = [slow.choose() for _ in range(32)]
    assert picks.count(None) >= 28 and all(p == slow.best() for p in picks if p is not None)
    np.testing.assert_allclose(flat.expected_tau(7, 8), sum(p[:7]), rtol=1e-6)
    # Noisy timings can make a tree step look cheaper than a plain one; a tree that accepts nothing still never pays,
    # and one predicted to gain less than `min_gain` does not either.
    noisy = _chooser([1.0, 1.0, 1.0, 1.0], [0.0] * 64)
    noisy.profile.draft_ms, noisy.profile.ar_ms = [0.01] * 3, 2.0
    assert noisy.speedup(*noisy.best()) > 1.0 and noisy.choose() is None
    marginal = _chooser([1.0, 1.0, 1.0, 1.0], [0.01] + [0.0] * 63)
    marginal.profile.draft_ms, marginal.profile.ar_ms = [0.01] * 3, 1.03
    assert 1.0 < marginal.speedup(*marginal.best()) < marginal.min_gain and marginal.choose() is None


def test_chooser_verifies_the_chains_alone_where_no_tree_pays():
    """With retrieval chains, where no tree pays the chooser verifies the chains alone (node budget 0) instead of
    decoding plainly, and such a run adds nothing to the draft's rank statistics."""
    slow = _chooser([10.0, 40.0, 80.0, 160.0], [0.1] + [0.0] * 63)
    slow.chains, slow.explore_every = True, 0
    assert slow.choose() == (0, 8)
    before = slow.acceptance.to_json()
    chains_run = type("S", (), dict(budget=(0, 8), steps=50, row_steps=50, tau_trace=[3] * 50, draft_forwards=1,
                                    accepted_at=[0] * 65, retrieval_nodes=300, retrieval_accepted=120))
    slow.update(chains_run)
    assert slow.acceptance.to_json() == before
    flat = _chooser([10.0, 10.0, 10.5, 11.0], [0.6, 0.3, 0.1, 0.05] + [0.02] * 60)
    flat.chains = True
    assert flat.choose()[0] == 64  # a tree that pays is still chosen


def test_chooser_counts_retrieval_chains():
    """What retrieval chains add per step enters both sides of the model: their accepted tokens E[τ], their nodes
    the verify width (6 chain nodes lift a 1-node tree from the width-2 bucket to width 8)."""
    p = [0.5, 0.2] + [0.0] * 62
    plain = _chooser([10.0, 25.0, 60.0, 120.0], p)
    chained = _chooser([10.0, 25.0, 60.0, 120.0], p, retrieval=(600, 150))
    np.testing.assert_allclose(chained.expected_tau(1, 8) - plain.expected_tau(1, 8), 1.5)
    assert plain.profile.verify_cost(1) == 10.0 and chained.step_cost(1, 8) - plain.step_cost(1, 8) == 15.0
    back = budget.AcceptanceStats.from_json(chained.acceptance.to_json())
    assert back.retrieval_per_step() == (6.0, 1.5)


def test_profile_cache_roundtrip(tmp_path):
    calls = []

    def measure():
        calls.append(1)
        return budget.CostProfile("cpu", [2, 8], [1.0, 2.0], [1], [0.5])

    key = "test-profile-key"
    a = budget.cached_profile(key, measure, str(tmp_path / "profiles"))
    b = budget.cached_profile(key, measure, str(tmp_path / "profiles"))
    assert a == b and len(calls) == 1 and len(list((tmp_path / "profiles").iterdir())) == 1


@pytest.mark.integration
def test_budget_is_an_array_and_cuts_the_tree(tiny_lm, cache_dir):
    target = tiny_lm(0, vocab_size=64, n_layers=2, eos_token_ids=())
    engine = Engine(target, draft_spec=DraftSpec(kind="self", n_layers=1))
    pol = dataclasses.replace(TreePolicy.sage(n_max=16, frontier=4, d_cap=6, d_max=5), history=False)
    prompt = [3, 4, 5, 6]
    ref = engine.generate([prompt], policy="ar", max_new_tokens=24).token_ids
    full = engine.generate([prompt], policy=pol, max_new_tokens=24, alpha_init=1.0)
    compiles = engine.compiles
    # Accepted nodes by rank and depth: one request, so the nodes accepted at depth d are the steps with τ >= d.
    by_depth = np.asarray(full.stats.accepted_depth)
    assert by_depth.shape == (17, 7) and by_depth.sum(1).tolist() == full.stats.accepted_at
    assert by_depth[:, 1:].sum(0).tolist() == [sum(t >= d for t in full.stats.tau_trace) for d in range(1, 7)]
    assert by_depth[:, 1].sum() > 0 and by_depth[:, 2:].sum() > 0
    for n, d in [(1, 6), (3, 2), (16, 6)]:
        g = engine.generate([prompt], policy=pol, max_new_tokens=24, alpha_init=1.0, budget=(n, d))
        assert g.token_ids == ref
        assert max(g.stats.nodes_trace) <= n and max(g.stats.depth_trace) <= d
        assert sum(g.stats.accepted_at[n + 1:]) == 0 and np.sum(np.asarray(g.stats.accepted_depth)[:, d + 1:]) == 0
    assert engine.compiles == compiles
    assert full.stats.budget == (16, 6)
    auto = [engine.generate([prompt], policy=pol, max_new_tokens=24, budget="auto") for _ in range(3)]
    assert all(a.token_ids == ref for a in auto)
    assert auto[0].stats.budget == (16, 6)  # explores first
    assert all(a.stats.budget == (0, 0) or a.stats.budget[0] <= 16 for a in auto[1:])
    assert engine.compiles == compiles
    # Statistics of a batch: every row's step offered the budget, so E[τ] at the full budget is the batch's τ.
    batch = engine.generate([prompt, [9, 10, 11, 12, 13, 14]], policy=pol, max_new_tokens=24, alpha_init=1.0)
    acc = budget.AcceptanceStats(n_max=16, d_cap=6)
    acc.update(batch.stats)
    assert batch.stats.row_steps > batch.stats.steps and batch.stats.mean_accepted > 0
    np.testing.assert_allclose(acc.expected_tau(16, 6), batch.stats.mean_accepted, rtol=1e-9)
    # A prior (a draft's acceptance measured elsewhere) decides the first request instead of an exploring one:
    # with nothing ever accepted, plain decoding (reported under the policy's name).
    never = budget.AcceptanceStats(n_max=16, d_cap=6, depth_hist=[100] + [0] * 6, steps=100, requests=1,
                                   offered=[0] + [100] * 16)
    primed = Engine(target, draft_spec=DraftSpec(kind="self", n_layers=1), acceptance_prior={"sage": never.to_json()})
    first = primed.generate([prompt], policy=pol, max_new_tokens=24, budget="auto")
    assert first.stats.budget == (0, 0) and first.policy == "sage" and first.token_ids == ref
    assert primed.chooser(pol).acceptance.requests == 1  # the prior; a plain request adds no tree statistics


def test_profile_steps_run_in_a_loop_that_feeds_each_step_the_last_ones_tokens():
    """`budget._looped`: `LOOP_STEPS` steps under one jit, the cache carried and each step's tokens the previous
    step's output (a loop-invariant step could be hoisted out and timed once)."""
    import jax.numpy as jnp

    run = budget._looped(lambda m, cache, tok: (tok * 2 + m, cache + 1))
    tok, cache = run(jnp.int32(1), jnp.zeros((2,)), jnp.int32(3))
    n = budget.LOOP_STEPS
    assert int(tok) == 3 * 2**n + (2**n - 1) and np.all(np.asarray(cache) == n)


def test_fitted_policy_and_an_engine_that_compiles_at_the_picked_budget(tiny_lm, cache_dir):
    """`TreePolicy.fitted`: static sizes that just hold a budget; `Engine.fit_budget` (the one-request CLI) runs
    `budget="auto"`'s pick at those sizes: the same output, statistics the chooser can add, one compile per pick."""
    f = TreePolicy.sage().fitted(3, 2)
    assert (f.n_max, f.d_cap, f.d_max, f.d_min, f.frontier) == (3, 2, 2, 2, 3) and f.name == "sage"
    assert TreePolicy.sage(retrieval=7).fitted(1, 1).d_cap == 7  # the chain keeps its length
    static = TreePolicy.static()
    assert static.fitted(3, 2) is static and TreePolicy.sage(retrieval=7).fitted(0, 5).n_max == 64
    target = tiny_lm(0, vocab_size=64, n_layers=2, eos_token_ids=())
    pol = dataclasses.replace(TreePolicy.sage(n_max=16, frontier=4, d_cap=6, d_max=5), history=False)
    engine = Engine(target, draft_spec=DraftSpec(kind="self", n_layers=1))
    engine.fit_budget = True
    prompt = [3, 4, 5, 6]
    ref = engine.generate([prompt], policy="ar", max_new_tokens=24).token_ids
    compiles = engine.compiles
    auto = [engine.generate([prompt], policy=pol, max_new_tokens=24, budget="auto") for _ in range(3)]
    assert all(a.token_ids == ref for a in auto) and auto[0].stats.budget == (16, 6)
    picks = {a.stats.budget for a in auto if a.stats.budget != (0, 0)}
    assert engine.compiles - compiles == 2 * len(picks)  # prefill and loop per pick, none per request
    assert engine.chooser(pol).acceptance.requests == len([a for a in auto if a.stats.budget != (0, 0)])
