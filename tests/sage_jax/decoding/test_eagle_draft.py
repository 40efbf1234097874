"""EAGLE-style heads plug into the decoding loop: lossless for every policy, with and without a reduced vocabulary,
and through a saved head checkpoint."""

import jax
import numpy as np

from sage_jax.decoding.drafts import EagleWeights
from sage_jax.decoding.policies import POLICIES
from sage_jax.draft import eagle
from sage_jax.draft.vocab import DraftVocab
from sage_jax.engine import Engine


def test_eagle_head_every_policy_matches_ar(tiny_lm, tmp_path):
    target = tiny_lm(0, vocab_size=64, n_layers=2, eos_token_ids=(7,))
    serving = target.serving()
    cfg = eagle.head_config(target.cfg)
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, eagle.init_params(cfg, seed=1))
    prompts = [[3, 4, 5, 6, 8], [9, 10, 11]]
    ref = Engine(target).generate(prompts, policy="ar", max_new_tokens=24).token_ids
    full = EagleWeights(head=params, vocab=None, cfg=cfg)
    ids = np.arange(0, 64, 2)  # a reduced vocabulary: even ids only
    reduced = EagleWeights(head=params, vocab=DraftVocab.build(ids, serving.embed, serving.lm_head), cfg=cfg)
    for weights, names in ((full, POLICIES), (reduced, ("sage",))):
        engine = Engine(target, weights)
        assert engine.draft_spec.kind == "eagle"
        for name in names:
            out = engine.generate(prompts, policy=name, max_new_tokens=24)
            assert out.token_ids == ref, name
            assert out.stats.draft_forwards > out.stats.steps
    path = eagle.save_head(str(tmp_path / "head"), cfg, params, target_cfg=target.cfg, vocab_ids=ids)
    engine = Engine(target, path)
    assert engine.generate(prompts, policy="sage", max_new_tokens=24).token_ids == ref
