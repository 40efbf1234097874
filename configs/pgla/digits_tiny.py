"""CPU smoke setting: `mnist_lenet` on scikit-learn's 8×8 digits, the LeNet adapted to 8×8 (8,026 parameters), 2
images, ε ∈ {1, 100}, DLG with 50 L-BFGS iterations. Seconds on a laptop; used by the CLI tests.

    python -m pgla_jax.attack --config digits_tiny --out runs/tiny
"""

import ml_collections

from configs.pgla import mnist_lenet


def get_config() -> ml_collections.ConfigDict:
    c = mnist_lenet.get_config()
    c.data.name = "digits"
    c.victim.image_shape = (8, 8, 1)
    c.attack.iterations = 50
    c.num_images = 2
    c.epsilons = (1.0, 100.0)
    return c
