"""Inverting Gradients on a batch of 4 MNIST digits (distinct labels, recovered analytically), DLG LeNet.

    python -m pgla_jax.attack --config mnist_ig_batch4 --images 4 --out runs/ig
"""

import dataclasses

from configs.pgla import mnist_lenet
from pgla_jax.config import AttackConfig, ExperimentConfig


def get_config() -> ExperimentConfig:
    base = mnist_lenet.get_config()
    return dataclasses.replace(base, attack=AttackConfig(kind="ig", iterations=2000, lr=0.1, tv=1e-4),
                               batch_size=4, num_images=4)
