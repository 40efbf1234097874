"""The shape-invariant mode (`LMConfig.matmul == "exact"`): a row of a forward has the same bits whether the forward
holds 1, 2, 7 or 64 rows, and a tree verified in one forward computes every node as plain decoding of its path does,
in bfloat16, for the text LMs of each family (Llama; Qwen2, LLaVA-OneVision's; Qwen2.5-VL's, with M-RoPE)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.models import layers
from sage_jax.models.visibility import Visibility

FAMILIES = {"llama": dict(qkv_bias=False, tie_embeddings=True),
            "qwen2": dict(),
            "qwen2_5_vl": dict(rope=dict(mrope_section=(4, 2, 2)))}


def _exact_lm(tiny_lm, family, dtype="bfloat16", seed=0, mesh=None):
    """A tiny LM of `family` in serving form, `dtype`, exact mode; placed on `mesh` by the inference rules when
    given (4 query / 2 kv heads, MLP 128, D 64: a 2-way mesh cuts heads and MLP, a 4- or 8-way one the MLP only)."""
    from configs import sharding
    from sage_jax.models.config import RopeConfig

    kw = dict(FAMILIES[family])
    if "rope" in kw:
        kw["rope"] = RopeConfig(**kw["rope"])
    make = lambda: tiny_lm(seed, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128, n_layers=2, **kw)  # noqa: E731
    if mesh is None:
        lm = make().serving()
    else:
        with sharding.use(mesh, "inference"):
            lm = sharding.init_sharded(make).serving()
    lm = jax.tree.map(lambda x: x.astype(dtype) if x.dtype == jnp.float32 else x, lm)
    return lm.replace(cfg=lm.cfg.replace(dtype=dtype, param_dtype=dtype)).with_matmul("exact")


def _tree(parent: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """A tree's [N, N] ancestor mask (each node sees itself and its ancestors) and depths, from its parents (root -1,
    parents before children)."""
    anc = np.eye(len(parent), dtype=bool)
    for i, par in enumerate(parent):
        if par >= 0:
            anc[i] |= anc[par]
    return anc, anc.sum(1) - 1


def _positions(family, pos):
    return jnp.stack([pos, pos, pos], -1) if family == "qwen2_5_vl" else pos


def _prefilled(lm, family, prompt, capacity):
    b, p = prompt.shape
    cache = lm.init_cache(b, capacity)
    vis = Visibility.chain(jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32), p)
    pos = _positions(family, jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p)))
    _, cache = jax.jit(lambda lm, c: lm.forward(prompt, pos, vis, c, jnp.zeros((b,), jnp.int32)))(lm, cache)
    return cache


@pytest.mark.parametrize("family", [pytest.param("llama", marks=pytest.mark.integration),
                                    pytest.param("qwen2", marks=pytest.mark.integration), "qwen2_5_vl"])
def test_a_row_has_the_same_bits_at_1_2_7_and_64_rows(tiny_lm, family):
    lm = _exact_lm(tiny_lm, family)
    rng = np.random.default_rng(1)
    p, capacity = 9, 80
    prompt = jnp.asarray(rng.integers(2, lm.cfg.vocab_size, (1, p)), jnp.int32)
    cache = _prefilled(lm, family, prompt, capacity)
    others = rng.integers(2, lm.cfg.vocab_size, 63)

    @jax.jit
    def verify(lm, tokens, cache):  # T siblings after the prompt, each seeing the prompt and itself
        t = tokens.shape[1]
        vis = Visibility(pad=jnp.zeros((1,), jnp.int32), start=jnp.full((1,), p, jnp.int32),
                         window=jnp.eye(t, dtype=bool)[None])
        hidden, _ = lm.forward(tokens, _positions(family, jnp.full((1, t), p, jnp.int32)), vis, cache,
                               jnp.full((1,), p, jnp.int32), write=False)
        return lm.head(hidden)

    first = {}
    for t in (1, 2, 7, 64):
        tokens = jnp.asarray([[int(prompt[0, -1]), *others[: t - 1]]], jnp.int32)
        first[t] = np.asarray(verify(lm, tokens, cache)[0, 0])
    for t in (2, 7, 64):
        np.testing.assert_array_equal(first[t], first[1], err_msg=f"row 0 at {t} rows")
    # ... and XLA's own dot does not give that (so the test can fail).
    xla = lm.with_matmul("xla")
    plain = {t: np.asarray(verify(xla, jnp.asarray([[int(prompt[0, -1]), *others[: t - 1]]], jnp.int32),
                                  cache)[0, 0]) for t in (1, 7)}
    assert not np.array_equal(plain[1], plain[7])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_verified_tree_computes_each_node_as_decoding_its_path(tiny_lm, family):
    """Nodes of a tree verified in one forward (the cache only read) against the same tokens decoded one at a time
    along each node's path (each written to the cache first): equal logits, bit for bit."""
    lm = _exact_lm(tiny_lm, family, seed=3)
    rng = np.random.default_rng(2)
    p, capacity = 11, 40
    prompt = jnp.asarray(rng.integers(2, lm.cfg.vocab_size, (1, p)), jnp.int32)
    cache = _prefilled(lm, family, prompt, capacity)
    # A tree of 7 nodes: root 0; children 1, 2; 3 under 1; 4, 5 under 2; 6 under 3.
    parent = [-1, 0, 0, 1, 2, 2, 3]
    anc = np.zeros((7, 7), bool)
    depth = np.zeros(7, int)
    for i, par in enumerate(parent):
        anc[i, i] = True
        if par >= 0:
            anc[i] |= anc[par]
            depth[i] = depth[par] + 1
    tokens = jnp.asarray(rng.integers(2, lm.cfg.vocab_size, (1, 7)), jnp.int32)
    vis = Visibility(pad=jnp.zeros((1,), jnp.int32), start=jnp.full((1,), p, jnp.int32), window=jnp.asarray(anc)[None])
    pos = _positions(family, jnp.asarray(p + depth, jnp.int32)[None])
    hidden, _ = jax.jit(lambda lm, c: lm.forward(tokens, pos, vis, c, jnp.full((1,), p, jnp.int32), write=False))(
        lm, cache)
    tree_logits = np.asarray(lm.head(hidden))[0]

    @jax.jit
    def step(lm, token, at, cache):  # one token at slot `at`, written, seeing [0, at]
        vis = Visibility.chain(jnp.full((1,), at), jnp.zeros((1,), jnp.int32), 1)
        h, cache = lm.forward(token[None, None], _positions(family, jnp.full((1, 1), at)), vis, cache,
                              jnp.full((1,), at))
        return lm.head(h)[0, 0], cache

    for node in range(7):
        path = [i for i in range(7) if anc[node, i]]  # root first (parents precede children)
        c = cache
        for d, i in enumerate(path):
            logits, c = step(lm, tokens[0, i], jnp.int32(p + d), c)
        np.testing.assert_array_equal(np.asarray(logits), tree_logits[node], err_msg=f"node {node}")


