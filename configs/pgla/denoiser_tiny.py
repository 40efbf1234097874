"""Test-sized denoiser: `denoiser_lenet`'s recipe for the LeNet on 8×8 scikit-learn digits (8,026 parameters → a
90×90 image), a width-8 U-Net with one downsampling, the default t sampling, 4 training steps on 32 gradients, 2 DnCNN
steps. Seconds; used by the tests.

    python -m pgla_jax.train_denoiser --config denoiser_tiny --workdir /tmp/denoiser_tiny
"""

import dataclasses

from configs.pgla import denoiser_lenet
from pgla_jax.config import DataConfig, DenoiserConfig, GradientDataConfig, UNetConfig, VictimConfig


def get_config() -> DenoiserConfig:
    return dataclasses.replace(
        denoiser_lenet.get_config(),
        unet=UNetConfig(width=8, mults=(1, 2), groups=2, heads=2, head_dim=4, cond_channels=1),
        gradients=GradientDataConfig(victim=VictimConfig(image_shape=(8, 8, 1)), data=DataConfig(name="digits"),
                                     steps=4, per_step=8, lr=1e-3),
        steps=4,
        focus_t=DenoiserConfig.focus_t,
        focus_prob=DenoiserConfig.focus_prob,
        checkpoint_every=2,
        dncnn_steps=2,
    )
