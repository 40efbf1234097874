"""The serving form (`sage_jax.models.lm`): feature-major layers give the canonical decoder's outputs, on one device
and sharded over a data × fsdp × model mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import sharding
from sage_jax.models import lm


def _inputs(cfg, b=4, t=6, capacity=16):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    causal = jnp.arange(capacity)[None, None, :] <= jnp.arange(t)[None, :, None]
    return tokens, positions, jnp.broadcast_to(causal, (b, t, capacity)), jnp.zeros((b,), jnp.int32)


def test_serving_layer_is_the_transposed_fused_layer_and_idempotent(tiny_lm):
    model = tiny_lm(0, qkv_bias=True)
    cfg = model.cfg
    p = {k: v[...][0] for k, v in vars(model.blocks).items() if hasattr(v, "get_metadata")}
    fused = lm.fuse_layer(cfg, p)
    serve = lm.serving_layer(fused)
    assert set(serve) == {"attn_norm", "mlp_norm", "qkv", "o", "gate_up", "down", "bqkv"}
    for a, b in (("wqkv", "qkv"), ("wo", "o"), ("w_gate_up", "gate_up"), ("w_down", "down")):
        np.testing.assert_array_equal(np.asarray(fused[a]).T, np.asarray(serve[b]))
    assert lm.serving_layer(serve) is serve


@pytest.mark.parametrize("kind", ["inference", "train"])
def test_sharded_serving_forward_matches_one_device(tiny_lm, devices, kind, rel_err):
    model = tiny_lm(1)
    cfg = model.cfg
    tokens, positions, mask, write_pos = _inputs(cfg)
    # The canonical decoder without a cache (scan over stacked layers) is the reference for the serving form.
    ref_logits, ref_hidden, _ = model(tokens, positions, mask[..., : tokens.shape[1]])
    serve = model.serving()

    @jax.jit
    def run(serve, tokens):
        cache = serve.init_cache(tokens.shape[0], mask.shape[-1])
        hidden, _ = serve.forward(tokens, positions, mask, cache, write_pos)
        return hidden, serve.head(hidden)

    hidden, logits = run(serve, tokens)
    np.testing.assert_allclose(hidden, ref_hidden, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-4)
    mesh = sharding.make_mesh(data=2, fsdp=2, model=2, devices=devices)
    with sharding.use(mesh, kind):
        tok_s = jax.device_put(tokens, sharding.named_sharding(("batch", "seq"), tokens.shape))
        hidden_s, logits_s = run(serve, tok_s)
    # Sharded reductions only reorder float32 sums.
    assert rel_err(hidden_s, hidden) < 1e-5 and rel_err(logits_s, logits) < 1e-5
