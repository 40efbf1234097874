"""Tree structure and masks: a chain verified under the tree mask equals causal attention; property tests
(hypothesis) on trees built by every policy and on both verification rules."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sage_jax.decoding import policies, verify
from sage_jax.decoding import tree as tree_lib
from sage_jax.decoding.drafters import DraftSpec, build_drafter
from sage_jax.decoding.sampling import SamplingConfig, processed_logprobs
from sage_jax.decoding.tree import causal_visibility
from sage_jax.decoding.tree_builder import build_tree

V, CAP, LENGTH = 32, 160, 9


def test_chain_tree_mask_equals_causal(tiny_lm):
    model = tiny_lm(0, vocab_size=V).serving()
    prompt = jnp.asarray([[3, 4, 5, 6, 7, 8, 9, 10, 11]])
    chain = jnp.asarray([[12, 13, 14, 15, 16]])  # root + 4 nodes, each the child of the previous
    pad = jnp.zeros((1,), jnp.int32)
    cache = model.init_cache(1, CAP)
    fwd = jax.jit(lambda m, *a: m.forward(*a))  # eager, op by op, this test took 24 s on 2 cores
    _, cache = fwd(model, prompt, jnp.arange(9)[None], causal_visibility(jnp.arange(9)[None], pad, CAP), cache, pad)
    n = chain.shape[1]
    t = tree_lib.Tree(tokens=chain, parent=jnp.asarray([[-1, 0, 1, 2, 3]]), depth=jnp.arange(n)[None],
                      logp=jnp.zeros((1, n)), valid=jnp.ones((1, n), bool),
                      ancestors=jnp.tril(jnp.ones((n, n), bool))[None])
    start = jnp.asarray([LENGTH])
    h_tree, _ = fwd(model, chain, start[:, None] + t.depth, t.attention_mask(start, pad, CAP), cache, start)
    full = jnp.concatenate([prompt, chain], 1)
    h_causal, _ = fwd(model, full, jnp.arange(14)[None], causal_visibility(jnp.arange(14)[None], pad, 14))
    np.testing.assert_allclose(model.head(h_tree), model.head(h_causal[:, 9:]), rtol=1e-5, atol=1e-5)


POLICY_CASES = {
    "chain": policies.TreePolicy.chain(4),
    "static": policies.TreePolicy.static(),
    "eagle2": policies.TreePolicy.eagle2(n_max=20, depth=4, top_k=5),
    "sage": policies.TreePolicy.sage(n_max=24, frontier=6, d_cap=6, d_max=5),
}


@functools.cache
def _builder(name):
    policy = POLICY_CASES[name]

    @jax.jit
    def build(draft, root, root_logits, alpha, d_max, target_logits, key):
        drafter = build_drafter(DraftSpec(kind="model"), draft, draft)
        cache = drafter.init_cache(root.shape[0], CAP)
        root_logq = jax.nn.log_softmax(root_logits, -1)
        shape = policies.step_shape(policy, alpha, d_max)
        length, pad = jnp.full(root.shape, LENGTH), jnp.zeros(root.shape, jnp.int32)
        feat = jnp.zeros(root.shape + (0,))
        t, _, _, _, _ = build_tree(policy, drafter, cache, root, root_logq, alpha, feat, shape, length, pad)
        g = verify.accept_greedy(t, target_logits, policy.d_cap)
        logp = processed_logprobs(target_logits, jnp.ones(root.shape), SamplingConfig(top_k=3))
        s = verify.accept_sampled(key, t, logp, policy.d_cap)
        return t, shape, g, s, logp

    return build


@pytest.fixture(scope="module")
def draft(tiny_lm):
    return tiny_lm(3, vocab_size=V, n_layers=1).serving()


@pytest.mark.parametrize("name", sorted(POLICY_CASES))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), alpha=st.floats(0.0, 1.0), d_max=st.integers(4, 5),
       sharp=st.floats(0.5, 8.0))
def test_random_trees_are_well_formed_and_verification_is_sound(draft, name, seed, alpha, d_max, sharp):
    policy = POLICY_CASES[name]
    rng = np.random.default_rng(seed)
    b, w1 = 3, policy.n_max + 1
    root = jnp.asarray(rng.integers(0, V, b), jnp.int32)
    root_logits = jnp.asarray(rng.normal(size=(b, V)) * sharp, jnp.float32)
    target_logits = jnp.asarray(rng.normal(size=(b, w1, V)) * sharp, jnp.float32)
    t, shape, (path, tau, bonus), (s_path, s_tau, s_bonus), logp = _builder(name)(
        draft, root, root_logits, jnp.full((b,), alpha, jnp.float32), jnp.full((b,), d_max, jnp.int32),
        target_logits, jax.random.key(seed))
    tok, par, dep, val, anc = map(np.asarray, (t.tokens, t.parent, t.depth, t.valid, t.ancestors))
    best = np.asarray(jnp.argmax(target_logits, -1))
    for r in range(b):
        assert val[r, 0] and par[r, 0] == -1 and dep[r, 0] == 0 and tok[r, 0] == int(root[r])
        assert val[r].sum() - 1 <= policy.n_max  # node budget
        for n in np.flatnonzero(val[r])[1:]:
            p = par[r, n]
            assert 0 <= p < n and val[r, p]  # parents first
            assert dep[r, n] == dep[r, p] + 1
            assert dep[r, n] <= int(np.asarray(shape.depth)[r])
            expect = anc[r, p].copy()
            expect[n] = True
            assert (anc[r, n] == expect).all()  # ancestor-closed: own row = parent's row + itself
        for p in np.flatnonzero(val[r]):  # siblings carry distinct tokens
            kids = tok[r, val[r] & (par[r] == p)]
            assert len(set(kids.tolist())) == len(kids)
        assert not anc[r, ~val[r]].any() and not anc[r][:, ~val[r]].any()
        # Greedy: every accepted token is the target's argmax at its parent, the bonus at the last node, and the
        # path cannot be extended (no child of the last node matches).
        tr, pr = int(tau[r]), np.asarray(path)[r]
        for d in range(1, tr + 1):
            assert tok[r, pr[d]] == best[r, pr[d - 1]] and par[r, pr[d]] == pr[d - 1]
        last = pr[tr]
        assert int(bonus[r]) == best[r, last]
        assert not (val[r] & (par[r] == last) & (tok[r] == best[r, last])).any()
        # Sampled: never accepts (nor emits) a token the processed target distribution gives zero probability.
        lp, sp = np.asarray(logp)[r], np.asarray(s_path)[r]
        for d in range(1, int(s_tau[r]) + 1):
            assert par[r, sp[d]] == sp[d - 1] and np.isfinite(lp[sp[d - 1], tok[r, sp[d]]])
        assert np.isfinite(lp[sp[int(s_tau[r])], int(s_bonus[r])])