def test_tiles_hold_the_rows_they_were_given():
    x = jnp.arange(3 * 5, dtype=jnp.float32).reshape(3, 5)
    y = layers.tiled_rows(lambda t: (t * 2, t.sum(-1)), x)
    np.testing.assert_array_equal(y[0], x * 2)
    np.testing.assert_array_equal(y[1], x.sum(-1))


def test_the_exact_verify_forward_lowers_for_tpu_with_the_mosaic_matmul(tiny_lm):
    """From this CPU host: the exact mode's verify forward exports for TPU, its matmuls the Mosaic kernel."""
    lm = _exact_lm(tiny_lm, "qwen2")
    cache = jax.eval_shape(lambda: lm.init_cache(1, 64))
    vis = Visibility(pad=jnp.zeros((1,), jnp.int32), start=jnp.full((1,), 9, jnp.int32),
                     window=jnp.tril(jnp.ones((5, 5), bool))[None])

    def verify(lm, tokens, cache):
        hidden, _ = lm.forward(tokens, jnp.full((1, 5), 9, jnp.int32), vis, cache, jnp.full((1,), 9, jnp.int32),
                               write=False)
        return lm.head(hidden)

    exp = jax.export.export(jax.jit(verify), platforms=["tpu"])(lm, jax.ShapeDtypeStruct((1, 5), jnp.int32), cache)
    assert exp.mlir_module().count("tpu_custom_call") >= 5  # q|k|v, o, gate|up, down per layer, and the head


