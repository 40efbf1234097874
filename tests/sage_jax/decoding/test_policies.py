"""SAGE's admission rule on hand-built frontiers: the width decay (Eq. 12) and both readings of the expansion
threshold θ_l = θ·l/D (sage.md §1.5(3)): the candidate's own draft probability (the paper's prose, our default) or
its path's cumulative probability (the paper's formal statement)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.decoding import policies


def _admit(policy, level, depth, width, parent_local_p, parent_cum_p, child_p):
    """admission() for one row whose frontier has the given parents (all valid) and children's local probs."""
    shape = policies.StepShape(depth=jnp.asarray([depth], jnp.int32), width=jnp.asarray([width], jnp.int32))
    r = len(parent_local_p)
    allowed, prio = policies.admission(
        policy, jnp.asarray(level, jnp.int32), shape, jnp.ones((1, r), bool),
        jnp.asarray([parent_local_p], jnp.float32), jnp.log(jnp.asarray([parent_cum_p], jnp.float32)),
        jnp.log(jnp.asarray([child_p], jnp.float32)))
    return np.asarray(allowed)[0], np.asarray(prio)[0]


def test_default_threshold_is_the_candidates_own_probability():
    assert policies.TreePolicy.sage().threshold_prob == "local"


@pytest.mark.parametrize("reading", ["local", "cumulative"])
def test_threshold_reading(reading):
    # Level 3 of a depth-4 tree: θ_3 = 0.1·3/4 = 0.075. One parent on a path of probability 0.2, its children
    # with own probabilities 0.5, 0.3, 0.1, 0.05: path probabilities 0.1, 0.06, 0.02, 0.01.
    pol = policies.TreePolicy.sage(threshold_prob=reading)
    child = [0.5, 0.3, 0.1, 0.05] + [0.01] * (pol.top_k - 4)
    allowed, prio = _admit(pol, level=3, depth=4, width=10, parent_local_p=[0.9], parent_cum_p=[0.2],
                           child_p=[child])
    # width: floor(10·(0.5 + 0.9)/3) = 4 children may enter at all
    expect = {"local": [True, True, True, False], "cumulative": [True, False, False, False]}[reading]
    np.testing.assert_array_equal(allowed[0], expect + [False] * (pol.top_k - 4))
    np.testing.assert_allclose(prio[0, :4], np.log(0.2 * np.asarray(child[:4])), rtol=1e-6)


def test_width_decay_uses_the_parents_local_probability():
    pol = policies.TreePolicy.sage(theta=0.0)
    child = [[0.3] * 3 + [0.01] * (pol.top_k - 3)] * 2
    allowed, _ = _admit(pol, level=2, depth=5, width=6, parent_local_p=[0.9, 0.1], parent_cum_p=[0.9, 0.1],
                        child_p=child)
    # W_2 = floor(6·(0.5 + p)/2): 4 children for the confident parent, 1 for the other
    assert allowed[0].sum() == math.floor(6 * 1.4 / 2) == 4
    assert allowed[1].sum() == math.floor(6 * 0.6 / 2) == 1
    assert allowed[0, 0] and allowed[1, 0]


def test_level_one_takes_the_full_width_and_depth_stops_admission():
    pol = policies.TreePolicy.sage(theta=0.0)
    child = [[0.2] * pol.top_k]
    allowed, _ = _admit(pol, level=1, depth=3, width=7, parent_local_p=[1.0], parent_cum_p=[1.0], child_p=child)
    assert allowed[0].sum() == 7
    allowed, _ = _admit(pol, level=4, depth=3, width=7, parent_local_p=[1.0], parent_cum_p=[1.0], child_p=child)
    assert not allowed.any()
