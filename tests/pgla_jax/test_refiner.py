"""The prior's learned correction (`pgla_jax/denoise/refiner.py`): the prior's DDIM is the per-direction linear filter
the refiner is trained against, an untrained refiner is the prior itself, training resumes to the same weights, the
surrogate augmentation, and the shipped refiner against the shipped prior on real protected MNIST gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import checkpoint, cli
from pgla_jax import codec, data, fl, metrics, protections
from pgla_jax.config import DenoiserConfig, ExperimentConfig, GradientDataConfig, ProtectionConfig, RefinerConfig
from pgla_jax.denoise import denoiser_checkpoint, denoisers, gradients, loop, refiner
from tests.pgla_jax.conftest import needs_fashion


@pytest.fixture(scope="module")
def shipped(lenet):
    return denoisers.load(denoiser_checkpoint.shipped_path(), codec.make_codec(lenet[1], "image2d", 4))


def _observation(lenet, mnist, i=0, eps=1.0):
    graphdef, params = lenet
    plan = protections.plan(ProtectionConfig(), eps, 1)
    x, y = data.pick(mnist, 1 + i, seed=3)
    xi, yi = jnp.asarray(x[i : i + 1]), fl.one_hot(jnp.asarray(y[i : i + 1]), 10)
    return plan, protections.protected_grad(graphdef, params, xi, yi, jax.random.key(7), cfg=ProtectionConfig(),
                                            noise_plan=plan)


def test_the_priors_ddim_is_a_per_direction_linear_filter(lenet, mnist, shipped):
    """What training relies on: the prior's DDIM output has coefficients γ(σ)·c_y, γ read off one run."""
    plan, g_sent = _observation(lenet, mnist)
    out, t_star = shipped.run("prior_ddim", g_sent, plan, jax.random.key(1))
    assert t_star == 24
    gp = shipped.prior
    flat = lambda g: jnp.concatenate([jnp.ravel(a) for a in jax.tree.leaves(g)])[None]  # noqa: E731
    gain = shipped.prior_gains(float(plan.std))
    want = gain[None] * refiner.coefficients(gp, flat(g_sent))
    np.testing.assert_allclose(np.asarray(refiner.coefficients(gp, flat(out))), np.asarray(want), rtol=1e-3, atol=1e-6)
    assert 0.0 < float(gain.min()) < 0.1 and float(gain.max()) <= 1.0
    np.testing.assert_array_equal(shipped.prior_gains(1e-5), np.ones_like(gain))  # below the first step: identity


def test_an_untrained_refiner_is_the_prior_itself(lenet, mnist, shipped):
    plan, g_sent = _observation(lenet, mnist, 1)
    model = refiner.Refiner(int(refiner.variances(shipped.prior).shape[0]), 16, rngs=nnx.Rngs(0))
    dens = dataclasses.replace(shipped, refiner=nnx.split(model, nnx.Param))
    assert denoisers.REFINED in dens.names
    a, ta = dens.run("prior_ddim", g_sent, plan, jax.random.key(2))
    b, tb = dens.run(denoisers.REFINED, g_sent, plan, jax.random.key(2))
    assert ta == tb == 24
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_augment_varies_about_the_fraction_asked_and_keeps_the_range():
    images = np.random.default_rng(0).uniform(size=(200, 28, 28, 1)).astype(np.float32)
    out = gradients.augment(images, 0.5, np.random.default_rng(1))
    changed = np.mean([not np.array_equal(a, b) for a, b in zip(images, out, strict=True)])
    assert 0.35 < changed < 0.65 and out.min() >= 0.0 and out.max() <= 1.0
    np.testing.assert_array_equal(gradients.augment(images, 0.5, np.random.default_rng(1)), out)  # seeded
    np.testing.assert_array_equal(gradients.augment(images, 0.0, np.random.default_rng(1)), images)


