"""The shipped demo draft for SmolLM2-135M-Instruct: an EAGLE head over a 8,192-token draft vocabulary (plus a
small separate LM draft), self-distilled from the target's own greedy answers to prompts built from the Python
stdlib sources and the Python docs. Sized for a 2-core CPU: measured 31 min in all on a shared 2-core box (data
21 min: 224 greedy answers of 96 tokens + target features; EAGLE head 6 min; LM draft 4 min). Held-out
teacher-forced top-1 acceptance reached: EAGLE head 0.29, LM draft 0.10 (data-limited: 15k answer tokens).

    python -m sage_jax.train_draft --config configs/sage/smollm2_eagle.py --workdir runs/smollm2_eagle
"""

import ml_collections


def _train(**kw) -> ml_collections.ConfigDict:
    base = dict(steps=200, batch_size=8, lr=2e-3, warmup=20, weight_decay=0.0, clip=1.0, seed=0, prompt_weight=0.2,
                feature_weight=0.1, head_window=97, eval_every=50, ckpt_every=25, log_every=1)
    return ml_collections.ConfigDict({**base, **kw})


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.target = "default"
    c.target_seed = 0
    c.target_scale = 1.0
    c.seed = 0
    c.kinds = "eagle,lm"
    c.vocab_size = 8192
    c.out_dtype = "bfloat16"  # shipped size: the head is ~4.3 M params -> ~9 MB
    # Prompts: n_train from the Python sources/docs + n_general from WordNet (held-out: n_heldout + ...general).
    c.data = ml_collections.ConfigDict(dict(n_train=512, n_general=512, n_heldout=32, n_heldout_general=32,
                                            gen_batch=32, shard_rows=128, max_new_tokens=128,
                                            max_prompt_tokens=160))
    c.eagle = ml_collections.ConfigDict(dict(mlp_dim=0, chain_depth=5, train=_train()))
    c.lm = ml_collections.ConfigDict(dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, mlp_dim=704,
                                          train=_train(steps=100, lr=3e-3, feature_weight=0.0)))
    return c
