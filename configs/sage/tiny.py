"""Seconds-scale smoke recipe on a random tiny target (no tokenizer: prompts are byte-encoded). Used by tests.

    python -m sage_jax.train_draft --config configs/sage/tiny.py --workdir /tmp/tiny_draft
"""

import ml_collections


def _train(**kw) -> ml_collections.ConfigDict:
    base = dict(steps=40, batch_size=8, lr=1e-2, warmup=5, weight_decay=0.0, clip=1.0, seed=0, prompt_weight=0.1,
                feature_weight=0.1, head_window=33, eval_every=20, ckpt_every=20, log_every=1)
    return ml_collections.ConfigDict({**base, **kw})


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.target = "tiny"  # "default" (SmolLM2-135M-Instruct), "tiny", or a GGUF / HF dir / checkpoint path
    c.target_seed = 0
    c.target_scale = 2.5  # tiny only: weights scaled so the target's distributions are not uniform
    c.seed = 0
    c.kinds = "eagle,lm"
    c.vocab_size = 64  # reduced draft vocabulary (0 = full)
    c.out_dtype = "float32"
    c.data = ml_collections.ConfigDict(dict(n_train=48, n_heldout=16, gen_batch=16, max_new_tokens=32,
                                            max_prompt_tokens=32))
    c.eagle = ml_collections.ConfigDict(dict(mlp_dim=0, chain_depth=5, train=_train()))
    c.lm = ml_collections.ConfigDict(dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                                          train=_train(feature_weight=0.0)))
    return c
