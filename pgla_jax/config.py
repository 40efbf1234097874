"""Frozen configs for the PGLA attack side: data, victim, protection, attack, and the experiment that joins them.

Every field that changes a compiled shape (image size, batch, iteration counts, restarts) lives here, so a config
is hashable and can be a static argument of `jax.jit`. Values that vary per call (ε, keys) are arrays.

The presets in `configs/pgla/` are data: `get_config()` returns an `ml_collections.ConfigDict` with
``kind = "experiment"`` (`ExperimentConfig`) or ``kind = "denoiser"`` (`DenoiserConfig`), validated by the class's
`from_config` (`configs.schema`; a group may give only some of its fields):

    cfg = ExperimentConfig.from_config(mnist_lenet.get_config())
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Literal

from configs.schema import COUNT, POSITIVE, Range, Schema

DatasetName = Literal["mnist5k", "fashion_mnist", "digits", "skimage_patches", "surrogate_patches", "cifar10",
                      "cifar100"]
#: The data sets read from files (`pgla_jax.data.load`); "tfds:<name>" names a prepared tfds dataset besides.
DATASETS: tuple[str, ...] = typing.get_args(DatasetName)


def is_dataset_name(name: str) -> bool:
    return name in DATASETS or (name.startswith("tfds:") and len(name) > len("tfds:"))

VictimKind = Literal["lenet", "mlp", "convnet", "resnet"]
NoiseKind = Literal["gaussian", "laplace"]
Calibration = Literal["paper", "dpsgd"]
AttackKind = Literal["dlg", "idlg", "ig"]


@dataclasses.dataclass(frozen=True)
class DataConfig:
    name: DatasetName | str = "mnist5k"  # or "tfds:<name>": a prepared tfds dataset (pgla_jax.tfds_sources)
    split: Literal["train", "test"] = "train"  # Fashion-MNIST / CIFAR files only; the others have one split
    path: str | None = None  # CIFAR: folder of the python-pickle batches; tfds: the data_dir (never downloaded)
    seed: int = 0  # which images are picked as the clients' private data


@dataclasses.dataclass(frozen=True)
class VictimConfig:
    kind: VictimKind = "lenet"
    image_shape: tuple[int, int, int] = (28, 28, 1)  # H, W, C
    num_classes: Annotated[int, POSITIVE] = 10
    seed: int = 0  # DLG uses one fixed random init; the attack knows the weights (honest-but-curious server)
    width: Annotated[int, POSITIVE] = 12  # channels (conv nets) or hidden units / 8 (MLP); 12 is the DLG LeNet


@dataclasses.dataclass(frozen=True)
class ProtectionConfig:
    """Gradient perturbation applied by the client before sending.

    `paper`: the released Mjölnir code's calibration, M = (2·lr·C/m)·scale(ε, δ), noise added to the raw
    gradient with **no clipping** (its bug (c), kept on purpose for fidelity). `dpsgd`: per-example clipping to C
    and σ = z·C with z from (ε, δ) by a privacy accountant, noise on the summed clipped gradient, then averaged.
    """

    noise: NoiseKind = "gaussian"
    calibration: Calibration = "paper"
    delta: Annotated[float, Range(0.0, 1.0)] = 1e-4  # the released code's `10e-5`
    clip: Annotated[float, Range(0.0)] = 10.0  # C
    lr: Annotated[float, Range(0.0)] = 1e-3  # victim learning rate (enters the paper's sensitivity only)
    dataset_size: Annotated[int, POSITIVE] = 1  # m in the paper's sensitivity 2·lr·C/m
    steps: Annotated[int, POSITIVE] = 1  # DP-SGD: releases composed by the accountant
    sampling_rate: Annotated[float, Range(0.0, 1.0)] = 1.0  # DP-SGD: Poisson sampling probability per release
    # keep this fraction of largest-|g| entries (None: no pruning)
    topk: Annotated[float, Range(0.0, 1.0)] | None = None
    quant_bits: Annotated[int, POSITIVE] | None = None  # uniform per-tensor quantisation (None: off)


@dataclasses.dataclass(frozen=True)
class AttackConfig:
    kind: AttackKind = "dlg"
    # L-BFGS iterations (DLG/iDLG: 300) or signed-Adam steps (IG: 2000)
    iterations: Annotated[int, POSITIVE] | None = None
    restarts: Annotated[int, POSITIVE] = 1  # vmapped random initialisations; the best final matching loss wins
    # DLG/iDLG: None = zoom line search, a float = fixed step; IG: Adam step (0.1)
    lr: Annotated[float, Range(0.0)] | None = None
    # L-BFGS history: torch.optim.LBFGS's history_size, which DLG runs with. 10 pairs (optax's default) converge
    # far slower on this ill-conditioned objective: 32×32×3 DLG at 3,000 iterations reaches ~12 dB with 10, ~29 with
    # 100.
    memory: Annotated[int, POSITIVE] = 100
    tv: Annotated[float, Range(0.0)] = 1e-4  # IG total-variation weight
    seed: int = 0

    def resolved(self) -> AttackConfig:
        """The same config with the attack's own defaults filled in for every None."""
        iterations = self.iterations if self.iterations is not None else (2000 if self.kind == "ig" else 300)
        lr = self.lr if (self.lr is not None or self.kind != "ig") else 0.1
        return dataclasses.replace(self, iterations=iterations, lr=lr)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(Schema):
    """An attack experiment: `python -m pgla_jax.attack --config NAME`."""

    KIND = "experiment"

    data: DataConfig = DataConfig()
    victim: VictimConfig = VictimConfig()
    protection: ProtectionConfig = ProtectionConfig()
    attack: AttackConfig = AttackConfig()
    batch_size: Annotated[int, POSITIVE] = 1  # images per client gradient
    num_images: Annotated[int, POSITIVE] = 4  # images attacked by the CLI (in batches of `batch_size`)
    epsilons: tuple[float, ...] = (1.0, 10.0, 50.0, 100.0)

    def replace(self, **kw) -> ExperimentConfig:
        return dataclasses.replace(self, **kw)


