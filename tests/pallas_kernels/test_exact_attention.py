"""`pallas_kernels.exact_attention`: the Mosaic and Triton kernels (interpreted on CPU) bit for bit against the jnp
reference, a query's bits independent of the other queries and of the capacity, overlay mode equal to written mode
over the committed path, agreement with plain softmax attention, the TPU / CUDA lowerings, and the input checks.

Every case poisons with NaN what no query may read into its output: cache slots outside what any query sees
(below pad, unseen window slots, past the window; in overlay mode every slot from `start` on) and window tokens no
query sees. The last query of row 1 sees no window token at all.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.exact_attention import (
    SLOT_BLOCK,
    exact_attention,
    exact_attention_gpu,
    exact_attention_reference,
    exact_attention_tpu,
)
from sage_jax.models import layers

QT = 8  # the query tile of every interpreted kernel here (the reference's default)
KERNELS = {"tpu": exact_attention_tpu, "gpu": exact_attention_gpu}
reference = jax.jit(exact_attention_reference, static_argnames="query_tile")


# ******** Trees and cases. ********


def random_tree(w: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [-1] + [int(rng.integers(0, i)) for i in range(1, w)]


def ancestors(parents: list[int]) -> np.ndarray:
    """[W, W]: node i sees itself and its ancestors."""
    a = np.zeros((len(parents), len(parents)), bool)
    for i, p in enumerate(parents):
        a[i, i] = True
        if p >= 0:
            a[i] |= a[p]
    return a


def visible_slots(pad, start, window, s, overlay) -> np.ndarray:
    """[B, T, S] the slots each query sees (the contract, in numpy)."""
    b, t, u = window.shape
    slot = np.arange(s)
    vis = np.zeros((b, t, s), bool)
    for bi in range(b):
        for ti in range(t):
            if overlay:
                vis[bi, ti] = (slot >= pad[bi]) & (slot < start[bi] + window[bi, ti].sum())
            else:
                vis[bi, ti] = (slot >= pad[bi]) & (slot < start[bi])
                seen = start[bi] + np.flatnonzero(window[bi, ti])
                vis[bi, ti, seen[seen < s]] = True
    return vis


def make_case(seed, *, overlay, t, s, pads, starts, dtype, g=2, k=2, h=32):
    """(args, clean): poisoned inputs for `exact_attention` and the same inputs with every hidden entry finite.
    Row b runs a random tree of t nodes (window = its ancestor relation) plus two window tokens no query sees."""
    b, u = len(pads), t + 2
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    q, kc, vc, kn, vn = normal(b, t, g * k, h), normal(b, s, k, h), normal(b, s, k, h), normal(b, u, k, h), normal(
        b, u, k, h)
    window = np.zeros((b, t, u), bool)
    for bi in range(b):
        window[bi, :, :t] = ancestors(random_tree(t, seed + bi))
    window[1, -1] = False
    pad, start = np.array(pads, np.int32), np.array(starts, np.int32)
    seen_slot = visible_slots(pad, start, window, s, overlay).any(axis=1)[:, :, None, None]  # [B, S, 1, 1]
    seen_new = window.any(axis=1)[:, :, None, None]  # [B, U, 1, 1]
    clean = [q, kc, vc, pad, start, window] + ([kn, vn] if overlay else [])
    poisoned = [q, np.where(seen_slot, kc, np.nan), np.where(seen_slot, vc, np.nan), pad, start, window]
    poisoned += [np.where(seen_new, kn, np.nan), np.where(seen_new, vn, np.nan)] if overlay else []
    cast = lambda xs: [jnp.asarray(x, dtype) if x.dtype == np.float32 else jnp.asarray(x) for x in xs]  # noqa: E731
    return cast(poisoned), cast(clean)


# (overlay, T, S, dtype, pads, starts): windows crossing a block boundary, a row starting past the first block, a
# partial last block (S = 200), T = 1 and 7 (one tile), 64 and 128 (several).
CASES = {
    "written_t1": (False, 1, 200, jnp.bfloat16, [0, 130], [127, 190]),
    "written_t128": (False, 128, 384, jnp.float32, [3, 140], [100, 250]),
    "overlay_t7": (True, 7, 384, jnp.bfloat16, [0, 200], [125, 300]),
    "overlay_t64": (True, 64, 200, jnp.float32, [7, 130], [100, 134]),
}


def case(name, seed=0):
    overlay, t, s, dtype, pads, starts = CASES[name]
    return make_case(seed, overlay=overlay, t=t, s=s, pads=pads, starts=starts, dtype=dtype)


def runner(impl):
    """reference / an interpreted kernel, at the tile `QT`; "device": the public function on this host's
    accelerator (its kernel and tile), skipped on a CPU host."""
    if impl == "device":
        if jax.default_backend() == "cpu":
            pytest.skip("needs a TPU or GPU")
        return jax.jit(exact_attention)
    if impl == "reference":
        return lambda *a: reference(*a, query_tile=QT)
    return lambda *a: KERNELS[impl](*a, query_tile=QT, interpret=True)


def assert_bits(got, want, msg=""):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=msg)


# ******** 1. The kernels, interpreted, give the reference's bits. ********


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference_bit_for_bit(kernel, name):
    args, _ = case(name)
    want = reference(*args, query_tile=QT)
    got = KERNELS[kernel](*args, query_tile=QT, interpret=True)
    assert got.shape == want.shape == args[0].shape and got.dtype == want.dtype == args[0].dtype
    assert np.all(np.isfinite(np.asarray(want, np.float32))), "a hidden NaN reached an output"
    assert_bits(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["written_t1", "overlay_t7"])
def test_tpu_kernel_under_tpu_simulator(name):
    """Mosaic semantics (`pltpu.InterpretParams`: out-of-bounds reads raise, uninitialised scratch is NaN)."""
    args, _ = case(name)
    assert_bits(exact_attention_tpu(*args, query_tile=QT, interpret=pltpu.InterpretParams()),
                reference(*args, query_tile=QT))


# ******** 2. A query's bits: alone or among others, at any capacity. ********


def _with_queries(args, lo, hi):
    q, kc, vc, pad, start, window, *new = args
    return [q[:, lo:hi], kc, vc, pad, start, window[:, lo:hi], *new]


def _with_capacity(args, s):
    q, kc, vc, *rest = args
    widen = lambda c: jnp.pad(c, ((0, 0), (0, s - c.shape[1]), (0, 0), (0, 0)), constant_values=jnp.nan)  # noqa: E731
    return [q, widen(kc), widen(vc), *rest]


@pytest.mark.parametrize("impl", ["reference", "device"])
@pytest.mark.parametrize("name", ["written_t128", "overlay_t64"])
def test_a_querys_bits_depend_on_nothing_else(name, impl):
    run = runner(impl)
    args, _ = case(name, seed=1)
    t, s = args[0].shape[1], args[1].shape[1]
    full = np.asarray(run(*args))
    subsets = [(t // 2 - 3, t // 2 + 4)] + ([(t // 2 - 29, t // 2 + 35)] if t > 64 else [])  # 7, 64 queries
    for lo, hi in subsets:  # each query at another place in its tile than in the full run
        assert_bits(run(*_with_queries(args, lo, hi)), full[:, lo:hi], f"queries [{lo}, {hi})")
    wider = s + 2 * SLOT_BLOCK + 5
    for i in (0, t // 2 + 3, t - 1):
        alone = _with_queries(args, i, i + 1)
        assert_bits(run(*alone), full[:, i:i + 1], f"query {i} alone")
        assert_bits(run(*_with_capacity(alone, wider)), full[:, i:i + 1], f"query {i} alone, capacity {wider}")


# ******** 3. Overlay mode == written mode over the committed path (what a speculative verify relies on). ********


@pytest.mark.parametrize("impl,dtype", [("reference", jnp.float32), ("reference", jnp.bfloat16),
                                        ("tpu", jnp.float32), ("gpu", jnp.float32),
                                        ("device", jnp.float32), ("device", jnp.bfloat16)])
def test_overlay_equals_written_over_the_committed_path(impl, dtype):
    """Each node of a 7-node tree, verified in one overlay forward, against one query in written mode whose cache
    holds its path (root first) at start .. start + depth; the path crosses a slot block boundary. float32 is the
    strict case: a bfloat16 output hides most last-bit differences of the float32 state."""
    run = runner(impl)
    parents = [-1, 0, 0, 1, 1, 3, 5]
    anc = ancestors(parents)
    w, s, pad, start = len(parents), 200, 5, 126
    (q, kc, vc, _, _, _, kn, vn), _ = make_case(2, overlay=True, t=w, s=s, pads=[pad, pad], starts=[start, start],
                                                dtype=jnp.float32)
    q, kc, vc, kn, vn = (np.asarray(x[:1]) for x in (q, kc, vc, kn[:, :w], vn[:, :w]))
    stale = np.arange(s)[None, :, None, None] >= start
    kc, vc = np.where(stale, np.nan, kc), np.where(stale, np.nan, vc)
    written_k, written_v = np.repeat(kc, w, axis=0), np.repeat(vc, w, axis=0)  # row i: node i's committed path
    for i in range(w):
        path = np.flatnonzero(anc[i])
        written_k[i, start:start + len(path)], written_v[i, start:start + len(path)] = kn[0, path], vn[0, path]
    chain = np.arange(w)[None, None, :] < anc.sum(-1)[:, None, None]  # [W, 1, W]: node i sees its depth + 1 slots
    cast = lambda *xs: [jnp.asarray(x, dtype) for x in xs]  # noqa: E731
    overlay = run(*cast(q, kc, vc), jnp.array([pad]), jnp.array([start]), jnp.asarray(anc[None]), *cast(kn, vn))
    written = run(*cast(np.swapaxes(q, 0, 1), written_k, written_v), jnp.full((w,), pad), jnp.full((w,), start),
                  jnp.asarray(chain))
    assert np.all(np.isfinite(np.asarray(overlay, np.float32)))
    assert_bits(overlay[0], written[:, 0])


# ******** 4. It is attention. ********


@pytest.mark.parametrize("name", ["written_t128", "overlay_t7"])
def test_reference_is_softmax_attention(name):
    args, clean = case(name, seed=3)
    q, kc, vc, pad, start, window, *new = (np.asarray(x, np.float32) if jnp.issubdtype(x.dtype, jnp.floating)
                                           else np.asarray(x) for x in clean)
    b, t, n, h = q.shape
    s = kc.shape[1]
    vis = visible_slots(pad, start, window, s, bool(new))
    if new:  # each query's own cache: its seen window tokens laid from `start`
        kc, vc = np.repeat(kc[:, None], t, axis=1), np.repeat(vc[:, None], t, axis=1)  # [B, T, S, K, H]
        for bi in range(b):
            for ti in range(t):
                seen = np.flatnonzero(window[bi, ti])
                kc[bi, ti, start[bi]:start[bi] + len(seen)] = new[0][bi, seen]
                vc[bi, ti, start[bi]:start[bi] + len(seen)] = new[1][bi, seen]
    else:
        kc, vc = np.repeat(kc[:, None], t, axis=1), np.repeat(vc[:, None], t, axis=1)
    dtype = args[0].dtype
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    want = layers.attention(cast(q.reshape(b * t, 1, n, h)), cast(kc.reshape(b * t, s, *kc.shape[3:])),
                            cast(vc.reshape(b * t, s, *vc.shape[3:])), jnp.asarray(vis.reshape(b * t, 1, s)))
    got = reference(*args)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32).reshape(b, t, n, h),
                               atol=tol, rtol=tol)


def test_public_function_runs_the_reference_on_cpu():
    args, _ = case("overlay_t7")
    assert_bits(jax.jit(exact_attention)(*args), reference(*args))


# ******** 5. Lowering on CPU: Mosaic for TPU, Triton for CUDA, at real model shapes. ********


def _abstract(b, t, n, k, h, s, overlay, dtype=jnp.bfloat16):
    f = jax.ShapeDtypeStruct
    args = [f((b, t, n, h), dtype), f((b, s, k, h), dtype), f((b, s, k, h), dtype), f((b,), jnp.int32),
            f((b,), jnp.int32), f((b, t, t), jnp.bool_)]
    return args + ([f((b, t, k, h), dtype)] * 2 if overlay else [])


# (B, T, N, K, H, S): SmolLM2-135M verifying a 26-node tree; a 72B-shaped verify.
SHAPES = {64: (2, 26, 9, 3, 64, 384), 128: (1, 64, 64, 8, 128, 4096)}
TRITON = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")  # no compatibility guarantee


@pytest.mark.parametrize("overlay", [False, True], ids=["written", "overlay"])
@pytest.mark.parametrize("h", sorted(SHAPES))
def test_kernels_lower_for_tpu_and_cuda(h, overlay):
    args = _abstract(*SHAPES[h], overlay)
    tpu = jax.export.export(jax.jit(exact_attention_tpu), platforms=["tpu"])(*args).mlir_module()
    assert "tpu_custom_call" in tpu
    cuda = jax.export.export(jax.jit(exact_attention_gpu), platforms=["cuda"], disabled_checks=[TRITON])(*args)
    assert "__gpu$xla.gpu.triton" in cuda.mlir_module()


def test_auto_picks_the_kernels_when_lowering():
    args = _abstract(*SHAPES[64], True)
    assert "tpu_custom_call" in jax.export.export(jax.jit(exact_attention), platforms=["tpu"])(*args).mlir_module()
    cuda = jax.export.export(jax.jit(exact_attention), platforms=["cuda"], disabled_checks=[TRITON])(*args)
    assert "__gpu$xla.gpu.triton" in cuda.mlir_module()


# ******** 6. Input checks. ********


def _inputs(b=2, t=3, n=4, k=2, h=16, s=16, u=5, dtype=jnp.float32):
    f = lambda *shape: jnp.zeros(shape, dtype)  # noqa: E731
    return dict(q=f(b, t, n, h), k_cache=f(b, s, k, h), v_cache=f(b, s, k, h), pad=jnp.zeros((b,), jnp.int32),
                start=jnp.zeros((b,), jnp.int32), window=jnp.ones((b, t, u), bool), k_new=f(b, u, k, h),
                v_new=f(b, u, k, h))


BAD = {
    "rank": (dict(q=jnp.zeros((2, 3, 16))), "q must have rank 4"),
    "one_new": (dict(v_new=None), "both k_new and v_new"),
    "cache_pair": (dict(v_cache=jnp.zeros((2, 15, 2, 16))), r"k_cache .* and v_cache .* differ"),
    "new_pair": (dict(v_new=jnp.zeros((2, 4, 2, 16))), r"k_new .* and v_new .* differ"),
    "batch": (dict(start=jnp.zeros((3,), jnp.int32)), "batch sizes disagree"),
    "head_dim": (dict(k_cache=jnp.zeros((2, 16, 2, 8)), v_cache=jnp.zeros((2, 16, 2, 8))), "head dims disagree"),
    "kv_heads": (dict(k_new=jnp.zeros((2, 5, 1, 16)), v_new=jnp.zeros((2, 5, 1, 16))), "kv heads disagree"),
    "gqa": (dict(q=jnp.zeros((2, 3, 3, 16))), "not a multiple of the kv heads"),
    "window_t": (dict(window=jnp.ones((2, 4, 5), bool)), "window must be"),
    "window_u": (dict(window=jnp.ones((2, 3, 4), bool)), "window must be"),
    "dtype": (dict(q=jnp.zeros((2, 3, 4, 16), jnp.float16)), "share one dtype"),
    "mixed_dtype": (dict(k_new=jnp.zeros((2, 5, 2, 16), jnp.bfloat16)), "share one dtype"),
    "pad_dtype": (dict(pad=jnp.zeros((2,), jnp.float32)), "pad must be integer"),
    "window_dtype": (dict(window=jnp.ones((2, 3, 5), jnp.float32)), "window must be bool or integer"),
    "impl": (dict(impl="triton"), "impl must be"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_inputs_raise_one_clear_error(name):
    change, message = BAD[name]
    with pytest.raises(ValueError, match=message) as e:
        exact_attention(**{**_inputs(), **change})
    assert "\n" not in str(e.value)
