"""PGLA part 2 parts: U-Net shapes and data parallelism, baselines, the gradient data set, checkpoints, denoisers."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import sharding
from configs.pgla import denoiser_tiny
from pgla_jax import codec, data, fl, metrics, protections
from pgla_jax.config import DataConfig, DenoiserConfig, GradientDataConfig, ProtectionConfig, UNetConfig, VictimConfig
from pgla_jax.denoise import baselines, denoiser_checkpoint, denoisers, gradients
from pgla_jax.denoise.unet import UNet
from pgla_jax.models import split_victim

TINY = UNetConfig(width=8, mults=(1, 2), groups=2, heads=2, head_dim=4)


def _jitted(graphdef):
    return jax.jit(lambda p, x, t, c: nnx.merge(graphdef, p)(x, t, c))


# A compile of each form (~12 s on 2 cores): the 1-D and conditional forms run under -m integration.
@pytest.mark.parametrize("form", ["2d", pytest.param("1d", marks=pytest.mark.integration),
                                  pytest.param("conditional", marks=pytest.mark.integration)])
def test_unet_shapes_2d_1d_and_conditional(form):
    cfg, shape = {"2d": (TINY, (2, 8, 8, 1)), "1d": (dataclasses.replace(TINY, dims=1), (2, 16, 1)),
                  "conditional": (dataclasses.replace(TINY, cond_channels=1), (2, 8, 8, 1))}[form]
    graphdef, params = nnx.split(UNet(cfg, rngs=nnx.Rngs(0)))
    f = _jitted(graphdef)
    x = jax.random.normal(jax.random.key(0), shape)
    out = f(params, x, jnp.array([0, 900]), x if cfg.cond_channels else None)
    assert out.shape == shape and bool(jnp.all(jnp.isfinite(out)))
    # The time embedding matters: two different steps give different ε̂ for the same input.
    out2 = f(params, x[::-1][::-1], jnp.array([900, 0]), x if cfg.cond_channels else None)
    assert float(jnp.abs(out - out2).max()) > 1e-4


def test_unet_data_parallel_matches_single_device(devices):
    m = UNet(TINY, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(m)
    x = jax.random.normal(jax.random.key(1), (8, 8, 8, 1))
    t = jnp.arange(8) * 100
    f = jax.jit(lambda p, x, t: nnx.merge(graphdef, p)(x, t))
    ref = f(params, x, t)
    mesh = sharding.make_mesh(data=-1)
    with sharding.use(mesh, "train"):
        xs = jax.device_put(x, sharding.named_sharding(("batch", None, None, None), x.shape))
        out = jax.jit(lambda p, x, t: nnx.merge(graphdef, p)(x, t))(params, xs, t)
    assert len(out.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-4)


def test_baselines_on_a_smooth_image():
    yy, xx = np.mgrid[0:32, 0:32] / 32.0
    clean = jnp.asarray(np.sin(3 * xx) * np.cos(2 * yy), jnp.float32)[..., None]
    noisy = clean + 0.1 * jax.random.normal(jax.random.key(0), clean.shape)
    mse = lambda a: float(jnp.mean((a - clean) ** 2))  # noqa: E731
    assert mse(baselines.wiener(noisy, jnp.float32(0.01))) < 0.4 * mse(noisy)
    assert mse(baselines.gaussian_filter(noisy)) < mse(noisy)
    # Told there is no noise, the Wiener filter is the identity; a constant image passes the blur unchanged.
    np.testing.assert_allclose(np.asarray(baselines.wiener(noisy, jnp.float32(0.0))), np.asarray(noisy), atol=1e-5)
    np.testing.assert_allclose(np.asarray(baselines.gaussian_filter(jnp.full((8, 8, 1), 0.3))), 0.3, atol=1e-6)


def test_gradient_data_set_is_the_surrogate_trajectory(tmp_path):
    cfg = GradientDataConfig(victim=VictimConfig(image_shape=(8, 8, 1)), data=DataConfig(name="digits"), steps=2,
                             per_step=3, lr=0.5)
    gradients.build(cfg, str(tmp_path))
    src, size = gradients.source(str(tmp_path))
    assert len(src) == 6 and size == 8026 and src[0].dtype == np.float32
    # Step 0's records are batch-1 gradients at the global (victim) weights; step 1's are after one SGD step.
    from pgla_jax import data

    ds = data.load(cfg.data)
    idx = np.random.default_rng(cfg.seed).choice(len(ds.labels), 3, replace=False)
    graphdef, params = split_victim(cfg.victim)
    g = fl.batch_grad(graphdef, params, jnp.asarray(ds.images[idx[:1]]), fl.one_hot(jnp.asarray(ds.labels[idx[:1]]),
                                                                                       10))
    flat = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
    np.testing.assert_allclose(src[0], flat, rtol=1e-5, atol=1e-6)
    assert not np.allclose(src[3], src[0])
    # Batches are a pure function of the step: a resumed run sees the same ones, and an epoch covers everything.
    assert np.array_equal(gradients.batch_indices(5, 4, 6, 0), gradients.batch_indices(5, 4, 6, 0))
    assert sorted(np.concatenate([gradients.batch_indices(s, 3, 6, 0) for s in range(2)])) == list(range(6))


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """An untrained tiny conditional U-Net checkpoint for the 8×8 digits LeNet (saving needs no training)."""
    cfg = DenoiserConfig.from_config(denoiser_tiny.get_config())
    path = str(tmp_path_factory.mktemp("ckpt") / "denoiser")
    denoiser_checkpoint.save(path, denoiser_checkpoint.to_pure(UNet(cfg.unet, rngs=nnx.Rngs(0))), cfg)
    return path, cfg


@pytest.mark.integration
def test_checkpoint_round_trip_and_every_denoiser(tiny_ckpt, lenet):
    path, cfg = tiny_ckpt
    graphdef, params = split_victim(cfg.gradients.victim)
    c = codec.make_codec(params, "image2d", 4)
    dens = denoisers.load(path, c)
    assert dens.cfg == cfg and dens.codec.shape == (90, 90, 1)  # 8,026 entries; the tiny U-Net halves once
    assert set(dens.names) == {"none", "gaussian_filter", "wiener", *denoisers.DIFFUSION}
    x = jnp.full((1, 8, 8, 1), 0.5)
    g = fl.batch_grad(graphdef, params, x, fl.one_hot(jnp.array([3]), 10))
    plan = protections.plan(ProtectionConfig(noise="laplace"), 1.0, 1)
    g_sent = protections.protected_grad(graphdef, params, x, fl.one_hot(jnp.array([3]), 10), jax.random.key(0),
                                        cfg=ProtectionConfig(noise="laplace"), noise_plan=plan)
    for name in ("none", "wiener", "diffusion"):
        out, t_star = dens.run(name, g_sent, plan, jax.random.key(1))
        assert jax.tree.structure(out) == jax.tree.structure(g)
        assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(out))
    assert t_star == dens.start_index("diffusion", plan) + 1
    # A second call (another ε, same shapes) reuses the compiled reverse loop.
    from pgla_jax.denoise import sampling

    before = sampling.denoise._cache_size()
    plan2 = protections.plan(ProtectionConfig(noise="laplace"), 2.0, 1)
    assert not sampling.below_first_step(dens.schedule, plan2.std)
    _, t2 = dens.run("diffusion", g_sent, plan2, jax.random.key(2))
    assert sampling.denoise._cache_size() == before and 1 <= t2 < t_star
    # t* < 1: at ε = 10 the noise (std 0.0028) is below the first step's (≈ 0.01), and every adaptive denoiser
    # returns the protected gradient bit for bit (t* reported as 0); the jitted sampler does the same on its own.
    plan10 = protections.plan(ProtectionConfig(noise="laplace"), 10.0, 1)
    assert sampling.below_first_step(dens.schedule, plan10.std)
    for name in ("diffusion", "diffusion_ddim", "diffusion_oneshot", "diffusion_conditional"):
        out, t0 = dens.run(name, g_sent, plan10, jax.random.key(3))
        assert t0 == 0
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(g_sent), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    y = dens.codec.encode(g_sent)[None]
    for method in ("ddpm", "ddim", "oneshot"):
        out = sampling.denoise(denoisers._apply_for(dens.unet[0]), dens.unet[1], y, jnp.float32(plan10.std),
                               jnp.int32(0), jax.random.key(4), schedule=dens.schedule, method=method)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(y))
    # Laplace b = 0.02 at ε = 1: t* = 4 from the Gaussian of the same median absolute deviation (1.028·b), 4 with
    # the released b too (6 from the std √2·b); the non-adaptive step is fixed.
    t = {name: dens.start_index(name, plan) + 1 for name in denoisers.DIFFUSION}
    assert t["diffusion"] == t["diffusion_ddim"] == t["diffusion_conditional"] == 4
    assert t["diffusion_released"] == 4 and t["diffusion_nonadaptive"] == denoisers.NONADAPTIVE_T + 1
    # A checkpoint for another victim is refused with a one-line reason.
    _, lenet_params = lenet
    with pytest.raises(ValueError, match="trained for a victim"):
        denoisers.load(path, codec.make_codec(lenet_params, "image2d", 4))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny config's data set, a 1-device mesh, and its uninterrupted 4-step run's losses."""
    from pgla_jax.denoise import loop

    root = tmp_path_factory.mktemp("train")
    cfg = DenoiserConfig.from_config(denoiser_tiny.get_config())
    data, mesh = str(root / "gradients"), sharding.make_mesh(data=1, devices=jax.devices()[:1])
    gradients.build(cfg.gradients, data)
    full = []
    loop.train(cfg, data, str(root / "full"), progress=full.append, mesh=mesh)
    return cfg, data, mesh, root, full