# ---------------------------------------------------------------------------------------------------------------
# Part 2: the gradient diffusion denoiser.
# ---------------------------------------------------------------------------------------------------------------

Layout = Literal["image2d", "vector1d", "per_layer"]
SamplerKind = Literal["ddpm", "ddim", "oneshot", "nonadaptive", "conditional", "released"]


@dataclasses.dataclass(frozen=True)
class UNetConfig:
    """The paper's lucidrains-style U-Net (dim 120, mults (1, 2, 4), 4 GroupNorm groups); `dims=1` is the 1-D
    variant over a flat gradient vector. Narrower than the paper on CPU (`width`)."""

    width: Annotated[int, POSITIVE] = 16  # the paper's `dim` (120)
    mults: tuple[int, ...] = (1, 2, 4)  # channel multiplier per level; len(mults) − 1 downsamplings
    groups: Annotated[int, POSITIVE] = 4  # GroupNorm groups (`resnet_block_groups`)
    heads: Annotated[int, POSITIVE] = 4
    head_dim: Annotated[int, POSITIVE] = 8  # the paper: 4 heads × 32
    dims: Literal[1, 2] = 2  # 2: gradient image [H, W, 1]; 1: gradient vector [L, 1]
    cond_channels: Annotated[int, COUNT] = 0  # conditional variant: the noisy gradient as extra input channel(s)

    @property
    def multiple(self) -> int:
        """Each spatial side must be a multiple of this (one 2× space-to-depth per downsampling)."""
        return 2 ** (len(self.mults) - 1)


@dataclasses.dataclass(frozen=True)
class DiffusionConfig:
    """DDPM as in the paper: T = 1000, linear β from 1e-4 to 0.02, ε-prediction, Huber loss."""

    timesteps: Annotated[int, POSITIVE] = 1000
    beta_start: Annotated[float, Range(0.0, 1.0)] = 1e-4
    beta_end: Annotated[float, Range(0.0, 1.0)] = 0.02


