"""`Visibility` (the decoding loops' attention masks in prefix + window form) and the attention switch of the
serving forward: `LM.forward` with `cfg.attention == "pallas"` (the tree-attention kernel, interpreted on CPU)
equals the XLA path for a verify (cache read only), a draft tree level (window wider than the forward, earlier
levels read back from the cache) and a catch-up chain, with rows of different lengths, and never reads a cache
slot it must not see."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import sharding
from pallas_kernels.tree_attention.reference import KERNEL_HEAD_DIMS
from sage_jax.decoding.tree import causal_visibility
from sage_jax.models import LMConfig
from sage_jax.models.config import PALLAS_HEAD_DIMS
from sage_jax.models.visibility import Visibility

CAP = 48
B = 4


def test_dense_chain_is_the_causal_mask_and_first_keeps_the_window():
    start, pad = jnp.asarray([5, 9, 20, 0]), jnp.asarray([0, 2, 7, 0])
    vis = Visibility.chain(start, pad, 4)
    slots = start[:, None] + jnp.arange(4)[None]
    np.testing.assert_array_equal(vis.dense(CAP), causal_visibility(slots, pad, CAP))
    np.testing.assert_array_equal(vis.first(2).dense(CAP), causal_visibility(slots[:, :2], pad, CAP))
    assert vis.first(2).window.shape == (B, 2, 4)


def test_attention_is_a_run_choice_checked_against_the_kernels():
    assert PALLAS_HEAD_DIMS == KERNEL_HEAD_DIMS
    cfg = LMConfig.tiny(head_dim=64)
    assert "attention" not in cfg.to_json()
    assert LMConfig.from_json({**cfg.to_json(), "attention": "pallas"}) == cfg  # never restored from a checkpoint
    assert cfg.replace(attention="pallas").attention == "pallas"
    with pytest.raises(ValueError, match="head dims 64 and 128"):
        LMConfig.tiny(head_dim=16, attention="pallas")
    with pytest.raises(ValueError, match="attention must be one of xla, pallas"):
        cfg.replace(attention="flash")


def _setup(tiny_lm, poison: float):
    """A tiny 64-head-dim model in both attention modes and a cache whose slots are finite garbage where visible
    to nothing, or `poison` (NaN) there: rows of different prefixes [pad, start)."""
    model = tiny_lm(0, head_dim=64, n_layers=2)
    xla = model.serving()
    pallas = xla.with_attention("pallas")
    rng = np.random.default_rng(0)
    start, pad = jnp.asarray([9, 17, 30, 12], jnp.int32), jnp.asarray([0, 3, 11, 12], jnp.int32)
    cache = xla.init_cache(B, CAP)
    slot = np.arange(CAP)[None, :, None, None]
    seen = (slot >= np.asarray(pad)[:, None, None, None]) & (slot < np.asarray(start)[:, None, None, None])

    def fill(a):
        x = rng.normal(size=a.shape).astype(np.float32)
        return jnp.asarray(np.where(seen, x, poison))

    cache = cache.replace(k=tuple(map(fill, cache.k)), v=tuple(map(fill, cache.v)))
    tokens = jnp.asarray(rng.integers(0, model.cfg.vocab_size, (B, 5)), jnp.int32)
    return xla, pallas, cache, tokens, start, pad


def _tree_window(t: int, u: int, offset: int) -> jnp.ndarray:
    """[B, t, u]: query i sees window slots {0, i // 2 + 1 .. } like a small tree whose node i sits at
    offset + i (it sees the root, itself, and one earlier level), different per row."""
    rng = np.random.default_rng(1)
    w = rng.random((B, t, u)) < 0.4
    w[:, :, 0] = True
    for i in range(t):
        w[:, i, offset + i] = True
        w[:, i, offset + i + 1:] = False
    return jnp.asarray(w)


@pytest.mark.parametrize("write", [False, True], ids=["verify", "tree_level"])
def test_pallas_forward_equals_xla(tiny_lm, write, rel_err, devices):
    xla, pallas, cache, tokens, start, pad = _setup(tiny_lm, poison=0.0)
    t = tokens.shape[1]
    # Verify: the window is the forward's own tokens. A tree level: the window is wider and this forward's tokens
    # sit at window offset 3 (earlier levels' keys are read back from the cache).
    offset, u = (0, t) if not write else (3, 11)
    vis = Visibility(pad=pad, start=start, window=_tree_window(t, u, offset))
    positions = (start - pad)[:, None] + jnp.arange(t)[None]
    write_pos = start + offset

    def run(model):
        return jax.jit(lambda m, c: m.forward(tokens, positions, vis, c, write_pos, write=write))(model, cache)

    (h_x, kv_x), (h_p, kv_p) = run(xla), run(pallas)
    # Sharded over rows and heads (the kernel runs per device), and with the kv heads too few for the model axis.
    for shape in ((2, 1, 2), (1, 1, 4)):
        with sharding.use(sharding.make_mesh(*shape, devices=devices[: math.prod(shape)]), "inference"):
            h_s, kv_s = run(pallas)
        assert rel_err(h_s, h_p) < 1e-5 and rel_err(kv_s.k, kv_p.k) < 1e-5, shape  # sharded sums reorder
    # float32, only the order of the softmax sums differs (online over blocks vs one pass); the tiny model's
    # scaled-up weights make activations of ~50, so the error is taken relative to that scale.
    assert rel_err(h_p, h_x) < 1e-5
    for a, b in zip(jax.tree.leaves(kv_p), jax.tree.leaves(kv_x), strict=True):
        assert rel_err(a, b) < 1e-5


def test_pallas_forward_never_reads_hidden_slots(tiny_lm):
    """NaN in every slot no query may see (before pad, past the prefix and the window) leaves the kernel path
    finite and equal to the clean run; the XLA path multiplies them by zero and turns NaN."""
    clean = _setup(tiny_lm, poison=0.0)
    xla, pallas, cache, tokens, start, pad = _setup(tiny_lm, poison=np.nan)
    t = tokens.shape[1]
    vis = Visibility.chain(start, pad, t)
    positions = (start - pad)[:, None] + jnp.arange(t)[None]
    h_clean, _ = pallas.forward(tokens, positions, vis, clean[2], start)
    h_nan, kv = pallas.forward(tokens, positions, vis, cache, start)
    assert np.all(np.isfinite(h_nan))
    np.testing.assert_allclose(h_nan, h_clean, rtol=1e-6, atol=1e-6)
    h_xla, _ = xla.forward(tokens, positions, vis, cache, start)
    assert not np.all(np.isfinite(h_xla))  # the poison is real: the dense path does read those slots


def test_the_switch_runs_the_kernel(tiny_lm, monkeypatch):
    """Guards against a silent fall back to XLA: the kernel is traced under "pallas" and never under "xla"."""
    import pallas_kernels.tree_attention as kernels

    calls = []
    real = kernels.tree_attention
    monkeypatch.setattr(kernels, "tree_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    xla, pallas, cache, tokens, start, pad = _setup(tiny_lm, poison=0.0)
    vis = Visibility.chain(start, pad, tokens.shape[1])
    positions = (start - pad)[:, None] + jnp.arange(tokens.shape[1])[None]
    xla.forward(tokens, positions, vis, cache, start)
    assert not calls
    pallas.forward(tokens, positions, vis, cache, start)
    assert len(calls) == pallas.n_layers
    with pytest.raises(ValueError, match="window must be the 5 new tokens"):
        pallas.forward(tokens, positions, Visibility.chain(start, pad, 7).first(5), cache, start, write=False)


def _abstract_params(cfg, mesh=None):
    from flax import nnx

    from sage_jax.models.decoder import Decoder

    _, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    if mesh is None:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nnx.to_pure_dict(state))
    shardings = nnx.to_pure_dict(sharding.state_shardings(state, mesh))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nnx.to_pure_dict(state),
                        shardings)


def _tpu_verify_step(cfg, mesh, b=1, w=26, capacity=1024, mrope=False):
    """`jax.export` for TPU of the speculative step's target forward (the cache read only, the LM head and argmax)
    with the kernel: the `mc_sim_7b_63`-sized tree (root + 25 nodes) over a half-full cache."""
    from sage_jax.decoding.tree import MC_SIM_7B_63
    from sage_jax.models.serving_lm import serving_params

    paths = [()] + list(MC_SIM_7B_63)
    anc = np.asarray([[len(q) <= len(p) and p[: len(q)] == q for q in paths] for p in paths])[:w, :w]
    dt = jnp.dtype(cfg.dtype)
    cache_shape = (b, capacity, cfg.n_kv_heads, cfg.head_dim)

    def step(params, k_cache, v_cache, tokens):
        from sage_jax.models.kv_cache import KVCache

        lm = serving_params(cfg, params)
        start = jnp.full((b,), capacity // 2, jnp.int32)
        vis = Visibility(pad=jnp.zeros((b,), jnp.int32), start=start, window=jnp.broadcast_to(anc, (b, w, w)))
        pos = start[:, None] + jnp.sum(vis.window, -1) - 1
        pos = jnp.stack([pos] * 3, -1) if mrope else pos
        cache = KVCache(k=tuple(k_cache), v=tuple(v_cache))
        with sharding.use(mesh):
            hidden, _ = lm.forward(tokens, pos, vis, cache, start, write=False)
            return jnp.argmax(lm.head(hidden), -1)

    kv = lambda: [jax.ShapeDtypeStruct(cache_shape, dt) for _ in range(cfg.n_layers)]  # noqa: E731
    return jax.export.export(jax.jit(step), platforms=["tpu"])(
        _abstract_params(cfg, mesh), kv(), kv(), jax.ShapeDtypeStruct((b, w), jnp.int32))


def test_the_verify_step_with_the_kernel_lowers_for_tpu_at_smollm2_shapes():
    cfg = LMConfig.smollm2_135m().replace(attention="pallas")
    text = _tpu_verify_step(cfg, None).mlir_module()
    # The Mosaic kernel (a TPU custom call), not its interpreted form, although this host is a CPU.
    assert "tpu_custom_call" in text and "tree_attention_tpu" in text


def test_a_72b_verify_layer_with_the_kernel_lowers_for_an_8_chip_slice():
    """One real-sized Qwen2.5-VL-72B layer (64 query / 8 KV heads, head dim 128, bf16, M-RoPE) tensor-parallel over
    an abstract 8-chip mesh: the kernel runs per chip on its own heads (`map_shards`)."""
    from sage_jax.io import paper_targets

    preset = paper_targets.presets()["qwen2.5-vl-72b+7b"]
    _, vlm_cfg = preset.target.build_config()
    cfg = vlm_cfg.text.replace(n_layers=1, attention="pallas")
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dtype) == (64, 8, 128, "bfloat16")
    exported = _tpu_verify_step(cfg, paper_targets.abstract_mesh(preset.tp), capacity=4096, mrope=True)
    assert exported.nr_devices == preset.tp
    text = exported.mlir_module()
    assert "tpu_custom_call" in text and "sdy.manual_computation" in text
