import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pgla_jax import fl, protections
from pgla_jax.config import ProtectionConfig


def _flat(g):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])


def test_paper_calibration_reproduces_the_released_code():
    # M = 2·lr·C/m · √(2 ln(1.25/δ))/ε with the code's defaults (lr 1e-3, C 10, m 1, δ 1e-4); pgla.md §1.5 table.
    m = protections.paper_noise_scale("gaussian", 1.0, 1e-4, 10.0, 1e-3, 1)
    assert m == pytest.approx(0.02 * math.sqrt(2 * math.log(1.25e4)), rel=1e-12)
    assert m == pytest.approx(0.0869, abs=1e-4)
    assert protections.paper_noise_scale("gaussian", 10.0, 1e-4, 10.0, 1e-3, 1) == pytest.approx(0.00869, abs=1e-5)
    assert protections.paper_noise_scale("laplace", 1.0, 1e-4, 10.0, 1e-3, 1) == pytest.approx(0.02)
    plan = protections.plan(ProtectionConfig(noise="laplace"), 1.0, batch=1)
    assert plan.clip is None and plan.std == pytest.approx(math.sqrt(2) * 0.02)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="epsilon"):
            protections.plan(ProtectionConfig(), bad, batch=1)


def test_dpsgd_multiplier_comes_from_the_accountant():
    import dp_accounting
    import dp_accounting.pld
    from dp_accounting import rdp

    z = protections.dpsgd_noise_multiplier("gaussian", 1.0, 1e-5)
    acc = rdp.RdpAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), 1))
    assert acc.get_epsilon(1e-5) == pytest.approx(1.0, abs=0.01)
    assert 3.0 < z < 5.0  # classical analytic bound √(2 ln(1.25/δ)) = 4.84 is looser
    # Pure ε-DP Laplace, one release: b = C/ε exactly, i.e. z = 1/ε.
    assert protections.dpsgd_noise_multiplier("laplace", 2.0, 1e-5) == pytest.approx(0.5, rel=1e-3)
    # Composed Laplace releases go through the PLD accountant: between advanced and basic composition.
    z10 = protections.dpsgd_noise_multiplier("laplace", 10.0, 1e-4, steps=10)
    assert 0.5 < z10 <= 1.0 + 1e-6  # basic composition: 10 releases of (ε/10)-DP need z = 10/ε = 1
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.LaplaceDpEvent(z10), 10))
    assert acc.get_epsilon(1e-4) <= 10.0 + 0.05
    # More releases or a smaller ε need more noise.
    assert protections.dpsgd_noise_multiplier("gaussian", 1.0, 1e-5, steps=10) > z
    assert protections.dpsgd_noise_multiplier("gaussian", 0.5, 1e-5) > z


@pytest.mark.parametrize("noise", ["gaussian", "laplace"])
@pytest.mark.parametrize("calibration", ["paper", "dpsgd"])
def test_empirical_noise_std_matches_the_formula(lenet, mnist, noise, calibration):
    graphdef, params = lenet
    x = jnp.asarray(mnist.images[:2])
    y = fl.one_hot(jnp.asarray(mnist.labels[:2]), 10)
    cfg = ProtectionConfig(noise=noise, calibration=calibration, clip=1.0)
    plan = protections.plan(cfg, 1.0, batch=2)
    # The same program with the noise switched off is the clean (clipped, for DP-SGD) gradient.
    silent = dataclasses.replace(plan, scale=0.0)
    clean = protections.protected_grad(graphdef, params, x, y, jax.random.key(0), cfg=cfg, noise_plan=silent)
    if calibration == "paper":
        assert plan.clip is None  # the released code never clips
    else:
        assert plan.scale == pytest.approx(plan.multiplier * 1.0 / 2)  # z·C on the sum, / B for the mean
        norm = np.abs(_flat(clean)).sum() if noise == "laplace" else np.linalg.norm(_flat(clean))
        assert norm <= 1.0 + 1e-4  # the mean of examples clipped to C = 1 has norm ≤ C
    draws = [_flat(protections.protected_grad(graphdef, params, x, y, jax.random.key(s), cfg=cfg,
                                               noise_plan=plan)) - _flat(clean) for s in range(1, 5)]
    resid = np.concatenate(draws)  # 4 × 13,426 entries
    assert resid.std() == pytest.approx(plan.std, rel=0.03)
    assert abs(resid.mean()) < 0.05 * plan.std
    if noise == "laplace":
        # The effective std is √2·b, not b; and the tails are Laplace (excess kurtosis 3), not Gaussian (0).
        assert plan.std == pytest.approx(math.sqrt(2) * plan.scale)
        kurt = np.mean((resid / resid.std()) ** 4) - 3
        assert 2.0 < kurt < 4.5
    else:
        assert abs(np.mean((resid / resid.std()) ** 4) - 3) < 0.3


def test_dpsgd_clipping_bounds_every_per_example_norm(lenet, mnist):
    graphdef, params = lenet
    x = jnp.asarray(mnist.images[:8])
    y = fl.one_hot(jnp.asarray(mnist.labels[:8]), 10)
    per = fl.per_example_grads(graphdef, params, x, y)
    norms = protections.per_example_norms(per)
    clip = float(jnp.median(norms))  # half the examples above, half below
    clipped = protections.clip_per_example(per, clip)
    after = protections.per_example_norms(clipped)
    assert bool(jnp.all(after <= clip * (1 + 1e-5)))
    big = norms > clip
    np.testing.assert_allclose(after[big], clip, rtol=1e-5)
    np.testing.assert_allclose(after[~big], norms[~big], rtol=1e-5)  # small ones untouched
    l1 = protections.per_example_norms(protections.clip_per_example(per, 5.0, ord=1), ord=1)
    assert bool(jnp.all(l1 <= 5.0 * (1 + 1e-5)))


_clip_norms = jax.jit(
    lambda per, clip, ord: protections.per_example_norms(protections.clip_per_example(per, clip, ord), ord),
    static_argnums=2,
)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(1e-3, 1e3), min_size=6, max_size=6), st.floats(1e-2, 10.0), st.sampled_from([1, 2]),
       st.integers(0, 2**31 - 1))
def test_clipping_bound_holds_for_any_scale(scales, clip, ord, seed):
    # Fixed shapes (one compilation per norm); hypothesis varies the per-example scales, C and the draw.
    k1, k2 = jax.random.split(jax.random.key(seed))
    s = jnp.asarray(scales, jnp.float32)
    per = {"a": jax.random.normal(k1, (6, 3, 4)) * s.reshape(6, 1, 1), "b": jax.random.normal(k2, (6, 5)) * s[:, None]}
    after = _clip_norms(per, jnp.float32(clip), ord)
    assert bool(jnp.all(after <= clip * (1 + 1e-5)))


def test_topk_pruning_and_quantisation():
    g = {"w": jax.random.normal(jax.random.key(0), (40, 25)), "b": jax.random.normal(jax.random.key(1), (1000,))}
    flat = _flat(g)
    pruned = _flat(protections.topk_prune(g, 0.1))
    kept = pruned != 0
    assert kept.sum() == 200
    assert np.abs(flat[kept]).min() >= np.abs(flat[~kept]).max()
    np.testing.assert_array_equal(pruned[kept], flat[kept])
    q = protections.quantize(g, 4)
    for name in g:
        vals = np.unique(np.asarray(q[name]))
        assert len(vals) <= 2**4 - 1
        step = np.abs(np.asarray(g[name])).max() / 7
        assert np.abs(np.asarray(q[name]) - np.asarray(g[name])).max() <= step / 2 + 1e-6
