import jax
import jax.numpy as jnp
import numpy as np

from configs import sharding
from pgla_jax import data, fl


def _close(a, b, **kw):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


def _batch(mnist, n):
    # Labels cycle 0..9 (the file is sorted by label; a same-label batch would saturate the net in one step).
    x, y = data.pick(mnist, n, seed=n)
    return jnp.asarray(x), fl.one_hot(jnp.asarray(y), 10)


def test_per_example_grads_average_to_the_batch_grad(lenet, mnist):
    graphdef, params = lenet
    x, y = _batch(mnist, 4)
    per = fl.per_example_grads(graphdef, params, x, y)
    assert all(g.shape[0] == 4 for g in jax.tree.leaves(per))
    _close(jax.tree.map(lambda g: g.mean(0), per), fl.batch_grad(graphdef, params, x, y), rtol=1e-4, atol=1e-6)
    # ... and the examples really differ (each carries its own image).
    leaf = jax.tree.leaves(per)[0]
    assert float(jnp.abs(leaf[0] - leaf[1]).max()) > 1e-3


def test_fedavg_with_one_local_step_is_fedsgd(lenet, mnist):
    graphdef, params = lenet
    x, y = _batch(mnist, 8)
    xc, yc = x.reshape(4, 2, 28, 28, 1), y.reshape(4, 2, 10)
    sgd = fl.fedsgd_round(graphdef, params, xc, yc, lr=0.01)
    avg = fl.fedavg_round(graphdef, params, xc[:, None], yc[:, None], lr=0.01)
    _close(sgd, avg, rtol=1e-4, atol=1e-6)
    # FedSGD over equal clients = one SGD step on the union of their data.
    manual = jax.tree.map(lambda p, g: p - 0.01 * g, params, fl.batch_grad(graphdef, params, x, y))
    _close(sgd, manual, rtol=1e-4, atol=1e-6)


def test_fedavg_local_steps_move_further_than_one(lenet, mnist):
    graphdef, params = lenet
    x, y = _batch(mnist, 8)
    xc, yc = x.reshape(4, 1, 2, 28, 28, 1), y.reshape(4, 1, 2, 10)
    one = fl.fedavg_client_updates(graphdef, params, xc, yc, 0.01)
    # Three local steps over the same client batch (S = 3): the update keeps going downhill.
    three = fl.fedavg_client_updates(graphdef, params, jnp.tile(xc, (1, 3, 1, 1, 1, 1)), jnp.tile(yc, (1, 3, 1, 1)),
                                     0.01)
    n3 = float(jnp.sqrt(sum(jnp.sum(u[0] ** 2) for u in jax.tree.leaves(three))))
    n1 = float(jnp.sqrt(sum(jnp.sum(u[0] ** 2) for u in jax.tree.leaves(one))))
    assert n3 > 1.5 * n1


def test_weighted_aggregation():
    upd = {"w": jnp.array([[1.0, 1.0], [4.0, 0.0]])}
    out = fl.aggregate(upd, jnp.array([3.0, 1.0]))
    np.testing.assert_allclose(out["w"], [1.75, 0.75])
    np.testing.assert_allclose(fl.aggregate(upd)["w"], [2.5, 0.5])


def test_fedsgd_is_data_parallel_over_the_mesh(lenet, mnist, devices):
    graphdef, params = lenet
    x, y = _batch(mnist, 16)
    xc, yc = x.reshape(8, 2, 28, 28, 1), y.reshape(8, 2, 10)
    plain = fl.fedsgd_client_grads(graphdef, params, xc, yc)
    mesh = sharding.make_mesh()
    with sharding.use(mesh, "train"):
        xs = jax.device_put(xc, sharding.named_sharding(("clients", "batch", None, None, None), xc.shape))
        par = fl.fedsgd_client_grads(graphdef, params, xs, yc)
        # The per-client gradients stay split over the 8 devices, one client each.
        leaf = jax.tree.leaves(par)[0]
        assert len({s.device for s in leaf.addressable_shards}) == 8
        assert leaf.addressable_shards[0].data.shape[0] == 1
    _close(plain, par, rtol=1e-4, atol=1e-6)
