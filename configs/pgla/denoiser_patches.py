"""The colour victim's denoiser (`patches_lenet`: the DLG LeNet on 32×32×3, 15,826 parameters): the Gaussian prior of
4,000 surrogate gradients of the attacker's own colour patches (`surrogate_patches`: photos none of the private
patches come from), fitted in about a minute, and its learned correction (8,000 steps, ~8 min on two cores). The
U-Net fields are `denoiser_lenet`'s, for a run with a device; on CPU fit the prior alone, then train the correction
on it:

    python -m pgla_jax.train_denoiser --config denoiser_patches --workdir runs/denoiser_patches --prior-only
    python -m pgla_jax.train_denoiser --config denoiser_patches --workdir runs/denoiser_patches --refiner-only

The shipped pgla_jax/assets/patches32/prior is the first command's WORKDIR/prior, …/refiner the second's
WORKDIR/refiner, trained on a copy of the shipped prior. On 16 patches none of the tables reads (`data.pick(ds, 16,
seed=123)`) it raises the prior's gradient cosine on 16 / 16 at every ε of the table with t* > 0 (Gaussian ε = 1:
0.99690 → 0.99787).
"""

import ml_collections

from configs.pgla import denoiser_lenet


def get_config() -> ml_collections.ConfigDict:
    c = denoiser_lenet.get_config()
    c.gradients.victim.image_shape = (32, 32, 3)
    c.gradients.data = dict(name="surrogate_patches", split="train")
    # The prior's learned correction trains on the same victim and data (its own draws: refiner.gradients.seed).
    c.refiner.gradients = dict(victim=dict(image_shape=(32, 32, 3)), data=dict(name="surrogate_patches", split="train"))
    return c
