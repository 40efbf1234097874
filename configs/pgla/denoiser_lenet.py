"""The shipped denoiser (paper setting): gradients of the DLG LeNet (28×28, 13,426 parameters) as a 116×116 image,
a U-Net of width 16 (the paper: 120) with mults (1, 2, 4), DDPM T = 1000 linear β, trained on CPU on 4,000
Fashion-MNIST surrogate gradients: 3,000 steps of 4 (three passes), 78 min on a 2-core CPU (1.1–1.4 s per step
alone), then the DnCNN baseline for 3,000 steps (7 min). The conditional channel is trained with 50% dropout, so
one checkpoint serves the paper's unconditional model (condition zeroed) and its conditional variant. The shipped
weights went on to 7,000 steps, a warm restart of the stretched cosine schedule (~1.1 s per step alone):

    python -m pgla_jax.train_denoiser --config denoiser_lenet --workdir runs/denoiser_lenet
    python -m pgla_jax.train_denoiser --config denoiser_lenet --workdir runs/denoiser_lenet --steps 7000 --extend
"""

from pgla_jax.config import DenoiserConfig, GradientDataConfig, UNetConfig, VictimConfig


def get_config() -> DenoiserConfig:
    return DenoiserConfig(
        unet=UNetConfig(width=16, mults=(1, 2, 4), groups=4, heads=4, head_dim=8, cond_channels=1),
        gradients=GradientDataConfig(victim=VictimConfig(), steps=250, per_step=16, lr=1e-3),
        layout="image2d",
        batch_size=4,
        steps=3000,
        lr=1e-3,
        focus_t=32,
        focus_prob=0.9,
        checkpoint_every=250,
        dncnn_steps=3000,
    )
