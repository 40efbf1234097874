"""The paper's CIFAR-100 victim: `mnist_lenet`'s DLG LeNet (768 → 100) on 32×32×3 test images read through
tensorflow-datasets (prepared once where there is network: ``python -m pgla_jax.prepare_data cifar100 --data-dir
DIR``), with the 4,000 L-BFGS iterations colour needs. No denoiser is shipped for this victim's 85,036-entry
gradient:

    python -m pgla_jax.attack --config cifar100_lenet --data-path DIR --denoiser none --images 4 --out runs/cifar100
"""

import ml_collections

from configs.pgla import mnist_lenet


def get_config() -> ml_collections.ConfigDict:
    c = mnist_lenet.get_config()
    c.data = dict(name="tfds:cifar100", split="test")
    c.victim.image_shape = (32, 32, 3)
    c.victim.num_classes = 100
    c.attack.iterations = 4000
    return c
