"""A separate draft VLM for the home-trained VLM (`sage_jax/assets/smollm2_vlm`), the paper's setting: its own
2-layer tower and the first 2 of SmolLM2-135M's 30 layers with their own final norm, cut from the target and
distilled on the target's greedy answers to 2,048 training images while seeing a random share of the visual tokens
(`sage_jax/training/vlm_draft.py`).

    python -m sage_jax.train_vlm --config smollm2_vlm_draft --workdir runs/smollm2_vlm_draft
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        kind="vlm_draft",
        tower_layers=2,
        lm_layers=2,
        train=dict(steps=1500, batch_size=16, lr=5e-4, warmup=50, weight_decay=0.0, ckpt_every=100, eval_every=500),
        rows=2048,
        heldout_rows=128,
    ))
