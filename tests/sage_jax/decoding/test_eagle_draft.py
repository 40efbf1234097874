"""EAGLE-style heads plug into the decoding loop: lossless with and without a reduced vocabulary, and through a
saved head checkpoint."""

import jax
import numpy as np
import pytest

from sage_jax.engine import Engine, load_engine
from sage_jax.io import lm_checkpoint
from sage_jax.models import eagle_head
from sage_jax.models.causal_lm import CausalLM
from sage_jax.models.draft_vocab import DraftVocab
from sage_jax.models.eagle_head import EagleWeights


@pytest.mark.integration
def test_eagle_head_matches_ar(tiny_lm, tmp_path):
    """An EAGLE head drafts for a level-built template tree and for SAGE (every policy is lossless with LM drafts
    in test_lossless; here the head's feature plumbing is what is tested), over the full vocabulary and, loaded
    from a checkpoint, over a reduced one."""
    target = tiny_lm(0, vocab_size=64, n_layers=2, eos_token_ids=(7,))
    cfg = eagle_head.head_config(target.cfg)
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, eagle_head.init_params(cfg, seed=1))
    prompts = [[3, 4, 5, 6, 8], [9, 10, 11]]
    ref = Engine(target).generate(prompts, policy="ar", max_new_tokens=24).token_ids
    engine = Engine(target, EagleWeights(head=params, vocab=None, cfg=cfg))
    assert engine.draft_spec.kind == "eagle"
    for name in ("static", "sage"):
        out = engine.generate(prompts, policy=name, max_new_tokens=24)
        assert out.token_ids == ref, name
        assert out.stats.draft_forwards > out.stats.steps and out.stats.mean_accepted > 0
    ids = np.arange(0, 64, 2)  # a reduced vocabulary: even ids only
    path = lm_checkpoint.save_head(str(tmp_path / "head"), cfg, params, target_cfg=target.cfg, vocab_ids=ids)
    prior = {"sage": {"n_max": 64, "d_cap": 10, "steps": 3}}
    lm_checkpoint.write_acceptance(path, {"policies": prior})  # what `evaluate_draft --write-prior` stores
    engine = load_engine(CausalLM(target), path)  # a head checkpoint is recognised as an EAGLE draft
    assert engine.draft_spec.kind == "eagle" and engine.description == f"EAGLE head {path}"
    assert engine.acceptance_prior == prior
    vocab = engine.draft.vocab
    assert isinstance(vocab, DraftVocab) and np.asarray(vocab.ids).tolist() == ids.tolist()
    out = engine.generate(prompts, policy="sage", max_new_tokens=24)
    assert out.token_ids == ref and out.stats.draft_forwards > out.stats.steps


@pytest.mark.integration
def test_fused_head_with_its_own_vocab_head_matches_ar(tiny_lm, tmp_path):
    """An EAGLE-3-style head (tapped target layers fused, its own LM head over a reduced vocabulary) drafts
    losslessly, directly and from its checkpoint; its drafts really read the taps (other taps, other drafts)."""
    target = tiny_lm(0, vocab_size=64, n_layers=3, eos_token_ids=(7,))
    cfg = eagle_head.head_config(target.cfg)
    ids = np.arange(0, 64, 2)
    params = eagle_head.init_params(cfg, seed=1, n_taps=3, head_vocab=len(ids))
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, params)
    prompts = [[3, 4, 5, 6, 8], [9, 10, 11]]
    ref = Engine(target).generate(prompts, policy="ar", max_new_tokens=24).token_ids
    serving = target.serving()

    def engine(taps):
        w = EagleWeights.build(cfg, params, ids, serving.cfg, serving.embed, serving.lm_head, taps=taps)
        return Engine(target, w)

    outs = {}
    for taps in ((0, 1, 2), (2, 1, 0)):
        out = engine(taps).generate(prompts, policy="sage", max_new_tokens=16)
        assert out.token_ids == [r[:16] for r in ref], taps
        outs[taps] = out.stats
    assert outs[(0, 1, 2)].draft_forwards > outs[(0, 1, 2)].steps
    assert outs[(0, 1, 2)].alpha_trace != outs[(2, 1, 0)].alpha_trace  # the fused taps shape the drafts
    path = lm_checkpoint.save_head(str(tmp_path / "head3"), cfg, params, target_cfg=target.cfg, vocab_ids=ids,
                                   taps=(0, 1, 2))
    loaded = load_engine(CausalLM(target), path)
    assert loaded.draft.taps == (0, 1, 2) and "lm_head" not in loaded.draft.head
    np.testing.assert_array_equal(np.asarray(loaded.draft.vocab.head), np.asarray(params["lm_head"]))
    # (a trained fused head decodes from its checkpoint in tests/sage_jax/training/test_features.py)
    with pytest.raises(ValueError, match="taps"):
        EagleWeights.build(cfg, params, ids, serving.cfg, serving.embed, serving.lm_head, taps=(0, 1))
