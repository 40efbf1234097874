"""The paper's STL-10 victim: `cifar100_lenet` on 96×96×3 STL-10 test images (10 classes) read through
tensorflow-datasets (prepared once where there is network: ``python -m pgla_jax.prepare_data stl10 --data-dir
DIR``). 9× CIFAR's unknowns: 8,000 L-BFGS iterations, and more may be needed (the attack was not run here: STL-10
cannot be prepared offline; its loader is tested on the catalogue's own STL-10 builder fed offline images,
tests/pgla_jax/test_tfds_sources.py).

    python -m pgla_jax.attack --config stl10_lenet --data-path DIR --denoiser none --images 2 --out runs/stl10
"""

import ml_collections

from configs.pgla import cifar100_lenet


def get_config() -> ml_collections.ConfigDict:
    c = cifar100_lenet.get_config()
    c.data.name = "tfds:stl10"
    c.victim.image_shape = (96, 96, 3)
    c.victim.num_classes = 10
    c.attack.iterations = 8000
    c.num_images = 2
    return c
