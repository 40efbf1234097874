"""`sage_jax.executables`: compiled loops stored by one engine load in another and decode the same tokens; a new
configuration is a new entry; a torn entry is compiled again and rewritten."""

import jax
import pytest

from sage_jax import executables
from sage_jax.decoding.drafters import DraftSpec
from sage_jax.decoding.policies import TreePolicy
from sage_jax.engine import Engine

POLICY = TreePolicy.sage(n_max=4, frontier=2, d_cap=3, d_max=3, d_min=1)  # small loops: quick to compile


@pytest.fixture
def every_compile_cached():
    """Every compile goes through XLA's persistent cache, as in the command line (whose loops take seconds)."""
    old = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old)


# Real compiles of the loops and fresh engines (20-45 s each on 2 cores): under -m integration; the store's key is
# checked in the default suite.
@pytest.mark.integration
def test_stored_loops_load_in_a_new_engine_and_decode_the_same(tiny_lm, tmp_path, monkeypatch, every_compile_cached):
    target = tiny_lm(0, vocab_size=64, n_layers=2, eos_token_ids=())
    prompt = [3, 4, 5, 6]

    def engine():
        e = Engine(target, draft_spec=DraftSpec(kind="self", n_layers=1))
        e.executables = executables.Store(str(tmp_path))
        return e

    ref = Engine(target, draft_spec=DraftSpec(kind="self", n_layers=1)).generate(
        [prompt], policy=POLICY, max_new_tokens=16)  # XLA's cache now holds these loops
    jax.clear_caches()
    first = engine().generate([prompt], policy=POLICY, max_new_tokens=16)
    entries = list(tmp_path.glob("*.exe"))
    assert len(entries) == 1 and first.token_ids == ref.token_ids
    jax.clear_caches()
    loaded = []
    get = executables.Store.get
    monkeypatch.setattr(executables.Store, "get", lambda self, k: loaded.append(get(self, k)) or loaded[-1])
    second = engine()
    # Loaded, not compiled: an entry written from executables XLA's cache handed back would fail right here.
    assert second.generate([prompt], policy=POLICY, max_new_tokens=16).token_ids == ref.token_ids
    assert loaded[-1] is not None and second.compiles == 2
    second.generate([prompt], policy=POLICY, max_new_tokens=40)  # another new-token bucket: another entry
    assert len(list(tmp_path.glob("*.exe"))) == 2 and loaded[-1] is None
    entries[0].write_bytes(b"torn")
    assert engine().generate([prompt], policy=POLICY, max_new_tokens=16).token_ids == ref.token_ids
    assert loaded[-1] is None and entries[0].stat().st_size > 4  # compiled again, rewritten
    small = executables.Store(str(tmp_path), keep=1)  # the least recently written entries go past `keep`
    small.put("newest", ())
    assert [p.name for p in tmp_path.glob("*.exe")] == ["newest.exe"]


def test_the_key_follows_the_arguments_and_the_config():
    x = jax.numpy.zeros((2, 3))
    assert executables.key("loops", ("a", 1), (x,)) == executables.key("loops", ("a", 1), (jax.numpy.ones((2, 3)),))
    assert executables.key("loops", ("a", 1), (x,)) != executables.key("loops", ("a", 2), (x,))
    assert executables.key("loops", ("a", 1), (x,)) != executables.key("loops", ("a", 1), (x.astype("int32"),))
    assert executables.key("loops", ("a", 1), (x,)) != executables.key("loops", ("a", 1), (x[:1],))


@pytest.mark.integration
def test_prefetch_loads_what_the_last_run_with_the_same_settings_asked_for(tiny_lm, tmp_path, every_compile_cached):
    target = tiny_lm(0, vocab_size=64, n_layers=2, eos_token_ids=())
    prompt, setups = [3, 4, 5, 6], []

    def run(settings: str) -> tuple[list[int], executables.Store]:
        jax.clear_caches()
        store = executables.Store(str(tmp_path))
        store.prefetch(settings, setup=lambda: setups.append(settings))
        e = Engine(target, draft_spec=DraftSpec(kind="self", n_layers=1))
        e.executables = store
        return e.generate([prompt], policy=POLICY, max_new_tokens=16).token_ids, store

    first, store = run("a")
    assert store.prefetched == 0 and setups == []  # nothing known yet for these settings
    again, store = run("a")
    assert again == first and store.prefetched == 1 and setups == ["a"]  # loaded on the thread, then decoded
    other, store = run("b")  # other settings: nothing loaded ahead, the entry still found
    assert other == first and store.prefetched == 0 and setups == ["a"]
    (tmp_path / next(p.name for p in tmp_path.glob("*.exe"))).write_bytes(b"torn")
    torn, store = run("a")  # a guess that does not load: compiled as before
    assert torn == first and store.prefetched == 0
