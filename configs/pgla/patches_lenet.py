"""The colour victim of the shipped prior: `cifar100_lenet`'s DLG LeNet and 4,000 L-BFGS iterations (300 reach
~9 dB on colour; 4,000 give 27-37 dB, tests/pgla_jax/test_inversion.py) on 32×32×3 patches of scikit-image's photos
(offline, CIFAR-shaped, 10 classes). Its denoiser is the Gaussian prior of pgla_jax/assets/patches32
and its learned correction (`denoiser_patches`; no U-Net), the default ``--denoiser shipped``:

    python -m pgla_jax.attack --config patches_lenet --images 2 --epsilons 1 --out runs/patches

CIFAR-10's python-pickle batches (never downloaded) under the same attack: ``--data cifar10 --data-path DIR``.
"""

import ml_collections

from configs.pgla import cifar100_lenet


def get_config() -> ml_collections.ConfigDict:
    c = cifar100_lenet.get_config()
    c.data = dict(name="skimage_patches")
    c.victim.num_classes = 10
    return c
