"""Tree-attention kernels (interpret mode) against the jnp reference, the reference against the model's XLA path,
TPU / CUDA lowering on CPU, and the input checks.

Every kernel case poisons what a kernel must never read into a valid output with NaN: cache slots outside
[pad, length), the padded new tokens (tree slots past a row's node count) and, in the first half of the batch,
the padded query rows. The reference sees the same data unpoisoned; the valid query rows are compared, and in
the second half of the batch every output row (padding included) must be finite: no hidden NaN leaks anywhere.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tree_attention import tree_attention, tree_attention_gpu, tree_attention_tpu
from pallas_kernels.tree_attention.reference import tree_attention_reference
from sage_jax.decoding.tree import MC_SIM_7B_63
from sage_jax.models import layers

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
reference = jax.jit(tree_attention_reference)
KERNELS = {"tpu": tree_attention_tpu, "gpu": tree_attention_gpu}


# ******** Trees as parent lists (-1: the root) and their ancestor masks. ********


def chain(w: int) -> list[int]:
    return [-1] + list(range(w - 1))


def mc_sim_7b_63() -> list[int]:
    paths = [()] + list(MC_SIM_7B_63)
    index = {p: i for i, p in enumerate(paths)}
    return [-1] + [index[p[:-1]] for p in paths[1:]]


def random_tree(w: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [-1] + [int(rng.integers(0, i)) for i in range(1, w)]


def ancestors(parents: list[int], width: int) -> np.ndarray:
    """[width, width] node i sees itself and its ancestors; slots past the tree (padding) see nothing."""
    a = np.zeros((width, width), bool)
    for i, p in enumerate(parents):
        a[i, i] = True
        if p >= 0:
            a[i] |= a[p]
    return a


# ******** Cases. ********


def make_case(seed, trees, lengths, pads, *, s, g, h, dtype, k=2, t=None):
    """Random inputs for one batch (row b: tree `trees[b]`, cache [pads[b], lengths[b])). Returns (clean inputs,
    poisoned inputs, valid query rows [B, T]); padded queries are poisoned in the first half of the batch only.
    `t`: query count when it differs from U (a draft level: the queries are the last t tree slots)."""
    b, u = len(trees), max(len(p) for p in trees)
    t = t or u
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    q, kc, vc = normal(b, t, g * k, h), normal(b, s, k, h), normal(b, s, k, h)
    kn, vn = normal(b, u, k, h), normal(b, u, k, h)
    mask = np.stack([ancestors(p, u)[u - t:] for p in trees])  # [B, T, U]
    n_nodes = np.array([len(p) for p in trees])
    valid_q = (np.arange(u - t, u)[None] < n_nodes[:, None])  # [B, T]
    valid_new = np.arange(u)[None] < n_nodes[:, None]  # [B, U]
    slot = np.arange(s)[None]
    hidden = (slot < np.array(pads)[:, None]) | (slot >= np.array(lengths)[:, None])  # [B, S]
    clean = (q, kc, vc, np.array(lengths, np.int32), np.array(pads, np.int32), kn, vn, mask)
    poison_q = valid_q | (np.arange(b)[:, None] >= b // 2)
    poisoned = (np.where(poison_q[:, :, None, None], q, np.nan), np.where(hidden[:, :, None, None], np.nan, kc),
                np.where(hidden[:, :, None, None], np.nan, vc), clean[3], clean[4],
                np.where(valid_new[:, :, None, None], kn, np.nan), np.where(valid_new[:, :, None, None], vn, np.nan),
                mask)
    cast = lambda xs: tuple(jnp.asarray(x, dtype) if x.dtype == np.float32 else jnp.asarray(x) for x in xs)  # noqa: E731
    return cast(clean), cast(poisoned), valid_q


def assert_matches(out, clean, valid_q, dtype):
    ref = reference(*clean)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out = np.asarray(out, np.float32)
    assert np.all(np.isfinite(out[out.shape[0] // 2:])), "a hidden NaN reached an output (unpoisoned queries)"
    got, want = out[valid_q], np.asarray(ref, np.float32)[valid_q]
    assert np.all(np.isfinite(got)), "a NaN reached a valid query's output"
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype])


# Four rows in one call: the EAGLE tree, a chain shorter than the width, a random tree, and a small random tree
# over an empty cache. The cache (S = 80, 32-slot blocks: the last one partial) has rows that end inside a block,
# start past a block (pad 35), or read the partial last block (length = S).
MIXED = dict(trees=[mc_sim_7b_63(), chain(20), random_tree(26, 1), random_tree(12, 2)],
             lengths=[80, 61, 9, 0], pads=[0, 35, 3, 0], s=80)

DEFAULT = [(jnp.float32, 1, 64), (jnp.bfloat16, 4, 128)]  # (dtype, G, H); the other pairings run under -m slow


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
@pytest.mark.parametrize("dtype,g,h", DEFAULT)
def test_kernel_matches_reference_on_mixed_trees(kernel, dtype, g, h):
    clean, poisoned, valid_q = make_case(0, **MIXED, g=g, h=h, dtype=dtype)
    out = KERNELS[kernel](*poisoned, block_s=32, interpret=True)
    assert_matches(out, clean, valid_q, dtype)


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_kernel_single_node(kernel):
    """One node per row (a plain decode step): T = U = 1, cache lengths 1 and 37, default block sizes."""
    clean, poisoned, valid_q = make_case(1, [[-1], [-1]], [1, 37], [0, 2], s=40, g=3, h=64, dtype=jnp.bfloat16)
    out = KERNELS[kernel](*poisoned, interpret=True)
    assert_matches(out, clean, valid_q, jnp.bfloat16)


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_kernel_draft_level(kernel):
    """A draft tree level: T = 4 frontier queries over U = 12 tree slots (the earlier levels and themselves)."""
    clean, poisoned, valid_q = make_case(2, [random_tree(12, 3), random_tree(10, 4)], [50, 17], [4, 0], s=64,
                                         g=2, h=128, dtype=jnp.float32, t=4)
    out = KERNELS[kernel](*poisoned, block_s=16, interpret=True)
    assert_matches(out, clean, valid_q, jnp.float32)


@pytest.mark.parametrize("dtype,t", [(jnp.float32, None), (jnp.bfloat16, 3)])
def test_tpu_kernel_under_tpu_simulator(dtype, t):
    """Mosaic semantics (`pltpu.InterpretParams`: out-of-bounds reads raise, uninitialised scratch is NaN).
    Row 0 reads the partial last block (S = 40), row 1 starts past the first block."""
    trees = [random_tree(8, 5), chain(5)]
    clean, poisoned, valid_q = make_case(4, trees, [40, 21], [0, 17], s=40, g=2, h=64, k=1, dtype=dtype, t=t)
    out = tree_attention_tpu(*poisoned, block_s=16, interpret=pltpu.InterpretParams())
    assert_matches(out, clean, valid_q, dtype)


# ******** The reference is the model's XLA path with the dense mask. ********


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_equals_attention_with_new(dtype):
    clean, _, _ = make_case(5, [mc_sim_7b_63(), chain(9), random_tree(17, 6)], [30, 41, 12], [0, 6, 12], s=48,
                            g=3, h=32, dtype=dtype)

    @jax.jit
    def xla_path(q, kc, vc, length, pad, kn, vn, mask):
        slot = jnp.arange(kc.shape[1])[None, None, :]
        dense = jnp.broadcast_to((slot >= pad[:, None, None]) & (slot < length[:, None, None]),
                                 (q.shape[0], q.shape[1], kc.shape[1]))
        return layers.attention_with_new(q, kc, vc, dense, kn, vn, mask)

    want = xla_path(*clean)
    got = reference(*clean)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=1e-6 if dtype == jnp.float32 else 1e-2, rtol=1e-6 if dtype == jnp.float32 else 1e-2)


# ******** The public function: dispatch and checks. ********


def test_public_function_dispatch_on_cpu():
    clean, poisoned, valid_q = make_case(6, [chain(5), random_tree(5, 7)], [20, 11], [0, 3], s=24, g=2, h=64,
                                         dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(tree_attention(*clean)), np.asarray(reference(*clean)))
    assert_matches(tree_attention(*poisoned, interpret=True, block_s=16), clean, valid_q, jnp.float32)
    h48, _, _ = make_case(6, [chain(3)], [4], [0], s=8, g=1, h=48, dtype=jnp.float32)
    assert tree_attention(*h48).shape == (1, 3, 2, 48)  # the reference takes any head dim


def _inputs(b=2, t=3, n=4, k=2, h=64, s=16, u=3, dtype=jnp.float32):
    f = lambda *shape: jnp.zeros(shape, dtype)  # noqa: E731
    return dict(q=f(b, t, n, h), k_cache=f(b, s, k, h), v_cache=f(b, s, k, h), length=jnp.zeros((b,), jnp.int32),
                pad=jnp.zeros((b,), jnp.int32), k_new=f(b, u, k, h), v_new=f(b, u, k, h),
                mask_new=jnp.ones((b, t, u), bool))


BAD = {
    "rank": (dict(q=jnp.zeros((2, 3, 64))), "q must have rank 4"),
    "cache_pair": (dict(v_cache=jnp.zeros((2, 15, 2, 64))), "k_cache .* and v_cache .* differ"),
    "new_pair": (dict(v_new=jnp.zeros((2, 4, 2, 64))), "k_new .* and v_new .* differ"),
    "batch": (dict(length=jnp.zeros((3,), jnp.int32)), "batch sizes disagree"),
    "head_dim": (dict(k_cache=jnp.zeros((2, 16, 2, 32)), v_cache=jnp.zeros((2, 16, 2, 32))), "head dims disagree"),
    "kv_heads": (dict(k_new=jnp.zeros((2, 3, 1, 64)), v_new=jnp.zeros((2, 3, 1, 64))), "kv heads disagree"),
    "gqa": (dict(q=jnp.zeros((2, 3, 3, 64))), "not a multiple of the kv heads"),
    "mask": (dict(mask_new=jnp.ones((2, 3, 4), bool)), "mask_new must be"),
    "dtype": (dict(q=jnp.zeros((2, 3, 4, 64), jnp.float16)), "share one dtype"),
    "mixed_dtype": (dict(k_new=jnp.zeros((2, 3, 2, 64), jnp.bfloat16)), "share one dtype"),
    "length_dtype": (dict(length=jnp.zeros((2,), jnp.float32)), "length must be integer"),
    "mask_dtype": (dict(mask_new=jnp.ones((2, 3, 3), jnp.float32)), "mask_new must be bool or integer"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inputs_raise_one_clear_error(case):
    change, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        tree_attention(**{**_inputs(), **change}, impl="tpu", interpret=True)


def test_kernels_reject_other_head_dims_and_unknown_impl():
    with pytest.raises(ValueError, match="head dims"):
        tree_attention(**_inputs(h=96), impl="gpu", interpret=True)
    tree_attention(**_inputs(h=96), impl="reference")
    with pytest.raises(ValueError, match="impl must be"):
        tree_attention(**_inputs(), impl="triton")


# ******** Lowering on CPU: Mosaic TPU (and Triton for CUDA) at real model shapes. ********


def _abstract(b, t, n, k, h, s, u, dtype=jnp.bfloat16):
    f = jax.ShapeDtypeStruct
    return (f((b, t, n, h), dtype), f((b, s, k, h), dtype), f((b, s, k, h), dtype), f((b,), jnp.int32),
            f((b,), jnp.int32), f((b, u, k, h), dtype), f((b, u, k, h), dtype), f((b, t, u), jnp.bool_))


# (B, T, N, K, H, S, U): SmolLM2-135M verifying a 25-node tree, its plain decode step, a 72B-shaped verify.
SHAPES = {"smollm2": (2, 26, 9, 3, 64, 384, 26), "smollm2_decode": (2, 1, 9, 3, 64, 384, 1),
          "72b": (1, 64, 64, 8, 128, 4096, 64)}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_tpu_kernel_lowers_for_tpu(shape):
    exp = jax.export.export(jax.jit(tree_attention_tpu), platforms=["tpu"])(*_abstract(*SHAPES[shape]))
    assert "tpu_custom_call" in exp.mlir_module()


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gpu_kernel_lowers_for_cuda(shape):
    # Triton kernels carry no export compatibility guarantee, hence the disabled check.
    check = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exp = jax.export.export(jax.jit(tree_attention_gpu), platforms=["cuda"], disabled_checks=[check])(
        *_abstract(*SHAPES[shape]))
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()


# ******** The parameter product (-m slow). ********


@pytest.mark.slow
@pytest.mark.parametrize("shape,dtype", list(itertools.product(sorted(SHAPES), [jnp.float32, jnp.bfloat16])))
def test_tpu_kernel_lowers_for_tpu_all_dtypes(shape, dtype):
    exp = jax.export.export(jax.jit(tree_attention_tpu), platforms=["tpu"])(*_abstract(*SHAPES[shape], dtype))
    assert "tpu_custom_call" in exp.mlir_module()


TREES = {"chain": lambda: chain(26), "mc_sim_7b_63": mc_sim_7b_63, "random": lambda: random_tree(26, 9),
         "single": lambda: [-1]}


@pytest.mark.slow
@pytest.mark.parametrize("kernel,dtype,g,h,tree,block_s", list(itertools.product(
    ["tpu", "gpu"], [jnp.float32, jnp.bfloat16], [1, 2, 4, 8], [64, 128], sorted(TREES), [16, 64])))
def test_product(kernel, dtype, g, h, tree, block_s):
    parents = TREES[tree]()
    trees = [parents, parents[: max(1, len(parents) // 2)], parents]
    clean, poisoned, valid_q = make_case(10, trees, [100, 37, 0], [0, 20, 0], s=100, g=g, h=h, dtype=dtype)
    out = KERNELS[kernel](*poisoned, block_s=block_s, interpret=True)
    assert_matches(out, clean, valid_q, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,g,h,tree", list(itertools.product(
    [jnp.float32, jnp.bfloat16], [1, 4], [64, 128], sorted(TREES))))
def test_product_under_tpu_simulator(dtype, g, h, tree):
    parents = TREES[tree]()
    clean, poisoned, valid_q = make_case(11, [parents, parents[: max(1, len(parents) // 3)]], [64, 23], [0, 17],
                                         s=64, g=g, h=h, dtype=dtype)
    out = tree_attention_tpu(*poisoned, block_s=16, interpret=pltpu.InterpretParams())
    assert_matches(out, clean, valid_q, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("t,u", [(4, 26), (8, 12)])
def test_product_draft_levels(t, u):
    trees = [random_tree(u, 12), random_tree(u, 13)]
    for kernel, dtype in itertools.product(KERNELS.values(), [jnp.float32, jnp.bfloat16]):
        clean, poisoned, valid_q = make_case(12, trees, [70, 31], [5, 0], s=96, g=4, h=64, dtype=dtype, t=t)
        assert_matches(kernel(*poisoned, block_s=32, interpret=True), clean, valid_q, dtype)