@pytest.mark.integration
def test_training_resumes_exactly(tiny_run):
    """A run stopped at step 2 and resumed gives the uninterrupted run's losses; a longer schedule needs --extend."""
    from pgla_jax.denoise import loop

    cfg, data, mesh, root, full = tiny_run
    parts = []
    assert loop.saved_step(str(root / "parts")) == 0
    loop.train(cfg, data, str(root / "parts"), progress=parts.append, mesh=mesh, max_steps=2)
    assert loop.saved_step(str(root / "parts")) == 2  # where the CLI's progress bar starts on resume
    loop.train(cfg, data, str(root / "parts"), progress=parts.append, mesh=mesh)
    assert len(full) == 4 and parts == full
    with pytest.raises(ValueError, match="another config.*--extend"):
        loop.train(dataclasses.replace(cfg, steps=6), data, str(root / "parts"), mesh=mesh)
    with pytest.raises(ValueError, match="needs --steps above"):
        loop.train(dataclasses.replace(cfg, steps=3), data, str(root / "parts"), mesh=mesh, extend=True)


@pytest.mark.integration
def test_dncnn_trains_and_is_loaded_beside_the_unet(tiny_run):
    """The DnCNN baseline's trainer (strict rank promotion, as in every test) and `denoisers.load` finding its
    checkpoint in the sibling folder of the U-Net's."""
    from pgla_jax.denoise import dncnn

    cfg, data_dir, mesh, root, _ = tiny_run
    losses = []
    out = dncnn.train(cfg, data_dir, str(root / "full"), progress=losses.append, mesh=mesh)
    assert out == str(root / "full" / "dncnn") and len(losses) == cfg.dncnn_steps and np.all(np.isfinite(losses))
    graphdef, params = split_victim(cfg.gradients.victim)
    dens = denoisers.load(str(root / "full" / "denoiser"), codec.make_codec(params, "image2d", 4))
    assert "dncnn" in dens.names
    x, y = jnp.full((1, 8, 8, 1), 0.5), fl.one_hot(jnp.array([3]), 10)
    cfg_p = ProtectionConfig()
    plan = protections.plan(cfg_p, 1.0, 1)
    g_sent = protections.protected_grad(graphdef, params, x, y, jax.random.key(0), cfg=cfg_p, noise_plan=plan)
    g_hat, t_star = dens.run("dncnn", g_sent, plan, jax.random.key(1))
    assert t_star is None and jax.tree.structure(g_hat) == jax.tree.structure(g_sent)
    assert 0.0 < float(metrics.grad_rel_l2(g_hat, g_sent)) and np.isfinite(float(metrics.grad_rel_l2(g_hat, g_sent)))


