"""The home-trained VLM: LLaVA-OneVision around the shipped SmolLM2-135M-Instruct (frozen), a 4-layer SigLIP-style
tower of width 192 on 28-pixel tiles of 7x7 patches (36 visual tokens an image), trained on Fashion-MNIST's train
split, MNIST 5k, scikit-learn's digits and crops of scikit-image photos (`sage_jax/training/vlm_data.py`).
Fashion-MNIST's test split is held out. Its draft: the shipped EAGLE-style head fine-tuned on the VLM's greedy
answers to 512 training images and 256 training clips (`sage_jax/training/vlm_head.py`). The recipe of
`sage_jax/assets/smollm2_vlm`.

    python -m sage_jax.train_vlm --config smollm2_vlm --workdir runs/smollm2_vlm
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        kind="vlm",
        vision=dict(hidden_size=192, intermediate_size=768, num_layers=4, num_heads=6, image_size=28, patch_size=7,
                    hidden_act="gelu_pytorch_tanh"),
        tower=dict(steps=5000, batch_size=128, lr=2e-3, warmup=50, weight_decay=0.05, ckpt_every=250),
        align=dict(steps=400, batch_size=8, lr=2e-3, warmup=20, ckpt_every=25, eval_every=150),
        # Every visual token, not only their mean, classifies the image through the tower stage's probe: the warm
        # start then maps each token to its class's word, and tokens that already agree make that map fit.
        token_loss=1.0,
        # Clips of three items (vlm_data.clip, 24 frames: 97 visual tokens), 6 of every 8 rows; the other 2 are
        # image rows, which keep the image answers.
        video=dict(steps=600, batch_size=8, lr=1e-3, warmup=20, ckpt_every=25, eval_every=150),
        video_share=0.75,
        video_seq_len=160,
        draft=dict(steps=300, batch_size=16, lr=2e-4, warmup=20, ckpt_every=100),
        draft_rows=512,
        draft_clips=256,
    ))
