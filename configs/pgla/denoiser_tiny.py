"""Test-sized denoiser: the LeNet on 8×8 digits (8,026 parameters → a 92×92 image), width-8 U-Net, a few steps on
gradients of scikit-learn digits. Seconds; used by the tests.

    python -m pgla_jax.train_denoiser --config denoiser_tiny --workdir /tmp/denoiser_tiny
"""

from pgla_jax.config import DataConfig, DenoiserConfig, GradientDataConfig, UNetConfig, VictimConfig


def get_config() -> DenoiserConfig:
    return DenoiserConfig(
        unet=UNetConfig(width=8, mults=(1, 2), groups=2, heads=2, head_dim=4, cond_channels=1),
        gradients=GradientDataConfig(victim=VictimConfig(image_shape=(8, 8, 1)), data=DataConfig(name="digits"),
                                     steps=4, per_step=8, lr=1e-3),
        layout="image2d",
        batch_size=4,
        steps=4,
        lr=1e-3,
        checkpoint_every=2,
        dncnn_steps=2,
    )
