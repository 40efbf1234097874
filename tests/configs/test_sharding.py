import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import sharding


class Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.5)
        self.embed = nnx.Param(init(rngs.params(), (16, 8)), axes=("vocab", "embed"))
        self.w1 = nnx.Param(init(rngs.params(), (8, 16)), axes=("embed", "mlp"))
        self.w2 = nnx.Param(init(rngs.params(), (16, 8)), axes=("mlp", "embed"))
        self.q = nnx.Param(init(rngs.params(), (8, 4, 2)), axes=("embed", "heads", "head_dim"))
        self.kv = nnx.Param(init(rngs.params(), (8, 3, 2)), axes=("embed", "kv_heads", "head_dim"))
        self.steps = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, ids):
        x = self.embed[...][ids]
        x = sharding.shard(x, ("batch", "seq", "embed"))
        h = jax.nn.gelu(x @ self.w1[...])
        h = sharding.shard(h, ("batch", "seq", "mlp"))
        x = x + h @ self.w2[...]
        q = jnp.einsum("BTD,DNH->BTNH", x, self.q[...])
        kv = jnp.einsum("BTD,DKH->BTKH", x, self.kv[...])
        return x @ self.embed[...].T + q.sum((-1, -2))[..., None] + kv.mean((-1, -2))[..., None]


EXPECTED = {
    "train": {"embed": ("model", "fsdp"), "w1": ("fsdp", "model"), "w2": ("model", "fsdp"),
              "q": ("fsdp", "model", None), "kv": ("fsdp", None, None), "steps": ()},
    "inference": {"embed": ("model", None), "w1": (None, "model"), "w2": ("model", None),
                  "q": (None, "model", None), "kv": (None, None, None), "steps": ()},
}


def _norm(spec, ndim):
    t = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return t


def _loss(model, ids, labels):
    return optax.softmax_cross_entropy_with_integer_labels(model(ids), labels).mean()


def _train_step(graphdef, state, ids, labels):
    model = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(_loss)(model, ids, labels)
    params = nnx.state(model, nnx.Param)
    new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    nnx.update(model, new)
    return loss, nnx.state(model)


@pytest.mark.parametrize("kind", ["train", "inference"])
def test_parameters_follow_rules_and_sharded_step_matches(kind, devices):
    mesh = sharding.make_mesh(data=2, fsdp=2, model=2)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 16, (8, 4)))
    labels = jnp.asarray(rng.integers(0, 16, (8, 4)))

    # Reference: one device, no mesh.
    ref_model = Tiny(nnx.Rngs(0))
    gd, ref_state = nnx.split(ref_model)
    ref_loss, ref_new = jax.jit(_train_step, static_argnums=0)(gd, ref_state, ids, labels)

    with sharding.use(mesh, kind):
        model = sharding.init_sharded(lambda: Tiny(nnx.Rngs(0)))
        for name, want in EXPECTED[kind].items():
            arr = getattr(model, name).get_value()
            assert _norm(arr.sharding.spec, arr.ndim) == _norm(want, arr.ndim), (kind, name, arr.sharding.spec)
            assert arr.sharding.mesh.shape == mesh.shape
        gd, state = nnx.split(model)
        batch_sh = sharding.named_sharding(("batch", "seq"), ids.shape)
        ids_s, labels_s = jax.device_put(ids, batch_sh), jax.device_put(labels, batch_sh)
        assert len(ids_s.sharding.device_set) == 8
        loss, new = jax.jit(_train_step, static_argnums=0)(gd, state, ids_s, labels_s)

    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref_new), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_logical_to_spec_rules():
    # A mesh axis is used once per spec: batch takes data+fsdp, embed then gets nothing.
    spec = sharding.logical_to_spec(("batch", "embed"), sharding.TRAIN_RULES)
    assert tuple(spec) == (("data", "fsdp"), None)
    assert tuple(sharding.logical_to_spec(("embed", "mlp"), sharding.INFERENCE_RULES)) == (None, "model")
    with pytest.raises(ValueError, match="unknown logical axis 'nope'"):
        sharding.logical_to_spec(("nope",), sharding.TRAIN_RULES)


def test_shard_is_noop_without_mesh():
    x = jnp.ones((2, 3))
    assert sharding.shard(x, ("batch", "embed")) is x


def test_mesh_shape():
    assert sharding.mesh_shape(8) == (8, 1, 1)
    assert sharding.mesh_shape(8, data=-1, model=2) == (4, 1, 2)
    assert sharding.mesh_shape(8, data=2, fsdp=2, model=2) == (2, 2, 2)
    with pytest.raises(ValueError):
        sharding.mesh_shape(8, data=3)
    with pytest.raises(ValueError):
        sharding.mesh_shape(8, data=-1, fsdp=-1)


def test_make_mesh_axis_types(devices):
    mesh = sharding.make_mesh(model=2)
    assert mesh.axis_names == sharding.MESH_AXES
    assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "model": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_initialize_distributed_single_host(monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")
    assert sharding.initialize_distributed() is False


def test_map_shards_runs_per_device_and_replicates_what_does_not_divide(devices):
    """A function that sees only its shard (a mean over the split axis) shows where the cut fell."""
    centre = lambda x: x - x.mean(axis=1, keepdims=True)  # noqa: E731
    x = jnp.arange(24.0).reshape(4, 6) ** 1.5
    np.testing.assert_allclose(sharding.map_shards(centre, [("batch", "heads")], ("batch", "heads"), x), centre(x))
    with sharding.use(sharding.make_mesh(data=2, model=2, devices=devices[:4]), "inference"):
        halves = sharding.map_shards(centre, [("batch", "heads")], ("batch", "heads"), x)
        odd = jnp.arange(20.0).reshape(4, 5) ** 1.5  # 5 heads on a 2-way axis: replicated
        whole = sharding.map_shards(centre, [("batch", "heads")], ("batch", "heads"), odd)
        # A name is cut alike in every array: 5 does not divide, so the 6 are not cut either.
        pair = sharding.map_shards(lambda a, b: centre(a) + b.sum(), [("batch", "heads"), (None, "heads")],
                                   ("batch", "heads"), x, odd[:1])
        with pytest.raises(ValueError, match="unknown logical axis"):
            sharding.map_shards(centre, [("batch", "rows")], ("batch", "rows"), x)
    np.testing.assert_allclose(halves, jnp.concatenate([centre(x[:, :3]), centre(x[:, 3:])], 1), rtol=1e-6)
    np.testing.assert_allclose(whole, centre(odd), rtol=1e-6)
    np.testing.assert_allclose(pair, centre(x) + odd[:1].sum(), rtol=1e-6)
