"""DLG LeNet on 32×32×3 CIFAR-10 images from local python-pickle files (never downloaded; pass the folder), with the
4,000 L-BFGS iterations that colour needs (configs/pgla/patches_lenet.py).

    python -m pgla_jax.attack --config cifar10_lenet --data-path ~/data/cifar-10-batches-py --out runs/cifar
"""

from pgla_jax.config import AttackConfig, DataConfig, ExperimentConfig, ProtectionConfig, VictimConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        data=DataConfig(name="cifar10", split="test", path=None),
        victim=VictimConfig(kind="lenet", image_shape=(32, 32, 3), num_classes=10),
        protection=ProtectionConfig(),
        attack=AttackConfig(kind="dlg", iterations=4000),
        batch_size=1,
        num_images=4,
    )