@pytest.mark.integration  # resumption: a training run twice over
@needs_fashion
def test_training_resumes_to_the_same_weights_and_refuses_another_config(tmp_path, shipped):
    rc = RefinerConfig(hidden=8, steps=6, batch_size=16, checkpoint_every=3,
                       gradients=GradientDataConfig(steps=2, per_step=8, augment=0.5))
    cfg = DenoiserConfig(refiner=rc)
    data_dir = str(tmp_path / "grads")
    gradients.build(rc.gradients, data_dir)
    losses = []
    whole = refiner.train(cfg, shipped.prior, shipped.prior_gains, data_dir, str(tmp_path / "a"),
                          progress=losses.append)
    assert len(losses) == 6 and all(np.isfinite(losses))

    def interrupt(loss):  # stopped after step 4; the state saved at step 3 is where a rerun resumes
        if len(seen := interrupt.seen) == 3:
            raise KeyboardInterrupt
        seen.append(loss)

    interrupt.seen = []
    with pytest.raises(KeyboardInterrupt):
        refiner.train(cfg, shipped.prior, shipped.prior_gains, data_dir, str(tmp_path / "b"), progress=interrupt)
    rest = []
    resumed = refiner.train(cfg, shipped.prior, shipped.prior_gains, data_dir, str(tmp_path / "b"),
                            progress=rest.append)
    assert len(rest) == 3 and np.allclose(rest, losses[3:], rtol=0, atol=0)
    for u, v in zip(jax.tree.leaves(checkpoint.restore(whole)), jax.tree.leaves(checkpoint.restore(resumed)),
                    strict=True):
        np.testing.assert_array_equal(u, v)
    other = dataclasses.replace(cfg, refiner=dataclasses.replace(rc, lr=1e-3))
    with pytest.raises(ValueError, match="another config"):
        refiner.train(other, shipped.prior, shipped.prior_gains, data_dir, str(tmp_path / "b"))
    # The U-Net's fields are not the refiner's, nor the refiner's the U-Net's: either state resumes across them.
    refiner.train(dataclasses.replace(cfg, steps=cfg.steps + 1), shipped.prior, shipped.prior_gains, data_dir,
                  str(tmp_path / "b"))
    assert loop._diffusion_fields(cfg) == loop._diffusion_fields(other)
    g, p = refiner.load(whole, shipped.prior)
    assert isinstance(nnx.merge(g, p), refiner.Refiner)


def test_shipped_refiner_beats_the_prior_on_every_digit(lenet, shipped):
    """The README's 8 digits (the attack's own keys): Gaussian ε = 1, paper calibration, gradient cosine per digit."""
    cfg = cli.load_config("mnist_lenet", "configs.pgla", ExperimentConfig)
    ds = data.load(cfg.data)
    x_all, y_all = data.pick(ds, 8, cfg.data.seed)
    graphdef, params = lenet
    plan = protections.plan(cfg.protection, 1.0, 1)
    assert denoisers.REFINED in shipped.names
    key = jax.random.key(cfg.attack.seed)
    prior_cos, refined_cos = [], []
    for b in range(8):
        x, y = jnp.asarray(x_all[b : b + 1]), fl.one_hot(jnp.asarray(y_all[b : b + 1]), 10)
        g = fl.batch_grad(graphdef, params, x, y)
        # experiment.run's keys for the first setting and ε: the README table's noise draws
        k_noise, _, k_den = jax.random.split(jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, b), 1), 1),
                                             3)
        g_sent = protections.protected_grad(graphdef, params, x, y, k_noise, cfg=cfg.protection, noise_plan=plan)
        prior_cos.append(float(metrics.grad_cosine(shipped.run("prior_ddim", g_sent, plan, k_den)[0], g)))
        refined_cos.append(float(metrics.grad_cosine(shipped.run(denoisers.REFINED, g_sent, plan, k_den)[0], g)))
    print(np.round(prior_cos, 5), np.round(refined_cos, 5))
    assert all(r > p for r, p in zip(refined_cos, prior_cos, strict=True)), (prior_cos, refined_cos)
    assert np.mean(refined_cos) >= 0.996 and np.mean(prior_cos) < 0.996
