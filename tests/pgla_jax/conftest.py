"""Shared PGLA fixtures: the real MNIST 5k digits and the DLG LeNet (both cheap, built once per session)."""

import os

import pytest

from pgla_jax import data
from pgla_jax.config import VictimConfig
from pgla_jax.models import split_victim

FASHION = os.path.isdir(data.FASHION_MNIST_DIR)
needs_fashion = pytest.mark.skipif(not FASHION, reason=f"{data.FASHION_MNIST_DIR} missing (dataset-fashion-mnist)")


@pytest.fixture(scope="session")
def mnist():
    return data.load_mnist5k()


@pytest.fixture(scope="session")
def lenet():
    return split_victim(VictimConfig())