# The default tier runs the real model end to end on meshes instead (decoding/test_lossless.py).
@pytest.mark.integration
def test_real_smollm2_rows_and_tree_nodes_are_exact_in_bfloat16(smollm2_path):
    """The real SmolLM2 in bf16, loaded as an engine loads it: a verify forward over a 7-node tree gives its root the
    bits of the one-row decode step, and its depth-1 node those of decoding that node after the root (the tiny models
    above show XLA's dot failing the first)."""
    from sage_jax.io import loader

    lm, tok = loader.load_serving(smollm2_path, dtype="bfloat16")
    lm = lm.with_matmul("exact")
    prompt = jnp.asarray([tok.encode("The capital of France is")], jnp.int32)
    p = prompt.shape[1]
    anc, depth = _tree([-1, 0, 0, 1, 1, 2, 3])
    tokens = jnp.asarray([[int(prompt[0, -1]), 12366, 3456, 314, 260, 1341, 28]], jnp.int32)
    cache = _prefilled(lm, "llama", prompt[:, :-1], 64)
    start = jnp.full((1,), p - 1, jnp.int32)

    @jax.jit
    def verify(lm, tokens, window, cache):
        t = tokens.shape[1]
        vis = Visibility(pad=jnp.zeros((1,), jnp.int32), start=start, window=window[None])
        pos = (p - 1 + jnp.asarray(depth[:t]))[None]
        hidden, kv = lm.forward(tokens, pos, vis, cache, start, write=False)
        return lm.head(hidden)[0], kv

    tree, _ = verify(lm, tokens, jnp.asarray(anc), cache)
    root, kv = verify(lm, tokens[:, :1], jnp.ones((1, 1), bool), cache)
    np.testing.assert_array_equal(np.asarray(tree[0]), np.asarray(root[0]))
    committed = cache.commit(kv, jnp.zeros((1, 1), jnp.int32), start)
    child = Visibility.chain(jnp.full((1,), p, jnp.int32), jnp.zeros((1,), jnp.int32), 1)
    hidden, _ = jax.jit(lambda lm, c: lm.forward(tokens[:, 1:2], jnp.full((1, 1), p, jnp.int32), child, c,
                                                 jnp.full((1,), p, jnp.int32)))(lm, committed)
    np.testing.assert_array_equal(np.asarray(lm.head(hidden))[0, 0], np.asarray(tree[1]))


@pytest.mark.parametrize("family,ways,groups", [
    pytest.param("llama", 2, (2, 2), marks=pytest.mark.integration),
    pytest.param("qwen2", 2, (2, 2), marks=pytest.mark.integration),
    ("qwen2_5_vl", 2, (2, 2)), ("qwen2", 8, (1, 8))])
def test_a_verified_tree_has_the_same_bits_on_every_mesh(tiny_lm, devices, family, ways, groups):
    """A prefill and a 7-node tree's verify on a `ways`-way tensor-parallel mesh (heads and MLP cut, or the MLP
    only) give the one-device exact logits bit for bit, with no all-reduce in the layers (each matmul whole on one
    device, its input gathered); XLA's dot on the same mesh does not give its one-device bits (so the test can
    fail), and it all-reduces twice a layer."""
    import re

    from configs import sharding

    rng = np.random.default_rng(4)
    p, capacity, b = 9, 40, 2
    prompt = jnp.asarray(rng.integers(2, 96, (b, p)), jnp.int32)
    anc, depth = _tree([-1, 0, 0, 1, 2, 2, 3])
    tokens = jnp.asarray(rng.integers(2, 96, (b, 7)), jnp.int32)

    def run(lm):
        cache = lm.init_cache(b, capacity)
        vis = Visibility.chain(jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32), p)
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        _, cache = lm.forward(prompt, _positions(family, pos), vis, cache, jnp.zeros((b,), jnp.int32))
        vis = Visibility(pad=jnp.zeros((b,), jnp.int32), start=jnp.full((b,), p, jnp.int32),
                         window=jnp.broadcast_to(jnp.asarray(anc), (b, 7, 7)))
        pos = jnp.broadcast_to(jnp.asarray(p + depth, jnp.int32), (b, 7))
        hidden, _ = lm.forward(tokens, _positions(family, pos), vis, cache, jnp.full((b,), p, jnp.int32), write=False)
        return lm.head(hidden)

    one = _exact_lm(tiny_lm, family, seed=5)
    want, want_xla = (np.asarray(jax.jit(run)(lm)) for lm in (one, one.with_matmul("xla")))
    mesh = sharding.make_mesh(data=1, model=ways, devices=devices[:ways])
    placed = _exact_lm(tiny_lm, family, seed=5, mesh=mesh)
    assert placed.groups == groups
    count = lambda hlo, op: len(re.findall(rf"= \S+ {op}(-start)?\(", hlo))  # noqa: E731
    with sharding.use(mesh, "inference"):
        exact = jax.jit(run).lower(placed).compile()
        fast = jax.jit(run).lower(placed.with_matmul("xla")).compile()
        got, got_xla = np.asarray(exact(placed)), np.asarray(fast(placed.with_matmul("xla")))
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got_xla, want_xla)
    assert count(exact.as_text(), "all-reduce") == 0 < count(exact.as_text(), "all-gather")
    assert count(fast.as_text(), "all-reduce") >= 1
