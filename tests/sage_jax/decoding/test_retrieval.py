"""Retrieval branches: the n-gram lookup finds the latest longest match and proposes what followed it; the merge
reuses the draft's nodes, appends the rest packed and ancestor-closed; every policy with a retrieval chain stays
lossless; the gate's precision counts the leading run the target confirmed; accepted tokens split exactly into
draft ranks and chain nodes; on a prompt the model copies, the chain is accepted in long runs."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.decoding import retrieval, widths
from sage_jax.decoding.drafters import DraftSpec
from sage_jax.decoding.policies import TreePolicy
from sage_jax.decoding.tree import Tree
from sage_jax.engine import Engine


def test_lookup_takes_the_latest_longest_match():
    #            0  1  2  3  4  5  6  7  8  9 10 11
    h = np.array([[0, 0, 5, 6, 7, 8, 5, 6, 9, 1, 5, 6],    # "5 6" twice before the end: the later (6-7) wins
                  [4, 7, 8, 9, 4, 7, 2, 3, 7, 8, 0, 0]])   # the 2-gram "7 8" at 1-2 beats "8" alone; end at 9
    valid = np.ones_like(h, bool)
    valid[0, :2] = False  # left padding
    end = np.array([11, 9])
    tokens, n = retrieval.lookup(jnp.asarray(h), jnp.asarray(valid), jnp.asarray(end), 4)
    assert np.asarray(n).tolist() == [4, 4]
    assert np.asarray(tokens)[0].tolist() == [9, 1, 5, 6]  # after "5 6" at 6-7: up to the end, no further
    assert np.asarray(tokens)[1].tolist() == [9, 4, 7, 2]
    tokens, n = retrieval.lookup(jnp.asarray(h), jnp.asarray(valid), jnp.asarray([3, 2]), 3)
    # row 0: "6" at slot 3 occurs nowhere earlier (slots 0-1 are padding); row 1: "8" occurs nowhere earlier
    assert np.asarray(n).tolist() == [0, 0]


def test_lookup_stops_at_the_newest_token():
    h = jnp.asarray([[1, 2, 3, 1, 2]])
    tokens, n = retrieval.lookup(h, jnp.ones_like(h, bool), jnp.asarray([4]), 5)
    assert int(n[0]) == 3 and np.asarray(tokens)[0, :3].tolist() == [3, 1, 2]


def _tree():
    """root(10) -> a(11) -> b(12); root -> c(13): 4 valid of 5 slots."""
    tokens = jnp.asarray([[10, 11, 13, 12, 0]])
    parent = jnp.asarray([[-1, 0, 0, 1, -1]])
    depth = jnp.asarray([[0, 1, 1, 2, 0]])
    valid = jnp.asarray([[True, True, True, True, False]])
    anc = np.zeros((1, 5, 5), bool)
    for i, chain in enumerate([[0], [0, 1], [0, 2], [0, 1, 3]]):
        anc[0, i, chain] = True
    return Tree(tokens=tokens, parent=parent, depth=depth, logp=jnp.zeros((1, 5)), valid=valid,
                ancestors=jnp.asarray(anc))


def test_merge_reuses_nodes_and_appends_the_rest():
    tree = retrieval.widen(_tree(), 3)
    out = retrieval.merge(tree, jnp.asarray([[11, 12, 14, 15]]), jnp.asarray([3]))  # a, b reused; 14 is new
    valid = np.asarray(out.valid)[0]
    assert valid.tolist() == [True] * 5 + [False] * 3  # packed: one new node at slot 4
    assert int(out.tokens[0, 4]) == 14 and int(out.parent[0, 4]) == 3 and int(out.depth[0, 4]) == 3
    assert np.flatnonzero(np.asarray(out.ancestors)[0, 4]).tolist() == [0, 1, 3, 4]
    out = retrieval.merge(tree, jnp.asarray([[13, 9, 9, 9]]), jnp.asarray([4]))  # under c: three new nodes
    assert np.asarray(out.tokens)[0, 4:7].tolist() == [9, 9, 9]
    assert np.asarray(out.parent)[0, 4:7].tolist() == [2, 4, 5]
    assert np.asarray(out.valid)[0].sum() == 7
    out = retrieval.merge(tree, jnp.asarray([[13, 9, 9, 9]]), jnp.asarray([0]))  # no candidates: unchanged
    assert np.asarray(out.valid)[0].sum() == 4


def test_merge_stops_where_a_new_node_would_pass_the_limit():
    tree = retrieval.widen(_tree(), 3)
    # a, b reused (free), then 14 needs slot 4 (the 5th node: allowed at limit 5), 15 would be the 6th: dropped
    out = retrieval.merge(tree, jnp.asarray([[11, 12, 14, 15]]), jnp.asarray([4]), jnp.asarray([5]))
    assert np.asarray(out.valid)[0].sum() == 5 and int(out.tokens[0, 4]) == 14
    # under c: 9 is new at the limit already, so neither it nor what follows it is merged
    out = retrieval.merge(tree, jnp.asarray([[13, 9, 9, 9]]), jnp.asarray([4]), jnp.asarray([4]))
    assert np.asarray(out.valid)[0].sum() == 4


def test_chain_limit_keeps_the_verify_width_bucket():
    """The chains fill a tree up to the verify width that holds the draft's tree or the root and one whole chain,
    whichever is wider: never into the next bucket (widths 1, 2, 4, 8, 32, 72 for SAGE with a 7-token chain)."""
    from sage_jax.decoding import speculative

    pol = TreePolicy.sage(retrieval=7)
    cfg = speculative.SpecConfig(policy=pol, prompt_len=16, max_new_tokens=8)
    assert widths.verify_sizes(pol.tree_size, 4, 7) == (1, 2, 4, 8, 32, pol.tree_size)
    got = speculative.chain_limit(cfg, pol.tree_size, jnp.asarray([1, 2, 4, 8, 9, 20, 40]))
    assert np.asarray(got).tolist() == [8, 8, 8, 8, 32, 32, pol.tree_size]
    flat = speculative.chain_limit(dataclasses.replace(cfg, bucket_ratio=1), pol.tree_size, jnp.asarray([4]))
    assert int(flat[0]) == pol.tree_size  # without bucketing every width costs the same: no limit


def test_precision_counts_the_leading_confirmed_run():
    cand = jnp.asarray([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    n_cand = jnp.asarray([4, 4, 2, 0])
    committed = jnp.asarray([[5, 6, 9, 0, 0], [5, 6, 7, 8, 9], [5, 9, 0, 0, 0], [1, 2, 0, 0, 0]])
    n_committed = jnp.asarray([3, 5, 2, 2])
    prec, checked = retrieval.precision(cand, n_cand, committed, n_committed)
    # 2 of 3 checkable; all 4; 1 of 2 (the run stops at the first miss); nothing proposed: nothing to check
    np.testing.assert_allclose(np.asarray(prec), [2 / 3, 1.0, 0.5, 0.0])
    assert np.asarray(checked).tolist() == [3, 4, 2, 0]
    # one checked token moves the running precision 30% of the way, four 76%, none not at all
    score = retrieval.update_precision(jnp.full((3,), 0.2), jnp.ones((3,)), jnp.asarray([1, 4, 0]))
    np.testing.assert_allclose(np.asarray(score), [0.2 + 0.3 * 0.8, 0.2 + (1 - 0.7**4) * 0.8, 0.2], rtol=1e-6)
    assert float(score[0]) < 0.5 <= float(score[1])  # a lucky single token keeps the gate shut; a run opens it


@pytest.fixture(scope="module")
def engine(tiny_lm):
    return Engine(tiny_lm(0, vocab_size=64, n_layers=2, eos_token_ids=()),
                  draft_spec=DraftSpec(kind="self", n_layers=1))


@pytest.mark.integration
def test_every_policy_with_retrieval_matches_ar(engine):
    prompts = [[3, 4, 5, 6, 7, 8, 3, 4, 5], [9, 10, 11, 12, 9, 10]]
    ref = engine.generate(prompts, policy="ar", max_new_tokens=40).token_ids
    # EAGLE-2 (its tree is reranked out of a larger pool) and SAGE; static runs in the T > 0 test
    for policy in (TreePolicy.eagle2(n_max=8, depth=4, top_k=4, retrieval=4),
                   TreePolicy.sage(n_max=16, frontier=4, retrieval=6)):
        assert engine.generate(prompts, policy=policy, max_new_tokens=40).token_ids == ref, policy.name


@pytest.mark.integration
def test_gate_and_accounting(engine):
    """Whatever the gate, the output is AR's; a stricter gate merges no more chains; every accepted token sat
    either on a ranked draft node or on a chain's own node (the budget chooser's two statistics)."""
    prompts = [[3, 4, 5, 6, 7, 8, 3, 4, 5, 6, 7], [9, 10, 11, 12, 9, 10, 11]]
    ref = engine.generate(prompts, policy="ar", max_new_tokens=40).token_ids
    merged = []
    policies = [TreePolicy.sage(n_max=16, frontier=4, retrieval=6, retrieval_gate=g) for g in (0.0, 1.0)]
    for policy in [*policies, TreePolicy.eagle2(n_max=8, depth=4, top_k=4, retrieval=4)]:  # EAGLE-2: ranked by logp
        out = engine.generate(prompts, policy=policy, max_new_tokens=40)
        st = out.stats
        assert out.token_ids == ref, policy
        assert sum(st.accepted_at) + st.retrieval_accepted == round(st.mean_accepted * st.row_steps), policy.name
        assert st.retrieval_nodes >= st.retrieval_accepted and st.retrieval_steps <= st.row_steps
        merged.append(st.retrieval_steps)
    assert 0 < merged[1] <= merged[0]
    with pytest.raises(ValueError, match="retrieval_gate"):
        TreePolicy.sage(retrieval=4, retrieval_gate=1.5)


@pytest.mark.integration
def test_chains_alone_are_gated_down_to_the_root(engine):
    """Node budget 0 verifies the chains alone; `chains_gate` holds a row's chain back while its precision is low,
    and the step then verifies the root alone at width 1 (a plain decoding step), never the 2-row bucket. Every
    gate gives AR's output; an open gate (0) merges a chain at every step that finds one."""
    prompts = [[3, 4, 5, 6, 7, 8, 3, 4, 5], [9, 10, 11, 12, 9, 10]]
    ref = engine.generate(prompts, policy="ar", max_new_tokens=40).token_ids
    assert widths.verify_sizes(1 + 16 + 6, 4, 6) == (1, 2, 4, 8, 23)
    runs = {}
    for gate in (0.0, 1.0):
        policy = TreePolicy.sage(n_max=16, frontier=4, retrieval=6, chains_gate=gate)
        out = engine.generate(prompts, policy=policy, max_new_tokens=40, budget=(0, policy.d_cap))
        assert out.token_ids == ref, gate
        runs[gate] = out.stats
    shut, open_ = runs[1.0], runs[0.0]
    # Gate 1: the chains start trusted (precision 1) and close at their first imperfect check, for good.
    assert shut.retrieval_steps < open_.retrieval_steps and shut.retrieval_steps < shut.row_steps
    # Each step's verify width: 1 where the chain was held back, so the widths sum to fewer than 2 per step.
    assert shut.verify_width < 2 * shut.steps <= open_.verify_width
    with pytest.raises(ValueError, match="chains_gate"):
        TreePolicy.sage(retrieval=4, chains_gate=-0.1)


@pytest.mark.slow
def test_copying_prompts_accept_long_runs_on_smollm2(cache_dir):
    """The real SmolLM2-135M-Instruct asked to repeat a passage: SAGE with an 8-token retrieval chain accepts
    long runs (τ+1 ≥ 3; 7.8 measured on 2026-12-01, against 1.2 without it), identical to AR."""
    import sage_jax

    engine = sage_jax.load_engine()
    text = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly "
            "quick daft zebras jump. The five boxing wizards jump quickly.")
    ids = engine.encode(f"Repeat the following text exactly, word for word:\n\n{text}")
    ref = engine.generate([ids], policy="ar", max_new_tokens=48)
    out = engine.generate([ids], policy=TreePolicy.sage(retrieval=8), max_new_tokens=48)
    assert out.token_ids == ref.token_ids
    assert out.stats.mean_tokens_per_step >= 3.0
