"""Seconds-scale smoke recipe on a random tiny target (no tokenizer: prompts are byte-encoded): an EAGLE-style head
and a 2-layer LM draft over a 64-id draft vocabulary. Used by the tests.

    python -m sage_jax.train_draft --config tiny --workdir /tmp/tiny_draft
"""

import ml_collections

TRAIN = dict(steps=40, lr=1e-2, warmup=5, head_window=33, eval_every=20, ckpt_every=20)


def get_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        kind="draft",
        target="tiny", target_scale=2.5, kinds=("eagle", "lm"), vocab_size=64, out_dtype="float32",
        data=dict(n_train=48, n_heldout=16, gen_batch=16, max_new_tokens=32, max_prompt_tokens=32),
        eagle=dict(train=dict(TRAIN)),
        lm=dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                train=dict(TRAIN, feature_weight=0.0)),
    ))
