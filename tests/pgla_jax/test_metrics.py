import jax
import jax.numpy as jnp
import numpy as np
import pytest
from skimage.metrics import structural_similarity

from pgla_jax import metrics


def test_psnr_states_its_data_range():
    a = jnp.zeros((2, 4, 4, 1))
    b = a + jnp.asarray([0.1, 0.01]).reshape(2, 1, 1, 1)
    np.testing.assert_allclose(metrics.psnr(a, b, data_range=1.0), [20.0, 40.0], rtol=1e-5)
    # The released code's range-255 on [0, 1] images inflates PSNR by 20·log10(255) ≈ 48.13 dB.
    np.testing.assert_allclose(metrics.psnr(a, b, data_range=255.0) - metrics.psnr(a, b), 48.1308, rtol=1e-4)
    np.testing.assert_allclose(metrics.mse(a, b), [0.01, 1e-4], rtol=1e-5)


@pytest.mark.parametrize("shape", [(28, 28, 1), (32, 32, 3)])
def test_ssim_matches_skimage(shape):
    rng = np.random.default_rng(0)
    a = rng.uniform(size=(2, *shape)).astype(np.float32)
    b = np.clip(a + 0.2 * rng.normal(size=a.shape), 0, 1).astype(np.float32)
    ours = np.asarray(metrics.ssim(jnp.asarray(a), jnp.asarray(b), data_range=1.0))
    ref = [structural_similarity(a[i], b[i], data_range=1.0, gaussian_weights=True, sigma=1.5,
                                 use_sample_covariance=False, channel_axis=-1) for i in range(2)]
    np.testing.assert_allclose(ours, ref, atol=2e-4)
    np.testing.assert_allclose(metrics.ssim(jnp.asarray(a), jnp.asarray(a)), [1.0, 1.0], atol=1e-5)


def test_match_order_and_label_accuracy():
    x = jax.random.uniform(jax.random.key(1), (4, 8, 8, 1))
    perm = np.array([2, 0, 3, 1])
    rec = x[perm] + 0.01
    p = metrics.match_order(rec, x)
    np.testing.assert_allclose(rec[p], x + 0.01, atol=1e-6)
    assert float(metrics.label_accuracy(jnp.array([3, 1, 2]), jnp.array([1, 2, 3]))) == 1.0
    assert float(metrics.label_accuracy(jnp.array([3, 3, 2]), jnp.array([1, 2, 3]))) == pytest.approx(2 / 3)


def test_gradient_metrics():
    g = {"w": jnp.array([[1.0, -2.0], [0.5, 0.0]]), "b": jnp.array([0.25])}
    assert float(metrics.grad_cosine(jax.tree.map(lambda x: 3 * x, g), g)) == pytest.approx(1.0, abs=1e-6)
    assert float(metrics.grad_cosine(jax.tree.map(jnp.negative, g), g)) == pytest.approx(-1.0, abs=1e-6)
    off = jax.tree.map(lambda x: x + 0.1, g)  # MSE 0.01, peak max|g| = 2 → 10·log10(4 / 0.01) = 26.02 dB
    assert float(metrics.grad_psnr(off, g)) == pytest.approx(26.0206, abs=1e-3)
    norm = float(np.sqrt(1 + 4 + 0.25 + 0.0625))
    assert float(metrics.grad_rel_l2(off, g)) == pytest.approx(np.sqrt(5 * 0.01) / norm, rel=1e-5)
