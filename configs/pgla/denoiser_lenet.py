"""The shipped denoiser's recipe (the paper's setting on CPU): gradients of the DLG LeNet (28×28, 13,426 parameters)
as a 116×116 image; a width-16 U-Net (the paper: 120) with mults (1, 2, 4) and a condition channel trained with 50 %
dropout (one checkpoint is both the unconditional model and its conditional variant); DDPM with T = 1000, linear β;
4,000 Fashion-MNIST surrogate gradients, batches of 4, 3,000 steps; then the DnCNN baseline, 3,000 steps.

    python -m pgla_jax.train_denoiser --config denoiser_lenet --workdir runs/denoiser_lenet

The shipped weights (pgla_jax/assets/lenet28) are this run extended to 7,000 steps with `--steps 7000 --extend`.
Its refiner (the prior's learned correction) was trained on the shipped prior, in a work folder holding a copy of it:

    mkdir -p runs/refiner_lenet && cp -r pgla_jax/assets/lenet28/prior runs/refiner_lenet/
    python -m pgla_jax.train_denoiser --config denoiser_lenet --workdir runs/refiner_lenet --refiner-only
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        kind="denoiser",
        unet=dict(width=16, mults=(1, 2, 4), groups=4, heads=4, head_dim=8, cond_channels=1),
        # The surrogate LeNet (the victim's architecture) trained on Fashion-MNIST, the attacker's own data.
        gradients=dict(victim=dict(kind="lenet", image_shape=(28, 28, 1)),
                       data=dict(name="fashion_mnist", split="train"), steps=250, per_step=16, lr=1e-3),
        layout="image2d",
        batch_size=4,
        steps=3000,
        lr=1e-3,
        focus_t=32,
        focus_prob=0.9,
        checkpoint_every=250,
        dncnn_steps=3000,
        # The prior's learned correction (pgla_jax/denoise/refiner.py), on 32,000 gradients of the same trajectory,
        # half of the images varied.
        refiner=dict(steps=8000),
    ))
