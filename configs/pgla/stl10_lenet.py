"""The paper's STL-10 victim: DLG LeNet on 96×96×3 test images read through tensorflow-datasets (prepared once
where there is network: ``python -m pgla_jax.prepare_data stl10 --data-dir DIR``). 9× CIFAR's unknowns: more
iterations than CIFAR's 4,000 may be needed (untested here: STL-10 cannot be prepared offline).

    python -m pgla_jax.attack --config stl10_lenet --data-path DIR --denoiser none --images 2 --out runs/stl10
"""

from pgla_jax.config import AttackConfig, DataConfig, ExperimentConfig, ProtectionConfig, VictimConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        data=DataConfig(name="tfds:stl10", split="test"),
        victim=VictimConfig(kind="lenet", image_shape=(96, 96, 3), num_classes=10),
        protection=ProtectionConfig(),
        attack=AttackConfig(kind="dlg", iterations=8000),
        batch_size=1,
        num_images=2,
    )
