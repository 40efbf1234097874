"""The Gaussian prior of clean gradients (`pgla_jax/denoise/prior.py`): its ε-model against the dense closed form, its
one-shot estimate against the linear MMSE formula, the fit, the checkpoint, and the `prior*` denoiser rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.pgla import denoiser_tiny
from pgla_jax import codec, fl, protections
from pgla_jax.config import DenoiserConfig, ProtectionConfig
from pgla_jax.denoise import ddpm, denoiser_checkpoint, denoisers, prior, sampling
from pgla_jax.denoise.unet import UNet
from pgla_jax.models import split_victim


def _low_rank_prior(seed=0, bounds=((0, 7), (7, 19)), rank=3):
    """A prior with random orthonormal directions, variances and rest variance per block (float64 numpy copies)."""
    rng = np.random.default_rng(seed)
    size = bounds[-1][1]
    vecs, vals, rest = [], [], []
    for a, b in bounds:
        q, _ = np.linalg.qr(rng.normal(size=(b - a, b - a)))
        vecs.append(q[:, :rank])
        vals.append(rng.uniform(0.5, 3.0, rank))
        rest.append(rng.uniform(0.01, 0.1))
    mean = rng.normal(size=size)
    p = prior.GaussianPrior(jnp.asarray(mean, jnp.float32), tuple(jnp.asarray(v, jnp.float32) for v in vecs),
                            tuple(jnp.asarray(v, jnp.float32) for v in vals),
                            tuple(jnp.asarray(r, jnp.float32) for r in rest), jnp.asarray([0.2, 0.05], jnp.float32),
                            bounds)
    cov = np.zeros((size, size))
    for (a, b), u, lam, rho in zip(bounds, vecs, vals, rest, strict=True):
        cov[a:b, a:b] = u @ np.diag(lam) @ u.T + rho * (np.eye(b - a) - u @ u.T)
    return p, mean, cov


def test_eps_is_the_dense_closed_form():
    """ε*(x, ᾱ) = √(1 − ᾱ)·(ᾱΣ + (1 − ᾱ)I)⁻¹(x − √ᾱμ) on the real entries (block-diagonal Σ with a rest variance),
    the scalar Gaussian's on the padding; one ᾱ per example."""
    p, mean, cov = _low_rank_prior()
    size, pad = p.size, 5
    x = np.random.default_rng(1).normal(size=(3, size + pad))
    abar = np.array([0.99, 0.5, 0.02])
    got = np.asarray(prior.eps(p, jnp.asarray(x, jnp.float32), jnp.asarray(abar, jnp.float32)))
    for i, a in enumerate(abar):
        want = np.sqrt(1 - a) * np.linalg.solve(a * cov + (1 - a) * np.eye(size), x[i, :size] - np.sqrt(a) * mean)
        np.testing.assert_allclose(got[i, :size], want, rtol=2e-4, atol=2e-5)
        want_pad = np.sqrt(1 - a) * (x[i, size:] - np.sqrt(a) * 0.2) / (a * 0.05 + 1 - a)
        np.testing.assert_allclose(got[i, size:], want_pad, rtol=2e-4, atol=2e-5)


def test_oneshot_from_the_exact_start_is_the_linear_mmse_estimate():
    """With x = √n·g' at ᾱ = n (σ² = (1 − n)/n), x̂₀ = μ + Σ(Σ + σ²I)⁻¹(g' − μ): the Wiener filter of the Gaussian."""
    p, mean, cov = _low_rank_prior(seed=3)
    sched = ddpm.linear_schedule()
    apply = denoisers._prior_apply_for(sched)
    sigma = 0.3
    g_sent = np.random.default_rng(4).normal(size=(1, p.size + 1))
    out = sampling.denoise(apply, p, jnp.asarray(g_sent, jnp.float32), jnp.float32(sigma),
                           jnp.int32(ddpm.t_index(sched, sigma)), jax.random.key(0), schedule=sched, method="oneshot")
    y = g_sent[0, : p.size]
    want = mean + cov @ np.linalg.solve(cov + sigma**2 * np.eye(p.size), y - mean)
    np.testing.assert_allclose(np.asarray(out)[0, : p.size], want, rtol=1e-3, atol=1e-3)


