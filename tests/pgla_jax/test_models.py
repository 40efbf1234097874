import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pgla_jax.config import VictimConfig
from pgla_jax.models import apply, split_victim


def _n_params(state):
    return sum(x.size for x in jax.tree.leaves(state))


def test_dlg_lenet_matches_the_paper(lenet):
    graphdef, params = lenet
    assert _n_params(params) == 13426  # 312 + 3612 + 3612 + 5890, as in the paper's 120×120 codec
    leaves = np.concatenate([np.ravel(x) for x in jax.tree.leaves(params)])
    assert leaves.min() >= -0.5 and leaves.max() <= 0.5 and leaves.min() < -0.49 and leaves.max() > 0.49
    cifar100 = split_victim(VictimConfig(image_shape=(32, 32, 3), num_classes=100))[1]
    assert _n_params(cifar100) == 85036


@pytest.mark.parametrize("kind,shape", [("lenet", (28, 28, 1)), ("lenet", (32, 32, 3)), ("mlp", (28, 28, 1)),
                                        ("convnet", (32, 32, 3)), ("resnet", (32, 32, 3))])
def test_victims_are_per_example_functions(kind, shape):
    graphdef, params = split_victim(VictimConfig(kind=kind, image_shape=shape))
    x = jax.random.uniform(jax.random.key(0), (3, *shape))
    fwd = jax.jit(apply, static_argnums=0)
    out = fwd(graphdef, params, x)
    assert out.shape == (3, 10) and bool(jnp.all(jnp.isfinite(out)))
    # No batch coupling (no BatchNorm): example 1 alone gives the same logits as inside the batch.
    np.testing.assert_allclose(fwd(graphdef, params, x[1:2])[0], out[1], rtol=1e-5, atol=1e-5)
    # The output depends on the input (the gradient-leakage premise).
    assert float(jnp.abs(out[0] - out[2]).max()) > 1e-4
