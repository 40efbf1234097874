"""Test-sized denoiser: `denoiser_lenet`'s recipe for the LeNet on 8×8 scikit-learn digits (8,026 parameters → a
90×90 image), a width-8 U-Net with one downsampling, the default t sampling, 4 training steps on 32 gradients, 2 DnCNN
steps, a 4-step learned correction of the prior. Seconds; used by the tests.

    python -m pgla_jax.train_denoiser --config denoiser_tiny --workdir /tmp/denoiser_tiny
"""

import ml_collections

from configs.pgla import denoiser_lenet


def get_config() -> ml_collections.ConfigDict:
    c = denoiser_lenet.get_config()
    c.unet = dict(width=8, mults=(1, 2), groups=2, heads=2, head_dim=4, cond_channels=1)
    c.gradients.victim.image_shape = (8, 8, 1)
    c.gradients.data = dict(name="digits", split="train")
    c.gradients.steps = 4
    c.gradients.per_step = 8
    c.steps = 4
    c.focus_t = 64  # DenoiserConfig's default t sampling
    c.focus_prob = 0.8
    c.checkpoint_every = 2
    c.dncnn_steps = 2
    # The prior's learned correction on the same tiny victim: 4 steps on 4 × 8 gradients of its own.
    c.refiner = dict(steps=4, batch_size=8, checkpoint_every=2, hidden=16,
                     gradients=dict(victim=dict(image_shape=(8, 8, 1)), data=dict(name="digits", split="train"),
                                    steps=4, per_step=8))
    return c