@pytest.mark.integration
def test_dncnn_resumes_exactly(tiny_run):
    """The DnCNN trains on the U-Net's loop: stopped after its first step and rerun, it resumes from its state with the
    uninterrupted run's losses and weights."""
    from pgla_jax.denoise import dncnn

    cfg, data_dir, mesh, root, _ = tiny_run
    whole, parts = [], []
    dncnn.train(cfg, data_dir, str(root / "dncnn_whole"), progress=whole.append, mesh=mesh)
    dncnn.train(cfg, data_dir, str(root / "dncnn_parts"), progress=parts.append, mesh=mesh, max_steps=1)
    assert len(parts) == 1
    dncnn.train(cfg, data_dir, str(root / "dncnn_parts"), progress=parts.append, mesh=mesh)
    assert len(whole) == cfg.dncnn_steps == 2 and parts == whole
    a, b = (denoiser_checkpoint.load(str(root / d / "dncnn"), dncnn.KIND)[0] for d in ("dncnn_whole", "dncnn_parts"))
    assert _leaves_equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# The shipped checkpoint (pgla_jax/assets/lenet28) on real protected gradients: what the README's table reports.
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def protected_digits(lenet, mnist):
    """Two MNIST digits' clean and protected gradients on the DLG LeNet: Gaussian noise, paper calibration, ε = 1
    (σ = 0.0869, t* = 24), the setting where the README's table has the diffusion model far above `none`."""
    graphdef, params = lenet
    cfg = ProtectionConfig()
    plan = protections.plan(cfg, 1.0, 1)
    x, y = data.pick(mnist, 2, seed=0)
    cases = []
    for i in range(2):
        xi, yi = jnp.asarray(x[i : i + 1]), fl.one_hot(jnp.asarray(y[i : i + 1]), 10)
        g_sent = protections.protected_grad(graphdef, params, xi, yi, jax.random.key(100 + i), cfg=cfg, noise_plan=plan)
        cases.append((fl.batch_grad(graphdef, params, xi, yi), g_sent))
    return plan, cases


