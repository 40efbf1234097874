"""The datastore of the target's answers: the traced lookup returns what a plain walk down the stored continuations'
trie gives (longest context first, the most frequent token at each depth, cut at the answer's end); a context it
never saw gives nothing; saved and loaded it is the same; SAGE and EAGLE-2 with a datastore chain stay lossless and
accept tokens from it; a datastore policy without a datastore is a clear error."""

import collections
import random

import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.decoding import datastore
from sage_jax.decoding.drafters import DraftSpec
from sage_jax.decoding.policies import TreePolicy
from sage_jax.engine import Engine


def _walk(answers, ctx, n_min, n_max, length):
    """The reference: every stored continuation of the longest matching context, walked by counting."""
    lead = n_max - 1
    for n in range(n_max, n_min - 1, -1):
        if len(ctx) < n:
            continue
        conts = []
        for prompt, answer in answers:
            seq = list(prompt)[-lead:] + list(answer)
            first = len(seq) - len(answer)
            for i in range(max(first, n), len(seq)):
                if seq[i - n: i] == ctx[-n:]:
                    conts.append(seq[i: i + length])
        if not conts:
            continue
        out = []
        for k in range(length):
            firsts = collections.Counter(c[k] for c in conts if len(c) > k)
            if not firsts:
                break
            t = firsts.most_common(1)[0][0]  # ties: the first seen, as the build breaks them
            out.append(t)
            conts = [c for c in conts if len(c) > k and c[k] == t]
        return out
    return []


def test_lookup_matches_a_walk_down_the_stored_continuations():
    rng = random.Random(0)
    for trial in range(6):
        n_min, n_max, length = (2, 4, 6) if trial % 2 == 0 else (1, 3, 4)
        answers = [([rng.randrange(5) for _ in range(3)], [rng.randrange(5) for _ in range(rng.randrange(1, 12))])
                   for _ in range(8)]
        store = datastore.build(answers, length=length, n_min=n_min, n_max=n_max)
        hist = np.asarray([[rng.randrange(6) for _ in range(10)] for _ in range(16)], np.int32)
        valid = np.ones_like(hist, bool)
        valid[:4, :3] = False  # left padding: those rows' contexts are shorter
        end = np.asarray([rng.randrange(0, 10) for _ in range(16)], np.int32)
        tokens, n = datastore.lookup(store, jnp.asarray(hist), jnp.asarray(valid), jnp.asarray(end), length)
        for r in range(16):
            ctx = [int(t) for t, ok in zip(hist[r, : end[r] + 1], valid[r, : end[r] + 1], strict=True) if ok]
            want = _walk(answers, ctx, n_min, n_max, length)
            assert tokens[r, : n[r]].tolist() == want, (trial, r, ctx)
            assert np.all(np.asarray(tokens[r, n[r]:]) == 0)


def test_unseen_context_gives_no_chain_and_the_store_round_trips(tmp_path):
    store = datastore.build([([1, 2, 3], [4, 5, 6, 7])], length=4)
    tokens, n = datastore.lookup(store, jnp.asarray([[9, 8, 7, 9], [0, 3, 4, 5]]), jnp.ones((2, 4), bool),
                                 jnp.asarray([3, 3]), 4)
    assert n.tolist() == [0, 2] and tokens[1, :2].tolist() == [6, 7]  # "4 5" -> the rest of that answer
    again = datastore.load(str(tmp_path)) if datastore.save(store, str(tmp_path)) else None
    assert (again.n_min, again.n_max) == (store.n_min, store.n_max)
    for a, b in ((again.corpus, store.corpus), (again.keys, store.keys), (again.at, store.at)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert datastore.load(str(tmp_path / "none")) is None


@pytest.fixture(scope="module")
def engine_and_store(tiny_lm):
    engine = Engine(tiny_lm(0, vocab_size=64, n_layers=2, eos_token_ids=()),
                    draft_spec=DraftSpec(kind="self", n_layers=1))
    train = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [20, 21]]  # the model's own answers to other prompts
    out = engine.generate(train, policy="ar", max_new_tokens=40).token_ids
    return engine, datastore.build(list(zip(train, out, strict=True)), length=6)


@pytest.mark.integration
def test_datastore_chains_are_lossless_and_accepted(engine_and_store):
    engine, store = engine_and_store
    prompts = [[5, 6, 7, 1], [30, 31, 8, 9]]
    ref = engine.generate(prompts, policy="ar", max_new_tokens=40)
    with pytest.raises(ValueError, match="no datastore"):
        engine.generate(prompts, policy=TreePolicy.sage(n_max=16, frontier=4, retrieval=6, datastore=True))
    engine.datastore = store
    for policy in (TreePolicy.sage(n_max=16, frontier=4, retrieval=6, datastore=True),
                   TreePolicy.eagle2(n_max=8, depth=6, top_k=4, retrieval=6, datastore=True)):
        out = engine.generate(prompts, policy=policy, max_new_tokens=40)
        st = out.stats
        assert out.token_ids == ref.token_ids, policy.name
        assert sum(st.accepted_at) + st.retrieval_accepted == round(st.mean_accepted * st.row_steps), policy.name
        assert st.retrieval_accepted > 0, policy.name
    # node budget 0: the chains alone are verified (no draft node), still AR's output
    out = engine.generate(prompts, policy=TreePolicy.sage(n_max=16, frontier=4, retrieval=6, datastore=True),
                          max_new_tokens=40, budget=(0, 4))
    assert out.token_ids == ref.token_ids and out.stats.retrieval_accepted > 0 and sum(out.stats.accepted_at) == 0
    assert round(out.stats.mean_accepted * out.stats.row_steps) == out.stats.retrieval_accepted
    assert out.stats.draft_forwards == 1  # the prefill's: with no draft node the draft never catches up
    engine.datastore = None
    with pytest.raises(ValueError, match=r"outside \[1, 16\]"):
        engine.generate(prompts, policy=TreePolicy.sage(n_max=16, frontier=4), budget=(0, 4))
    with pytest.raises(ValueError, match="datastore chain needs retrieval"):
        TreePolicy.sage(datastore=True)


def test_a_damaged_datastore_is_one_line_and_never_unpickled(tmp_path):
    (tmp_path / datastore.FILE).write_bytes(b"\x80\x04junk, not a zip")
    with pytest.raises(ValueError, match="is not a readable datastore") as e:
        datastore.load(str(tmp_path))
    assert "allow_pickle" not in str(e.value) and "pickle" not in str(e.value)