def test_fit_recovers_a_low_rank_gaussian_and_blocks_follow_the_layers():
    p_true, mean, cov = _low_rank_prior(seed=5)
    rng = np.random.default_rng(6)
    samples = rng.multivariate_normal(mean, cov, size=20000)
    p = prior.fit(samples, p_true.bounds, rank=3)
    for got, want in zip(p.vals, p_true.vals, strict=True):
        np.testing.assert_allclose(np.sort(np.asarray(got)), np.sort(np.asarray(want)), rtol=0.08)
    for got, want in zip(p.vecs, p_true.vecs, strict=True):  # the same subspace
        proj_got, proj_want = np.asarray(got) @ np.asarray(got).T, np.asarray(want) @ np.asarray(want).T
        assert np.abs(proj_got - proj_want).max() < 0.1
    np.testing.assert_allclose(np.asarray(p.rest), np.asarray(p_true.rest), rtol=0.1)
    np.testing.assert_allclose(np.asarray(p.mean), mean, atol=0.05)
    # The DLG LeNet: one block per layer (kernel + bias), in the codec's leaf order.
    _, params = split_victim(DenoiserConfig.from_config(denoiser_tiny.get_config()).gradients.victim)
    bounds = prior.blocks(params)
    assert len(bounds) == 4 and bounds[0][0] == 0 and bounds[-1][1] == codec.make_codec(params).size
    assert all(b0[1] == b1[0] for b0, b1 in zip(bounds[:-1], bounds[1:]))
    with pytest.raises(ValueError, match="gradients"):
        prior.fit(samples[:, :5], p_true.bounds, 3)


@pytest.fixture(scope="module")
def tiny_prior_ckpt(tmp_path_factory):
    """An untrained tiny U-Net and a prior fitted on random 'gradients' of the 8×8 digits LeNet, saved side by side."""
    cfg = DenoiserConfig.from_config(denoiser_tiny.get_config())
    root = tmp_path_factory.mktemp("prior_ckpt")
    denoiser_checkpoint.save(str(root / "denoiser"), denoiser_checkpoint.to_pure(UNet(cfg.unet, rngs=nnx.Rngs(0))), cfg)
    _, params = split_victim(cfg.gradients.victim)
    bounds = prior.blocks(params)
    fake = np.random.default_rng(0).normal(size=(64, bounds[-1][1])) * 0.1
    p = prior.fit(fake, bounds, rank=8)
    prior.save(str(root / "prior"), p)
    return str(root / "denoiser"), cfg, p


@pytest.mark.integration
def test_prior_checkpoint_round_trip_and_rows(tiny_prior_ckpt):
    path, cfg, p = tiny_prior_ckpt
    back = prior.load(prior.sibling(path))
    assert back.bounds == p.bounds
    for a, b in zip((back.mean, back.pad, *back.vals, *back.rest), (p.mean, p.pad, *p.vals, *p.rest), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(back.vecs, p.vecs, strict=True):  # stored in float16, re-orthonormalised on load
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, atol=2e-3)
        np.testing.assert_allclose(a.T @ a, np.eye(a.shape[1]), atol=1e-5)
    with pytest.raises(ValueError, match="not a 'pgla-gaussian-prior'"):
        prior.load(path)
    graphdef, params = split_victim(cfg.gradients.victim)
    dens = denoisers.load(path, codec.make_codec(params, "image2d", 4))
    assert set(denoisers.PRIOR) <= set(dens.names)
    x, y = jnp.full((1, 8, 8, 1), 0.5), fl.one_hot(jnp.array([3]), 10)
    for eps_, t_want in ((1.0, 24), (10.0, 0)):  # ε = 10: below the first step, the input comes back bit for bit
        plan = protections.plan(ProtectionConfig(), eps_, 1)
        g_sent = protections.protected_grad(graphdef, params, x, y, jax.random.key(0), cfg=ProtectionConfig(),
                                            noise_plan=plan)
        for name in denoisers.PRIOR:
            out, t_star = dens.run(name, g_sent, plan, jax.random.key(1))
            assert t_star == t_want and jax.tree.structure(out) == jax.tree.structure(g_sent)
            assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(out))
            if t_want == 0:
                for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(g_sent), strict=True):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Without a prior beside the checkpoint there are no prior rows, and asking for one is a one-line error.
    bare = denoisers.Denoisers(dens.codec, dens.cfg, dens.schedule, dens.unet)
    assert not set(denoisers.PRIOR) & set(bare.names)
    with pytest.raises(ValueError, match="unknown or unavailable denoiser 'prior_ddim'"):
        bare.run("prior_ddim", g_sent, plan, jax.random.key(1))


