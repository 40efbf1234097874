"""`sage_jax.bench.tree_view`: a prompt's speculative trees step by step are the compiled loop's own steps, each
accepted path (+ bonus) is the target's greedy continuation, and the picture marks exactly that path."""

import io

import numpy as np
import pytest
from matplotlib.colors import to_rgba

from sage_jax.bench import tree_view
from sage_jax.decoding.drafters import DraftSpec
from sage_jax.decoding.policies import TreePolicy
from sage_jax.engine import Engine

POLICY = TreePolicy.sage(n_max=16, frontier=4)
PROMPT = [3, 4, 5, 6, 8]
NEW = 24


@pytest.fixture(scope="module")
def engine(tiny_lm):
    # A self-draft (the target's first 2 of 3 layers) agrees with the target often, but not always.
    return Engine(tiny_lm(0, vocab_size=64, n_layers=3, eos_token_ids=(7,)), draft_spec=DraftSpec(kind="self",
                                                                                                  n_layers=2))


@pytest.fixture(scope="module")
def trees(engine):
    return tree_view.step_trees(engine, PROMPT, policy=POLICY, max_new_tokens=NEW)


@pytest.mark.integration
def test_steps_are_the_loops_and_the_accepted_tokens_are_the_targets_greedy_ones(engine, trees):
    ar = engine.generate([PROMPT], policy="ar", max_new_tokens=NEW).token_ids[0]
    gen = engine.generate([PROMPT], policy=POLICY, max_new_tokens=NEW)
    st = gen.stats
    assert len(trees) == st.steps
    # A tree's τ is what the target accepted; Stats counts what was committed, less at the last step when the token
    # limit (or EOS) cuts the path.
    assert [t.tau for t in trees][:-1] == st.tau_trace[:-1] and trees[-1].tau >= st.tau_trace[-1]
    assert sum(st.tau_trace) + st.steps + 1 == len(gen.token_ids[0])  # committed: path + bonus a step, + prefill's
    assert [t.n_nodes for t in trees] == st.nodes_trace
    assert [t.max_depth for t in trees] == st.depth_trace
    np.testing.assert_allclose([t.alpha for t in trees], st.alpha_trace, rtol=1e-5, atol=1e-6)
    # The root of the first step is the prefill's token; then every step commits its path and the bonus token.
    out = [int(trees[0].tokens[0])] + [x for t in trees for x in t.new_tokens]
    assert out[: len(ar)] == ar == gen.token_ids[0]
    assert sum(t.tau for t in trees) > 0 and any(t.n_nodes > t.tau for t in trees), "accepted and rejected nodes"
    for t in trees:
        assert t.parent[0] == -1 and all(t.depth[t.parent[i]] == t.depth[i] - 1 for i in range(1, len(t.tokens)))
        assert t.path[0] == 0 and all(t.parent[b] == a for a, b in zip(t.path[:-1], t.path[1:]))
        # Where the path stops, the target wanted the bonus token and no child of the last node holds it.
        assert t.bonus not in t.tokens[t.parent == t.path[-1]]
        assert t.accepted.sum() == t.tau + 1 and len(t.labels) == len(t.tokens) and t.labels[0] == str(t.tokens[0])


@pytest.mark.integration
def test_first_steps_and_a_budget(engine, trees):
    two = tree_view.step_trees(engine, PROMPT, policy=POLICY, max_new_tokens=NEW, steps=2)
    assert [t.tokens.tolist() for t in two] == [t.tokens.tolist() for t in trees[:2]]
    small = tree_view.step_trees(engine, PROMPT, policy=POLICY, max_new_tokens=NEW, budget=(4, 2), steps=3)
    assert all(t.n_nodes <= 4 and t.max_depth <= 2 for t in small)
    with pytest.raises(ValueError, match="budget"):
        tree_view.step_trees(engine, PROMPT, policy=POLICY, budget=(99, 2))


def test_layout_places_every_node_apart_and_parents_between_their_children():
    parent = np.array([-1, 0, 0, 1, 1, 2])
    y = tree_view.layout(parent, extra_child_of=3)
    depth = np.array([0, 1, 1, 2, 2, 2, 3])  # the extra node is a child of node 3
    assert len(y) == 7 and len({(d, v) for d, v in zip(depth, y)}) == 7
    assert y[0] == np.mean(y[[1, 2]]) and y[1] == np.mean(y[[3, 4]]) and y[3] == y[6]


@pytest.mark.integration
def test_draw_marks_the_accepted_path_and_the_bonus(trees):
    t = max(trees, key=lambda t: (t.tau, t.n_nodes))
    fig = tree_view.draw(t)
    boxes = [tx.get_bbox_patch().get_facecolor() for tx in fig.axes[0].texts if tx.get_bbox_patch() is not None]
    assert len(boxes) == len(t.tokens) + 1  # every node and the bonus token
    count = lambda c: sum(np.allclose(b, to_rgba(c)) for b in boxes)  # noqa: E731
    assert count(tree_view._ACCEPTED) == t.tau and count(tree_view._ROOT) == 1 and count(tree_view._BONUS) == 1
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.tell() > 1000
