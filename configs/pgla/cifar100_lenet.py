"""The paper's CIFAR-100 victim: DLG LeNet (768 → 100) on 32×32×3 test images read through tensorflow-datasets
(prepared once where there is network: ``python -m pgla_jax.prepare_data cifar100 --data-dir DIR``), with the 4,000
L-BFGS iterations colour needs. No denoiser is shipped for this victim's 85,036-entry gradient:

    python -m pgla_jax.attack --config cifar100_lenet --data-path DIR --denoiser none --images 4 --out runs/cifar100
"""

from pgla_jax.config import AttackConfig, DataConfig, ExperimentConfig, ProtectionConfig, VictimConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        data=DataConfig(name="tfds:cifar100", split="test"),
        victim=VictimConfig(kind="lenet", image_shape=(32, 32, 3), num_classes=100),
        protection=ProtectionConfig(),
        attack=AttackConfig(kind="dlg", iterations=4000),
        batch_size=1,
        num_images=4,
    )
