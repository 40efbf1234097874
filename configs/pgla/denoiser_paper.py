"""The paper's denoiser scale, for an accelerator: the lucidrains U-Net at dim 120 (heads 4 × 32, mults (1, 2, 4)),
on the same 4,000 Fashion-MNIST surrogate gradients of the DLG LeNet as `denoiser_lenet`, batches of 32 for 2,500
steps (20 passes, the paper's 20 epochs). Data-parallel over every device present: `train_denoiser` shards each batch
over `configs/sharding.py`'s `data` axis, so the batch must divide by the device count (32: 1, 2, 4, 8, 16 or 32).

    python -m pgla_jax.train_denoiser --config denoiser_paper --workdir runs/denoiser_paper

Not trained in this repository (no accelerator has been available to it); the shipped checkpoint is `denoiser_lenet`
(width 16).
"""

import ml_collections

from configs.pgla import denoiser_lenet


def get_config() -> ml_collections.ConfigDict:
    # The shipped recipe (same gradients, schedule shape, t focus, DnCNN) with the paper's U-Net and batch.
    c = denoiser_lenet.get_config()
    c.unet.width = 120
    c.unet.head_dim = 32
    c.batch_size = 32
    c.steps = 2500
    c.lr = 2e-4
    return c
