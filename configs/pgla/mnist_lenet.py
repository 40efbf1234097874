"""The paper's setting: DLG LeNet (sigmoid, U(−0.5, 0.5) init) on MNIST digits, batch 1, Gaussian noise with the
released code's calibration at ε ∈ {1, 10, 50, 100}, DLG with 300 L-BFGS iterations.

    python -m pgla_jax.attack --config mnist_lenet --images 4 --out runs/mnist
"""

from pgla_jax.config import AttackConfig, DataConfig, ExperimentConfig, ProtectionConfig, VictimConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        data=DataConfig(name="mnist5k"),
        victim=VictimConfig(kind="lenet", image_shape=(28, 28, 1), num_classes=10),
        protection=ProtectionConfig(noise="gaussian", calibration="paper", delta=1e-4, clip=10.0, lr=1e-3,
                                    dataset_size=1),
        attack=AttackConfig(kind="dlg", iterations=300),
        batch_size=1,
        num_images=4,
        epsilons=(1.0, 10.0, 50.0, 100.0),
    )
