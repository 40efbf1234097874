"""Online distillation (`training/online.py`): the target's features computed inside the step give exactly the
loss of cached features, and training on token rows alone stops at a deadline, checkpointed, and resumes with the
uninterrupted run's losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.models import eagle_head, layers
from sage_jax.training import loop, objectives, online
from sage_jax.training.recipe import TrainConfig


@pytest.fixture(scope="module")
def target(tiny_lm):
    return tiny_lm(0, scale=2.5, n_layers=3)


def _rows(vocab: int, n: int, length: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(length // 2, length + 1, n).astype(np.int32)
    return {"tokens": rng.integers(2, vocab, (n, length)).astype(np.int32), "lengths": lengths,
            "answer_start": rng.integers(3, length // 2, n).astype(np.int32), "kind": np.zeros((n,), np.int32)}


@pytest.mark.parametrize("taps", [(), pytest.param((2, 0), marks=pytest.mark.integration)])
def test_online_loss_and_gradient_are_the_cached_features(target, taps):
    lm_t = target.serving()
    cfg = eagle_head.head_config(target.cfg)
    ids = np.arange(0, cfg.vocab_size, 2)
    params = jax.tree.map(lambda x: x * 3.0 if x.ndim > 1 else x, eagle_head.init_params(cfg, 1, n_taps=len(taps)))
    tc = TrainConfig(unroll=2, hard_weight=0.5, head_window=12, prompt_weight=0.3)
    rows = _rows(cfg.vocab_size, 4, 24, seed=3)
    # The cached path's batch, its features from a plain forward of the target (what the shards store).
    b, t = rows["tokens"].shape
    out = lm_t.forward(jnp.asarray(rows["tokens"]), jnp.broadcast_to(jnp.arange(t), (b, t)),
                       layers.causal_mask(t, jnp.zeros((b,), jnp.int32)), taps=taps)
    hidden = out[0]
    cached = {**rows, "features": out[-1] if taps else hidden, "hidden": hidden,
              "top": jnp.argmax(lm_t.head(hidden), -1).astype(jnp.int32)}
    inner = objectives.eagle_task(cfg, tc)
    on = online.task(inner, taps)
    fz, fz_on = objectives.frozen_target(lm_t, ids), online.frozen(lm_t, ids)
    (want, m_want), g_want = jax.jit(jax.value_and_grad(inner.loss, has_aux=True))(params, fz, cached)
    (got, m_got), g_got = jax.jit(jax.value_and_grad(on.loss, has_aux=True))(params, fz_on, rows)
    assert float(want) > 0.1
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for k in m_want:
        np.testing.assert_allclose(float(m_got[k]), float(m_want[k]), rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6), g_got, g_want)
    hits = [int(x) for x in jax.jit(on.agreement)(params, fz_on, rows)]
    assert hits == [int(x) for x in jax.jit(inner.agreement)(params, fz, cached)] and hits[1] > 0


@pytest.mark.integration
def test_online_training_stops_at_a_deadline_and_resumes_exactly(target, tmp_path):
    lm_t = target.serving()
    cfg = eagle_head.head_config(target.cfg)
    rows, held = _rows(cfg.vocab_size, 24, 32, seed=1), _rows(cfg.vocab_size, 8, 32, seed=2)
    tc = TrainConfig(steps=6, batch_size=4, lr=1e-2, warmup=2, eval_every=3, ckpt_every=100, unroll=2, head_window=16)
    task = online.task(objectives.eagle_task(cfg, tc))
    fz = online.frozen(lm_t)
    p0 = eagle_head.init_params(cfg, 0)
    whole = loop.train(task, p0, fz, rows, held, tc, str(tmp_path / "a"), progress=False)
    assert sorted(whole.losses) == list(range(6)) and set(whole.evals) == {3, 6}
    assert whole.first_step_seconds > 0 and whole.step_seconds > 0
    first = loop.train(task, p0, fz, rows, held, tc, str(tmp_path / "b"), progress=False, deadline=0.0)
    assert first.step == 1 and sorted(first.losses) == [0]  # the deadline had passed: one step, checkpointed
    rest = loop.train(task, p0, fz, rows, held, tc, str(tmp_path / "b"), progress=False)
    assert sorted(rest.losses) == list(range(1, 6)) and rest.step == 6
    for s in range(6):
        got = first.losses[s] if s == 0 else rest.losses[s]
        assert abs(got - whole.losses[s]) <= 1e-6 * max(1.0, abs(whole.losses[s])), (s, got, whole.losses[s])
    assert whole.losses[5] < whole.losses[0]
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), rest.params, whole.params)
