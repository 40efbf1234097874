"""The paper's surrogate data: Fashion-MNIST (Debian `dataset-fashion-mnist`) on the DLG LeNet, batch 1.

    python -m pgla_jax.attack --config fashion_lenet --images 4 --out runs/fashion
"""

import dataclasses

from configs.pgla import mnist_lenet
from pgla_jax.config import DataConfig, ExperimentConfig


def get_config() -> ExperimentConfig:
    return dataclasses.replace(mnist_lenet.get_config(), data=DataConfig(name="fashion_mnist", split="train"))
