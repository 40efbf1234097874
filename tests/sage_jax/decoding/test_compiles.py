"""One compile: after warm-up, prompts of different lengths in one bucket and first trees shaped by α from 0
to 1 add no compilation, counted by the engine and by JAX's own backend-compile events."""

import contextlib

import jax

from sage_jax.decoding.drafters import DraftSpec
from sage_jax.engine import Engine


@contextlib.contextmanager
def backend_compiles():
    """Records every XLA compilation request inside the block: fresh backend compiles and compiles served from
    the persistent cache alike."""
    events = []

    def on_duration(name, *_args, **_kw):
        if name == "/jax/core/compile/backend_compile_duration":
            events.append(name)

    def on_event(name, *_args, **_kw):
        if name == "/jax/compilation_cache/compile_requests_use_cache":
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_event_listener(on_event)


def test_counter_sees_compiles():
    with backend_compiles() as events:
        jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(7.0)).block_until_ready()
    assert events


def test_no_recompiles_across_lengths_and_alpha(tiny_lm):
    target = tiny_lm(0, vocab_size=64, n_layers=2, eos_token_ids=())
    engine = Engine(target, draft_spec=DraftSpec(kind="self", n_layers=1))
    engine.generate([[3, 4, 5]], policy="sage", max_new_tokens=12)  # warm-up: one prefill + one decode loop
    assert engine.compiles == 2
    with backend_compiles() as events:
        outs = [engine.generate([list(range(2, 2 + n))], policy="sage", max_new_tokens=12) for n in (5, 9, 13)]
        outs += [engine.generate([[3, 4, 5]], policy="sage", max_new_tokens=12, alpha_init=a) for a in (0.0, 1.0)]
        outs += [engine.generate([[3, 4, 5]], policy="sage", max_new_tokens=9, temperature=0.8, seed=2)]
    assert events == [], f"{len(events)} backend compilations after warm-up"
    assert engine.compiles == 2
    first_alpha = [o.stats.alpha_trace[0] for o in outs[3:5]]
    assert first_alpha == [0.0, 1.0]
    # α really reshaped the first tree: its first level has W(α) children at most, W(1) = w_min = 2 and W(0) = 10
    # (the tiny draft's θ leaves 4 of them), against 6 at the default α = 0.5.
    assert outs[4].stats.width_trace[0] == 2 < outs[3].stats.width_trace[0]
    assert all(o.stats.compiles == 2 for o in outs)


def test_new_bucket_compiles_once(tiny_lm):
    target = tiny_lm(0, vocab_size=64, n_layers=2, eos_token_ids=())
    engine = Engine(target, draft_spec=DraftSpec(kind="self", n_layers=1))
    engine.generate([[3] * 20], policy="ar", max_new_tokens=4)
    engine.generate([[3] * 30], policy="ar", max_new_tokens=4)  # same 32 bucket
    assert engine.compiles == 2
    engine.generate([[3] * 40], policy="ar", max_new_tokens=4)  # 64 bucket
    assert engine.compiles == 4
