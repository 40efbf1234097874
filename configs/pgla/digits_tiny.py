"""CPU smoke setting: scikit-learn 8×8 digits, LeNet adapted to 8×8 (8,026 parameters), 2 images, ε ∈ {1, 100},
DLG with 50 L-BFGS iterations. Seconds on a laptop; used by the CLI tests.

    python -m pgla_jax.attack --config digits_tiny --out runs/tiny
"""

from pgla_jax.config import AttackConfig, DataConfig, ExperimentConfig, ProtectionConfig, VictimConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        data=DataConfig(name="digits"),
        victim=VictimConfig(kind="lenet", image_shape=(8, 8, 1), num_classes=10),
        protection=ProtectionConfig(),
        attack=AttackConfig(kind="dlg", iterations=50),
        batch_size=1,
        num_images=2,
        epsilons=(1.0, 100.0),
    )
