"""The first demo-draft recipe for SmolLM2-135M-Instruct (shipped until 2026-11-30; `smollm2_eagle_chat` extends it
and trained the head shipped now in `sage_jax/assets/smollm2_eagle`): an EAGLE-style head over
an 8,192-token draft vocabulary, self-distilled from the target's own greedy answers (128 new tokens) to 963
offline prompts (Python stdlib code / Python docs prose / WordNet general topics; 77k answer + 70k prompt tokens),
with the target's features kept by the one-pass rollout, and trained with 2-level training-time test.

Measured on the shared 2-core CPU box, 2026-11-30 (other jobs running): data 42 min (rollout), head 32 min
(450 steps of 8 rows, ~4 s/step). Held-out (63 rows never trained on): teacher-forced top-1 agreement 0.36,
greedy chain of 5: τ+1 1.69. 6.4 MB in bfloat16.

    python -m sage_jax.train_draft --config configs/sage/smollm2_eagle.py --workdir runs/smollm2_eagle
"""

import ml_collections


def _train(**kw) -> ml_collections.ConfigDict:
    base = dict(steps=200, batch_size=8, lr=2e-3, warmup=20, weight_decay=0.0, clip=1.0, seed=0, prompt_weight=0.2,
                feature_weight=0.1, head_window=129, eval_every=50, ckpt_every=25, log_every=1)
    return ml_collections.ConfigDict({**base, **kw})


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.target = "default"
    c.target_seed = 0
    c.target_scale = 1.0
    c.seed = 0
    c.kinds = "eagle"  # the shipped draft; "eagle,lm" also trains the small separate LM draft below
    c.vocab_size = 8192
    c.out_dtype = "bfloat16"  # shipped size: the head is ~4.3 M params -> ~9 MB
    # Prompts: n_train from the Python sources/docs + n_general from WordNet (held-out: n_heldout + ...general).
    c.data = ml_collections.ConfigDict(dict(n_train=512, n_general=512, n_heldout=32, n_heldout_general=32,
                                            gen_batch=32, shard_rows=128, max_new_tokens=128,
                                            max_prompt_tokens=160))
    c.eagle = ml_collections.ConfigDict(dict(mlp_dim=0, chain_depth=5,
                                             train=_train(steps=450, unroll=2, eval_every=150, ckpt_every=50)))
    c.lm = ml_collections.ConfigDict(dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, mlp_dim=704,
                                          train=_train(steps=100, lr=3e-3, feature_weight=0.0)))
    return c