@pytest.mark.parametrize("shape,kind", [((28, 28, 1), "pgla-denoiser"), ((32, 32, 3), prior.KIND)])
def test_shipped_checkpoint_per_victim(shape, kind):
    """`--denoiser shipped` picks the checkpoint made for the victim: the MNIST LeNet's U-Net (its prior beside it),
    the colour LeNet's prior alone; a victim without one gets None (the classical baselines)."""
    from configs import checkpoint
    from pgla_jax.config import VictimConfig

    path = denoiser_checkpoint.shipped_for(VictimConfig(image_shape=shape))
    assert checkpoint.read_metadata(path)["kind"] == kind
    assert denoiser_checkpoint.shipped_for(VictimConfig(image_shape=shape, num_classes=100)) is None


@pytest.mark.integration
def test_shipped_colour_prior_cleans_real_protected_gradients():
    """The colour stand-in: the 32×32×3 LeNet on two private scikit-image patches, Gaussian ε = 1 (paper
    calibration); the prior was fitted on surrogate patches of other photos. Measured: none 0.9036 / 0.9122, Wiener
    (σ known) 0.9159 / 0.9232, prior DDIM 0.9951 / 0.9964, one-shot 0.9949 / 0.9968, refined 0.9957 / 0.9977."""
    from pgla_jax import data, metrics
    from pgla_jax.config import VictimConfig

    victim = VictimConfig(image_shape=(32, 32, 3))
    graphdef, params = split_victim(victim)
    dens = denoisers.load(denoiser_checkpoint.shipped_for(victim), codec.make_codec(params, "image2d", 4))
    # The prior ships with its learned correction beside it (`…/refiner`).
    assert dens.unet is None and set(dens.names) == {"none", "gaussian_filter", "wiener", *denoisers.PRIOR,
                                                     denoisers.REFINED}
    x, y = data.pick(data.skimage_patches(), 2, seed=0)
    cfg = ProtectionConfig()
    plan = protections.plan(cfg, 1.0, 1)
    for i in range(2):
        xi, yi = jnp.asarray(x[i : i + 1]), fl.one_hot(jnp.asarray(y[i : i + 1]), 10)
        g = fl.batch_grad(graphdef, params, xi, yi)
        g_sent = protections.protected_grad(graphdef, params, xi, yi, jax.random.key(100 + i), cfg=cfg,
                                            noise_plan=plan)
        cos = {n: float(metrics.grad_cosine(dens.run(n, g_sent, plan, jax.random.key(1))[0], g))
               for n in ("none", "wiener", "prior_ddim", "prior_oneshot", "prior_refined")}
        print({k: round(v, 4) for k, v in cos.items()})
        assert min(cos["prior_ddim"], cos["prior_oneshot"], cos["prior_refined"]) >= 0.99, cos
        assert cos["prior_ddim"] >= cos["wiener"] + 0.05, cos
