"""PGLA part 2 maths: gradient codec round trip, the √n identity, the t*(ε) table, and a reverse loop that iterates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pgla_jax import codec, fl, protections
from pgla_jax.denoise import ddpm, sampling

SCHED = ddpm.linear_schedule()


@pytest.fixture(scope="module")
def lenet_grad(mnist, lenet):
    graphdef, params = lenet
    x, y = jnp.asarray(mnist.images[:1]), fl.one_hot(jnp.asarray(mnist.labels[:1]), 10)
    return fl.batch_grad(graphdef, params, x, y)


@pytest.mark.parametrize("layout,shape", [("image2d", (116, 116, 1)), ("vector1d", (13428, 1)),
                                          ("per_layer", (8, 5880))])
def test_codec_round_trip_is_exact(lenet_grad, layout, shape):
    c = codec.make_codec(lenet_grad, layout, multiple=4)
    assert c.size == 13426 and c.shape == shape
    enc = c.encode(lenet_grad)
    assert enc.shape == shape
    back = c.decode(enc)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(lenet_grad), strict=True):
        assert a.shape == b.shape and bool(jnp.array_equal(a, b))
    # Padding holds the mean (the released `channel_deal_3`), and the mask marks exactly the real entries.
    m = c.mask()
    assert float(m.sum()) == 13426
    if layout != "per_layer":
        flat = jnp.concatenate([g.ravel() for g in jax.tree.leaves(lenet_grad)])
        assert np.allclose(np.asarray(enc).ravel()[13426:], float(flat.mean()))
        assert bool(jnp.array_equal(c.unflatten(flat)["fc"]["kernel"], lenet_grad["fc"]["kernel"]))


def test_codec_paper_side_and_bad_side(lenet_grad):
    assert codec.make_codec(lenet_grad, "image2d", 4, side=120).shape == (120, 120, 1)  # the paper's 14,400
    with pytest.raises(ValueError, match="multiple"):
        codec.make_codec(lenet_grad, "image2d", 4, side=118)
    with pytest.raises(ValueError, match="at least"):
        codec.make_codec(lenet_grad, "image2d", 4, side=112)


def test_scaled_protected_gradient_has_the_moments_of_q(lenet_grad):
    """√n(g + M z) ~ q(x_t | g) with ᾱ_t = n: mean √n·g, variance 1 − n; t* is the step where ᾱ crosses n."""
    c = codec.make_codec(lenet_grad, "image2d", 4)
    g = c.encode(lenet_grad)
    m = protections.paper_noise_scale("gaussian", 1.0, 1e-4, 10.0, 1e-3, 1)
    n = ddpm.signal_fraction(m)
    z = jax.random.normal(jax.random.key(0), (64,) + g.shape)
    y = jnp.sqrt(n) * (g[None] + m * z)
    r = np.asarray(y - jnp.sqrt(n) * g[None]).ravel()
    assert abs(r.mean()) < 3 * np.sqrt(1 - n) / np.sqrt(r.size)
    assert abs(r.var() / (1 - n) - 1) < 0.01
    # ... which is q_sample at ᾱ = n, and the released start step brackets n within one β step.
    ti = ddpm.t_index(SCHED, m)
    assert SCHED.alphas_cumprod[ti] < n <= SCHED.alphas_cumprod_prev[ti]
    x_t = ddpm.q_sample(SCHED, g[None], jnp.array([ti]), z[:1])
    assert abs(float(jnp.var(x_t[0] - jnp.sqrt(SCHED.alphas_cumprod[ti]) * g)) / (1 - n) - 1) < 0.1


@pytest.mark.parametrize("eps,gauss,laplace", [(1, 24, 4), (5, 3, 1), (10, 1, 1), (50, 1, 1), (100, 1, 1)])
def test_t_star_reproduces_the_paper_table(eps, gauss, laplace):
    kw = dict(delta=1e-4, clip=10.0, lr=1e-3, m=1)
    m = protections.paper_noise_scale("gaussian", eps, **kw)
    b = protections.paper_noise_scale("laplace", eps, **kw)
    assert ddpm.t_star(SCHED, ddpm.effective_sigma("gaussian", m)) == gauss
    # The released code maps Laplace with b (its bug (d)); the Gaussian of Laplace's median absolute deviation
    # (1.028·b, our default) lands on the same step here; its std √2·b one step or two later.
    assert ddpm.t_star(SCHED, ddpm.effective_sigma("laplace", b, released=True)) == laplace
    assert ddpm.t_star(SCHED, ddpm.effective_sigma("laplace", b)) == laplace
    assert ddpm.t_star(SCHED, ddpm.effective_sigma("laplace", b, laplace="std")) >= laplace


def test_laplace_is_matched_by_the_gaussian_of_its_median_absolute_deviation():
    """σ_eff of Laplace(b) is the σ whose Gaussian has Laplace's median |noise|: checked on samples of both."""
    b = 0.02
    sigma = ddpm.effective_sigma("laplace", b)
    rng = np.random.default_rng(0)
    lap, gau = np.abs(rng.laplace(0.0, b, 400_000)), np.abs(rng.normal(0.0, sigma, 400_000))
    assert np.median(lap) == pytest.approx(np.median(gau), rel=5e-3)
    assert np.std(rng.laplace(0.0, b, 400_000)) == pytest.approx(ddpm.effective_sigma("laplace", b, laplace="std"),
                                                                 rel=5e-3)
    with pytest.raises(ValueError, match="laplace"):
        ddpm.effective_sigma("laplace", b, laplace="kurtosis")


