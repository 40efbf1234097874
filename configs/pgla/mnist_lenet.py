"""The paper's setting: DLG LeNet (sigmoid, U(−0.5, 0.5) init) on MNIST digits, batch 1, Gaussian noise with the
released code's calibration at ε ∈ {1, 10, 50, 100}, DLG with 300 L-BFGS iterations.

    python -m pgla_jax.attack --config mnist_lenet --images 4 --out runs/mnist

The attacker's own data, Fashion-MNIST, under the same attack: ``--data fashion_mnist``; Inverting Gradients on
batches of 4: ``--attack ig --set batch_size=4``.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        kind="experiment",
        data=dict(name="mnist5k"),
        victim=dict(kind="lenet", image_shape=(28, 28, 1), num_classes=10),
        protection=dict(noise="gaussian", calibration="paper", delta=1e-4, clip=10.0, lr=1e-3, dataset_size=1),
        attack=dict(kind="dlg", iterations=300),
        batch_size=1,
        num_images=4,
        epsilons=(1.0, 10.0, 50.0, 100.0),
    ))