@dataclasses.dataclass(frozen=True)
class GradientDataConfig:
    """Clean training gradients: a surrogate LeNet trained on the attacker's own Fashion-MNIST, batch-1 gradients
    of random images taken along its SGD trajectory (the released `utils/dataset.py` uses SGD, lr 1e-3)."""

    victim: VictimConfig = VictimConfig()  # the surrogate has the victim's architecture and global weights
    data: DataConfig = DataConfig(name="fashion_mnist", split="train")
    steps: Annotated[int, POSITIVE] = 250  # surrogate SGD steps
    per_step: Annotated[int, POSITIVE] = 16  # batch-1 gradients recorded at each step (of that step's batch)
    lr: Annotated[float, Range(0.0)] = 1e-3
    seed: int = 0
    # Fraction of the images varied before their gradient is taken (`gradients.augment`: shifts, edge maps,
    # thresholds, contrast): what a model trained on them learns then holds beyond the surrogate's own statistics.
    augment: Annotated[float, Range(0.0, 1.0)] = 0.0


@dataclasses.dataclass(frozen=True)
class RefinerConfig:
    """The learned part of the prior's denoiser (`denoise/refiner.py`): an MLP in the prior's eigenbasis trained on
    its own surrogate gradients (the surrogate trajectory, half of the images varied) with fresh noise of every
    level of the grid below at each step."""

    hidden: Annotated[int, POSITIVE] = 512
    steps: Annotated[int, COUNT] = 0  # 0: no refiner
    batch_size: Annotated[int, POSITIVE] = 256
    lr: Annotated[float, Range(0.0)] = 3e-4
    weight_decay: Annotated[float, Range(0.0)] = 1e-2
    gradients: GradientDataConfig = GradientDataConfig(per_step=128, augment=0.5, seed=1)
    noises: tuple[NoiseKind, ...] = ("gaussian", "laplace")
    epsilons: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0, 4.0, 10.0)  # paper calibration
    checkpoint_every: Annotated[int, POSITIVE] = 500
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class DenoiserConfig(Schema):
    """Everything `python -m pgla_jax.train_denoiser` needs; stored in the checkpoint's metadata.json."""

    KIND = "denoiser"

    unet: UNetConfig = UNetConfig()
    diffusion: DiffusionConfig = DiffusionConfig()
    gradients: GradientDataConfig = GradientDataConfig()
    layout: Layout = "image2d"
    # image2d: the square's side (None: the smallest that fits and divides); 116 for LeNet
    side: Annotated[int, POSITIVE] | None = None
    batch_size: Annotated[int, POSITIVE] = 8
    steps: Annotated[int, POSITIVE] = 2000
    lr: Annotated[float, Range(0.0)] = 2e-4
    # t sampling: with probability `focus_prob` t is uniform on [0, focus_t), else uniform on [0, T). A legitimate
    # importance weighting of the ε-loss over t (every t is still trained): the paper's noise maps to t* ≤ 24.
    focus_t: Annotated[int, POSITIVE] = 64
    focus_prob: Annotated[float, Range(0.0, 1.0)] = 0.8
    # conditional models: fraction of examples trained without the condition
    cond_dropout: Annotated[float, Range(0.0, 1.0)] = 0.5
    cond_max_std: Annotated[float, Range(0.0)] = 0.3  # conditional pairs: noise std log-uniform on [1e-4, this]
    checkpoint_every: Annotated[int, POSITIVE] = 250
    seed: int = 0
    # The DnCNN baseline, trained by the same command on the same gradients (blind: random noise levels).
    dncnn_depth: Annotated[int, POSITIVE] = 6
    dncnn_width: Annotated[int, POSITIVE] = 16
    dncnn_steps: Annotated[int, COUNT] = 300
    # The Gaussian prior fitted by the same command on the same gradients (`denoise/prior.py`): the top-K
    # eigen-directions of each layer's covariance; 0 fits none. Its closed-form ε-model gives the `prior*` rows.
    # More directions keep more of a gradient the surrogate rarely shows (Laplace ε = 1, DLG's PSNR from the DDIM
    # row at K = 128 / 256 / 512 / 768: 13.9 / 14.6 / 15.1 / 15.3 dB, the protected gradient's 15.5 ± 0.7);
    # 512 float16 directions fit the 28×28 and the 32×32×3 LeNet's checkpoints under 25 MB.
    prior_rank: Annotated[int, COUNT] = 512
    refiner: RefinerConfig = RefinerConfig()
