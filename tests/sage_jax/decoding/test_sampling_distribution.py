"""Lossless sampling: at temperature 0.7 and 1.0, for every policy, sequences drawn with speculative decoding
follow the target's own distribution, and with top-p the nucleus-truncated one. Exact enumeration of the target's
distribution over all 3-token continuations of a tiny model, a chi-square test on 6,000 independent rows (one batch,
one compile per policy), and negative controls: the same test rejects samples drawn from the draft, and top-p
samples under the untruncated distribution."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from sage_jax.decoding.policies import TreePolicy
from sage_jax.engine import Engine

V, N_NEW, ROWS = 12, 3, 6000
PROMPT = [1, 2, 3]
POLICIES = {
    "chain": TreePolicy.chain(depth=2),
    "static": TreePolicy.static(),
    "eagle2": TreePolicy.eagle2(n_max=8, depth=3, top_k=4),
    "sage": TreePolicy.sage(n_max=12, frontier=4, d_cap=4, d_min=1, d_max=3),
}
# With a prompt-lookup chain (at T = 1 only): over 12 tokens its 1-gram lookups match often, so its nodes are
# really verified.
RETRIEVAL = {"static+retrieval": TreePolicy.static(retrieval=3)}


@pytest.fixture(scope="module")
def pair(tiny_lm):
    """A target and a draft that agrees with it often but not always: the target's weights, perturbed."""
    kw = dict(vocab_size=V, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, mlp_dim=32, eos_token_ids=())
    target, draft = tiny_lm(0, scale=3.0, n_layers=2, **kw), tiny_lm(0, scale=3.0, n_layers=2, **kw)
    params = nnx.state(draft, nnx.Param)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(9), len(leaves))
    noisy = [x * (1 + 0.5 * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys, strict=True)]
    nnx.update(draft, jax.tree.unflatten(tree, noisy))
    return target, draft


def _exact(model, temperature):
    """P(x1, x2, x3 | prompt) for every continuation, from the target's full-sequence logits."""
    seqs = np.array(list(itertools.product(range(V), repeat=N_NEW)), np.int32)
    tokens = jnp.asarray(np.concatenate([np.tile(PROMPT, (len(seqs), 1)), seqs], 1))
    logits, _, _ = model(tokens)
    logp = jax.nn.log_softmax(logits / temperature, -1)
    p0 = len(PROMPT) - 1
    picked = jnp.take_along_axis(logp[:, p0: p0 + N_NEW], tokens[:, p0 + 1:, None], -1)[..., 0]
    probs = np.exp(np.asarray(picked.sum(-1), np.float64))
    return seqs, probs / probs.sum()


def _chi2_pvalue(samples, seqs, probs):
    index = {tuple(s): i for i, s in enumerate(seqs.tolist())}
    counts = np.zeros(len(seqs))
    for s in samples:
        counts[index[tuple(s)]] += 1
    expected = probs * len(samples)
    # Pool every cell expected below 5 into one bin so the chi-square approximation holds.
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    return stats.chisquare(obs, exp).pvalue


@pytest.mark.integration
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_every_policy_samples_the_target_distribution(pair, temperature):
    target, draft = pair
    engine = Engine(target, draft)
    seqs, probs = _exact(target, temperature)
    prompts = [PROMPT] * ROWS
    for name, policy in {**POLICIES, **(RETRIEVAL if temperature == 1.0 else {})}.items():
        out = engine.generate(prompts, policy=policy, max_new_tokens=N_NEW, temperature=temperature, seed=11)
        assert all(len(t) == N_NEW for t in out.token_ids)
        # The tree is really used: committed draft tokens a row-step (a row's last step is cut at the 3-token limit).
        assert out.stats.mean_accepted > 0.03, (name, out.stats.mean_accepted)
        p = _chi2_pvalue(out.token_ids, seqs, probs)
        assert p > 1e-3, (name, temperature, p)


def test_chi_square_rejects_the_draft_distribution(pair):
    """Negative control: samples from the draft alone (plain sampling with the draft as the target) fail."""
    target, draft = pair
    seqs, probs = _exact(target, 1.0)
    out = Engine(draft, draft).generate([PROMPT] * ROWS, policy="ar", max_new_tokens=N_NEW, temperature=1.0, seed=3)
    assert _chi2_pvalue(out.token_ids, seqs, probs) < 1e-6


def _exact_top_p(model, temperature, top_p):
    """P(x1, x2, x3 | prompt) under nucleus sampling, computed in numpy: at each step keep the most likely tokens
    until their mass reaches `top_p` (a token is kept when the mass strictly before it is < top_p), renormalise."""
    seqs = np.array(list(itertools.product(range(V), repeat=N_NEW)), np.int32)
    tokens = jnp.asarray(np.concatenate([np.tile(PROMPT, (len(seqs), 1)), seqs], 1))
    logits, _, _ = model(tokens)
    p = np.asarray(jax.nn.softmax(logits / temperature, -1), np.float64)[:, len(PROMPT) - 1: -1]  # [S, N_NEW, V]
    order = np.argsort(-p, -1, kind="stable")
    sorted_p = np.take_along_axis(p, order, -1)
    keep_sorted = np.cumsum(sorted_p, -1) - sorted_p < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, -1)
    q = np.where(keep, p, 0.0)
    q /= q.sum(-1, keepdims=True)
    probs = np.prod(np.take_along_axis(q, seqs[:, :, None], -1)[..., 0], -1)
    return seqs, probs / probs.sum(), keep.sum(-1)


def test_top_p_samples_the_truncated_target_distribution(pair):
    """`SamplingConfig(top_p)`: plain and SAGE sampling both draw from the nucleus-truncated target distribution
    (oracle in numpy), and that distribution is measurably not the untruncated one."""
    from sage_jax.decoding.sampling import SamplingConfig

    target, draft = pair
    seqs, probs, kept = _exact_top_p(target, 1.0, 0.8)
    assert kept.min() >= 1 and kept.mean() < V - 2  # the nucleus really drops tokens
    engine = Engine(target, draft, sampling=SamplingConfig(top_p=0.8))
    for policy in ("ar", POLICIES["sage"]):
        out = engine.generate([PROMPT] * ROWS, policy=policy, max_new_tokens=N_NEW, temperature=1.0, seed=5)
        assert _chi2_pvalue(out.token_ids, seqs, probs) > 1e-3, policy
        assert all(probs[int(np.ravel_multi_index(s, (V,) * N_NEW))] > 0 for s in out.token_ids)  # never outside
    assert _chi2_pvalue(out.token_ids, *_exact(target, 1.0)) < 1e-6  # the untruncated distribution is rejected