def test_t_star_general_values():
    assert [ddpm.t_star(SCHED, s) for s in (0.05, 0.1, 0.3, 1, 3, 10, 100)] == [12, 28, 89, 260, 476, 675, 955]
    assert ddpm.t_star(SCHED, 1e6) == 1000  # beyond the schedule: start from pure noise


# ---------------------------------------------------------------------------------------------------------------
# The reverse loop, on Gaussian data with the exact ε-predictor (so the right answer is known in closed form).
# ---------------------------------------------------------------------------------------------------------------

MU, S = 0.3, 0.1  # x_0 ~ N(μ, s²) per entry


def exact_eps(params, x, t, cond):
    """E[ε | x_t] for x_0 ~ N(μ, s²): √(1−ᾱ)(x − √ᾱ μ)/(ᾱ s² + 1 − ᾱ); ᾱ linear between grid steps at a
    fractional t (the sampler's convention for its exact start)."""
    table = jnp.asarray(SCHED.alphas_cumprod, jnp.float32)
    ac = jnp.interp(jnp.asarray(t, jnp.float32), jnp.arange(len(table), dtype=jnp.float32), table)
    ac = ac.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.sqrt(1 - ac) * (x - jnp.sqrt(ac) * params["mu"]) / (ac * params["s2"] + 1 - ac)


@pytest.fixture(scope="module")
def gaussian_case():
    ti = 199
    ac = float(SCHED.alphas_cumprod[ti])
    sigma = np.sqrt((1 - ac) / ac)  # the protected-gradient noise whose √n-scaled version sits at step ti
    assert ddpm.t_index(SCHED, sigma * 0.999) == ti
    k0, k1 = jax.random.split(jax.random.key(1))
    x0 = MU + S * jax.random.normal(k0, (1, 64, 64, 1))
    y = x0 + sigma * jax.random.normal(k1, x0.shape)  # the protected observation g'
    post_var = S**2 * (1 - ac) / (ac * S**2 + 1 - ac)  # Var[x_0 | x_t]
    return ti, sigma, x0, y, post_var


def _mse(method, case, max_steps=1000):
    ti, sigma, x0, y, _ = case
    out = sampling.denoise(exact_eps, {"mu": MU, "s2": S**2}, y, jnp.float32(sigma), jnp.int32(ti),
                           jax.random.key(2), schedule=SCHED, method=method, max_steps=max_steps)
    return float(jnp.mean((out - x0) ** 2)), out


