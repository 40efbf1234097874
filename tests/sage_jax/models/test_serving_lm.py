"""The serving form (`sage_jax.models.serving_lm`): feature-major layers give the canonical decoder's outputs, on one
device and sharded over a data × fsdp × model mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import sharding
from sage_jax.models import serving_lm


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
    fused = serving_lm.fuse_layer(cfg, p)
    serve = serving_lm.serving_layer(fused)
    assert set(serve) == {"attn_norm", "mlp_norm", "qkv", "o", "gate_up", "down", "bqkv"}
    for a, b in (("wqkv", "qkv"), ("wo", "o"), ("w_gate_up", "gate_up"), ("w_down", "down")):
        np.testing.assert_array_equal(np.asarray(fused[a]).T, np.asarray(serve[b]))
    assert serving_lm.serving_layer(serve) is serve


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


def test_forward_without_write_sees_the_same_and_returns_the_rows_it_would_write(tiny_lm):
    serve = tiny_lm(2).serving()
    cfg = serve.cfg
    b, p, t, capacity = 2, 5, 4, 16
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, p)), jnp.int32)
    slots = jnp.arange(capacity)
    cache = serve.init_cache(b, capacity)
    # Garbage in the slots the new tokens will use: with write=False they must stay invisible.
    cache = cache.replace(k=tuple(c.at[:, p:].set(7.0) for c in cache.k),
                          v=tuple(c.at[:, p:].set(-3.0) for c in cache.v))
    _, cache = serve.forward(prompt, jnp.broadcast_to(jnp.arange(p), (b, p)),
                             jnp.broadcast_to(slots[None, None] <= jnp.arange(p)[None, :, None], (b, p, capacity)),
                             cache, jnp.zeros((b,), jnp.int32))
    # A small tree after the prompt (token j sees the prompt, itself and token 0), row 1 one slot further on.
    start = jnp.asarray([p, p + 1], jnp.int32)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    rel = slots[None, None, :] - start[:, None, None]
    j = jnp.arange(t)[None, :, None]
    mask = (slots[None, None, :] < p) | (rel == 0) | (rel == j)
    positions = jnp.broadcast_to(p + jnp.minimum(jnp.arange(t), 1), (b, t))
    h_w, written = serve.forward(tokens, positions, mask, cache, start)
    h_n, rows = serve.forward(tokens, positions, mask, cache, start, write=False)
    # The two forwards add the same float32 terms in different orders (one softmax over cache and new keys kept
    # apart): about 1e-5 apart on some CPUs.
    np.testing.assert_allclose(h_n, h_w, rtol=1e-5, atol=5e-5)
    assert rows.k.shape == rows.v.shape == (serve.n_layers, b, t, cfg.n_kv_heads, cfg.head_dim)
    for c_new, r in zip(written.k + written.v, tuple(rows.k) + tuple(rows.v)):
        for i in range(b):
            s = int(start[i])
            np.testing.assert_allclose(r[i], c_new[i, s: s + t], rtol=1e-5, atol=1e-5)
    # commit writes the chosen rows (here the root and token 2 or 3) right after each row's committed prefix.
    path = jnp.asarray([[0, 2], [0, 3]], jnp.int32)
    done = cache.commit(rows, path, start)
    for c_old, c_done, r in zip(cache.k + cache.v, done.k + done.v, tuple(rows.k) + tuple(rows.v)):
        for i in range(b):
            s = int(start[i])
            np.testing.assert_array_equal(c_done[i, s: s + 2], r[i, np.asarray(path[i])])
            np.testing.assert_array_equal(c_done[i, :s], c_old[i, :s])
            np.testing.assert_array_equal(c_done[i, s + 2:], c_old[i, s + 2:])


@pytest.mark.parametrize("heads,kv_heads,model_axis,groups", [(8, 4, 4, (4, 4)), (8, 2, 4, (1, 4)),
                                                               (6, 2, 4, (1, 4))])
def test_placed_model_serves_tensor_parallel_with_two_all_reduces_a_layer(devices, rel_err, heads, kv_heads,
                                                                          model_axis, groups):
    """On a mesh, `Decoder.serving` lays the fused qkv / gate|up rows out in one group per `model` shard
    (`serving_lm.Groups`): every device then holds whole heads and matching gate / up rows, and a layer's forward
    communicates only through its two all-reduces (after the output projection and after the MLP). Where the kv
    heads are not cut like the query heads (2 kv heads on 4 shards) or the query heads are not cut at all (6 on 4),
    the fused qkv stays whole on every device. Either way the output is the unplaced model's."""
    import re

    from flax import nnx

    from sage_jax.models import layers
    from sage_jax.models.config import LMConfig
    from sage_jax.models.decoder import Decoder

    cfg = LMConfig.tiny(n_layers=2, n_heads=heads, n_kv_heads=kv_heads, head_dim=8, d_model=32, mlp_dim=64,
                        vocab_size=96, qkv_bias=True)
    model = Decoder(cfg, rngs=nnx.Rngs(3))
    b, t = 2, 5
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (b, t)), jnp.int32)

    def run(serve, tokens):
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        hidden, _ = serve.forward(tokens, pos, layers.causal_mask(t, jnp.zeros((b,), jnp.int32)))
        return hidden

    ref = jax.jit(run)(model.serving(), tokens)
    mesh = sharding.make_mesh(data=8 // model_axis, model=model_axis, devices=devices)
    with sharding.use(mesh, "inference"):
        placed = sharding.init_sharded(lambda: Decoder(cfg, rngs=nnx.Rngs(3)))
        serve = placed.serving()
        assert serve.groups == groups
        compiled = jax.jit(run).lower(serve, tokens).compile()
        out = compiled(serve, tokens)
    assert rel_err(out, ref) < 1e-5
    hlo = compiled.as_text()
    count = lambda op: len(re.findall(rf"= \S+ {op}(-start)?\(", hlo))  # noqa: E731
    if groups[0] > 1:  # only the vocab-cut embedding lookup adds an all-reduce of its own
        assert count("all-reduce") == 2 * cfg.n_layers + 1, count("all-reduce")
    assert count("collective-permute") == count("all-to-all") == 0


def test_decode_steps_take_the_skinny_kernel_where_it_runs_and_agree_with_xla(tiny_lm):
    """`LMConfig.matmul="auto"`: a few-token cache-reading forward and its LM head run the skinny CPU kernel
    (cpu_kernels/skinny_matmul), a prefill-sized one and `matmul="xla"` XLA's dot; the outputs agree."""
    from cpu_kernels.skinny_matmul import build

    if not build.prepare():
        pytest.skip(f"kernel unavailable: {build.reason()}")
    for serve in (tiny_lm(3).serving(), tiny_lm(3, tie_embeddings=True).serving()):
        _check_kernel_use(serve, build.TARGET)


def _check_kernel_use(serve, target):
    assert serve.cfg.matmul == "auto"

    def run(model, t):
        tokens, positions, mask, write_pos = _inputs(model.cfg, b=1, t=t)

        @jax.jit
        def fwd(model, tokens):
            hidden, _ = model.forward(tokens, positions, mask, model.init_cache(1, mask.shape[-1]), write_pos)
            return model.head(hidden)

        return np.asarray(fwd(model, tokens)), fwd.lower(model, tokens).as_text()

    for t in (1, 3):
        auto, text = run(serve, t)
        # qkv, o, gate|up, down; a tied LM head too (an untied one is stored [D, V], XLA's)
        assert text.count(target) == 4 * serve.n_layers + (serve.lm_head is None)
        xla, text = run(serve.with_matmul("xla"), t)
        assert target not in text
        np.testing.assert_allclose(auto, xla, rtol=1e-5, atol=1e-4)
    from cpu_kernels.skinny_matmul import MAX_COLUMNS

    _, text = run(serve, MAX_COLUMNS + 1)  # past `MAX_COLUMNS`: XLA's GEMM
    assert target not in text
