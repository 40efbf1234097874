"""A separate draft VLM for the home-trained VLM (`sage_jax/assets/smollm2_vlm`), the paper's setting: its own
2-layer tower and the first 2 of SmolLM2-135M's 30 layers with their own final norm, cut from the target and
distilled on the target's greedy answers to 2,048 training images and 1,024 training clips while seeing a random
share of the visual tokens (`sage_jax/training/vlm_draft.py`).

    python -m sage_jax.train_vlm --config smollm2_vlm_draft --workdir runs/smollm2_vlm_draft

The shipped draft was made in two runs: this recipe on images alone (`--set clip_rows=0`, 1,500 steps, when the
VLM took images only), then, once the VLM had its video stage, this recipe from that draft
(`--set init=runs/smollm2_vlm_draft_images/vlm_draft --set train.steps=400 --set train.warmup=20`); its
provenance records both.
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
        clip_rows=1024,
        heldout_clips=32,
        video_share=0.5,
    ))
