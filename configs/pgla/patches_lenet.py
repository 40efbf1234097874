"""DLG LeNet on 32×32×3 colour patches of scikit-image's photos (offline, CIFAR-shaped), batch 1, 4,000 L-BFGS
iterations (300 reach ~9 dB on colour; 4,000 give 27-37 dB, tests/pgla_jax/test_inversion.py). The shipped denoiser
for this victim is the Gaussian prior of pgla_jax/assets/patches32 (`denoiser_patches`; no U-Net), the default
``--denoiser shipped``:

    python -m pgla_jax.attack --config patches_lenet --images 2 --epsilons 1 --out runs/patches
"""

from pgla_jax.config import AttackConfig, DataConfig, ExperimentConfig, ProtectionConfig, VictimConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        data=DataConfig(name="skimage_patches"),
        victim=VictimConfig(kind="lenet", image_shape=(32, 32, 3), num_classes=10),
        protection=ProtectionConfig(),
        attack=AttackConfig(kind="dlg", iterations=4000),
        batch_size=1,
        num_images=4,
    )