def test_ancestral_loop_iterates_and_released_loop_does_not(gaussian_case):
    post_var = gaussian_case[4]
    # A posterior sample is off by Var[x_0|x_t] twice (independent draws): E‖x̂ − x_0‖² = 2·post_var.
    mse, out = _mse("ddpm", gaussian_case)
    assert abs(mse / (2 * post_var) - 1) < 0.1
    assert abs(float(out.std()) / S - 1) < 0.1  # ... and it has the data's spread
    # The released loop applies one t = 0 step to √n·g': the noise of step 199 stays in.
    mse_released, _ = _mse("released", gaussian_case)
    assert mse_released > 10 * mse
    # One-shot x̂_0 is the posterior mean (error post_var).
    mse1, _ = _mse("oneshot", gaussian_case)
    assert abs(mse1 / post_var - 1) < 0.1
    # DDIM (η = 0) follows the probability-flow ODE, for Gaussian data the linear map
    # x_0 = μ + s/√(ᾱs² + 1 − ᾱ)·(x_t − √ᾱ μ): error 2s²(1 − √ᾱ s/√(ᾱs² + 1 − ᾱ)).
    ac = float(SCHED.alphas_cumprod[gaussian_case[0]])
    want = 2 * S**2 * (1 - np.sqrt(ac) * S / np.sqrt(ac * S**2 + 1 - ac))
    assert abs(_mse("ddim", gaussian_case)[0] / want - 1) < 0.1
    # A chain respaced onto 40 steps is still a posterior sample.
    assert abs(_mse("ddpm", gaussian_case, max_steps=40)[0] / (2 * post_var) - 1) < 0.15


@pytest.mark.parametrize("ti", [9, 199])
def test_exact_start_is_the_posterior_mean_between_grid_steps(ti):
    # σ whose n = 1/(1 + σ²) falls halfway between ᾱ of steps ti − 1 and ti: the grid rounds it up to ti.
    ac = SCHED.alphas_cumprod
    n = 0.5 * (ac[ti - 1] + ac[ti])
    sigma = float(np.sqrt(1 / n - 1))
    assert ddpm.t_index(SCHED, sigma) == ti
    k0, k1 = jax.random.split(jax.random.key(3))
    x0 = MU + S * jax.random.normal(k0, (1, 32, 32, 1))
    y = x0 + sigma * jax.random.normal(k1, x0.shape)
    want = MU + S**2 / (S**2 + sigma**2) * (y - MU)  # E[x_0 | g'] in closed form

    def run(method, exact):
        return sampling.denoise(exact_eps, {"mu": MU, "s2": S**2}, y, jnp.float32(sigma), jnp.int32(ti),
                                jax.random.key(4), schedule=SCHED, method=method, exact=exact)

    exact_err = float(jnp.abs(run("oneshot", True) - want).max())
    rounded_err = float(jnp.abs(run("oneshot", False) - want).max())
    assert exact_err < 2e-5
    assert rounded_err > 20 * exact_err  # the grid's extra half step of noise is visible


def test_below_the_first_step_the_observation_is_returned():
    # σ at or below step 1's noise (√(β_1 / (1 − β_1)) ≈ 0.01; the paper's ε ≥ 10): nothing the model was trained on,
    # so the observation is the estimate, bit for bit, for every adaptive method. Just above it the model acts.
    y = MU + S * jax.random.normal(jax.random.key(5), (1, 16, 16, 1))
    edge = float(np.sqrt(1 / SCHED.alphas_cumprod[0] - 1))

    def run(sigma, method):
        return sampling.denoise(exact_eps, {"mu": MU, "s2": S**2}, y, jnp.float32(sigma), jnp.int32(0),
                                jax.random.key(0), schedule=SCHED, method=method)

    for method in ("oneshot", "ddim", "ddpm"):
        for sigma in (1e-3, 0.9 * edge):
            assert bool(sampling.below_first_step(SCHED, jnp.float32(sigma)))
            np.testing.assert_array_equal(np.asarray(run(sigma, method)), np.asarray(y))
        assert not sampling.below_first_step(SCHED, 1.1 * edge)
        assert float(jnp.abs(run(1.1 * edge, method) - y).max()) > 1e-6


def test_one_compilation_for_every_start_step():
    f = sampling.denoise
    y = jnp.zeros((1, 8, 8, 1))
    before = f._cache_size()
    outs = [f(exact_eps, {"mu": MU, "s2": S**2}, y, jnp.float32(0.1), jnp.int32(t), jax.random.key(0),
              schedule=SCHED, method="ddpm") for t in (0, 3, 30)]
    assert f._cache_size() == before + 1
    # t* = 0: a single deterministic step, x̂_0 of the exact model.
    n = 1 / (1 + 0.1**2)
    x = np.sqrt(n) * 0.0
    ac = SCHED.alphas_cumprod[0]
    want = (x - np.sqrt(1 - ac) * float(exact_eps({"mu": MU, "s2": S**2}, jnp.zeros((1, 1)), jnp.array([0]), None)
                                            [0, 0])) / np.sqrt(ac)
    assert np.allclose(np.asarray(outs[0]), want, atol=1e-6)