def _leaves_equal(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_identity_and_wiener_rows_are_what_they_say(lenet, protected_digits):
    """`none` is the protected gradient bit for bit; `wiener` is `baselines.wiener` on the codec's image of it, told
    the noise's variance σ² (not σ)."""
    _, params = lenet
    plan, cases = protected_digits
    dens = denoisers.load(None, codec.make_codec(params, "image2d", 4))
    g, g_sent = cases[0]
    out, t_star = dens.run("none", g_sent, plan, jax.random.key(1))
    assert t_star is None and _leaves_equal(out, g_sent)
    out, _ = dens.run("wiener", g_sent, plan, jax.random.key(1))
    want = dens.codec.decode(baselines.wiener(dens.codec.encode(g_sent), jnp.float32(plan.std**2)))
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    assert not _leaves_equal(out, g_sent)


def test_shipped_denoiser_cleans_a_real_protected_gradient(lenet, protected_digits):
    """Gradient cosine to the clean gradient, per digit. Measured on these two digits: none 0.9217 / 0.9385, DnCNN
    0.9232 / 0.9396, ancestral 0.9747 / 0.9773, DDIM 0.9830 / 0.9857 (the README's 8-digit means: 0.929, 0.930,
    0.973, 0.982)."""
    _, params = lenet
    plan, cases = protected_digits
    dens = denoisers.load(denoiser_checkpoint.shipped_path(), codec.make_codec(params, "image2d", 4))
    assert "dncnn" in dens.names and dens.cfg.unet.cond_channels == 1
    for g, g_sent in cases:
        cos, t_stars = {}, {}
        for name in ("none", "dncnn", "diffusion", "diffusion_ddim", *denoisers.PRIOR):
            g_hat, t_stars[name] = dens.run(name, g_sent, plan, jax.random.key(1))
            assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(g_hat)), name
            cos[name] = float(metrics.grad_cosine(g_hat, g))
        print({k: round(v, 4) for k, v in cos.items()})
        assert t_stars["diffusion"] == t_stars["diffusion_ddim"] == 24
        assert cos["diffusion_ddim"] >= cos["none"] + 0.03, cos  # measured +0.061 / +0.047
        assert cos["diffusion"] >= cos["none"] + 0.02, cos  # measured +0.053 / +0.039
        assert cos["dncnn"] >= cos["none"] - 0.002, cos  # measured +0.0015 / +0.0011
        # The Gaussian prior of the same surrogate gradients (the target: ≥ 0.99): measured ancestral / DDIM / one-shot
        # 0.9932 / 0.9953 / 0.9944 and 0.9954 / 0.9970 / 0.9963.
        assert all(t_stars[n] == 24 for n in denoisers.PRIOR)
        assert cos["prior_ddim"] >= 0.99 and cos["prior_oneshot"] >= 0.99, cos
        assert cos["prior"] >= cos["diffusion_ddim"] + 0.005, cos


@pytest.mark.slow
def test_training_extends_to_more_steps(tiny_run):
    from pgla_jax.denoise import loop

    cfg, data, mesh, root, _ = tiny_run
    more = []
    out = loop.train(dataclasses.replace(cfg, steps=6), data, str(root / "full"), progress=more.append, mesh=mesh,
                      extend=True)
    assert len(more) == 2 and all(np.isfinite(more))
    assert denoiser_checkpoint.load(out)[2]["provenance"]["steps"] == 6
