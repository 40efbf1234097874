"""Frozen configs for the PGLA attack side: data, victim, protection, attack, and the experiment that joins them.

Every field that changes a compiled shape (image size, batch, iteration counts, restarts) lives here, so a config
is hashable and can be a static argument of `jax.jit`. Values that vary per call (ε, keys) are arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

DatasetName = Literal["mnist5k", "fashion_mnist", "digits", "skimage_patches", "cifar10", "cifar100"]
VictimKind = Literal["lenet", "mlp", "convnet", "resnet"]
NoiseKind = Literal["gaussian", "laplace"]
Calibration = Literal["paper", "dpsgd"]
AttackKind = Literal["dlg", "idlg", "ig"]


@dataclasses.dataclass(frozen=True)
class DataConfig:
    name: DatasetName = "mnist5k"
    split: Literal["train", "test"] = "train"  # Fashion-MNIST / CIFAR files only; the others have one split
    path: str | None = None  # CIFAR: folder holding the python-pickle batches (never downloaded)
    seed: int = 0  # which images are picked as the clients' private data


@dataclasses.dataclass(frozen=True)
class VictimConfig:
    kind: VictimKind = "lenet"
    image_shape: tuple[int, int, int] = (28, 28, 1)  # H, W, C
    num_classes: int = 10
    seed: int = 0  # DLG uses one fixed random init; the attack knows the weights (honest-but-curious server)
    width: int = 12  # channels (conv nets) or hidden units / 8 (MLP); 12 is the DLG LeNet


@dataclasses.dataclass(frozen=True)
class ProtectionConfig:
    """Gradient perturbation applied by the client before sending.

    `paper`: the released Mjölnir code's calibration, M = (2·lr·C/m)·scale(ε, δ), noise added to the raw
    gradient with **no clipping** (its bug (c), kept on purpose for fidelity). `dpsgd`: per-example clipping to C
    and σ = z·C with z from (ε, δ) by a privacy accountant, noise on the summed clipped gradient, then averaged.
    """

    noise: NoiseKind = "gaussian"
    calibration: Calibration = "paper"
    delta: float = 1e-4  # the released code's `10e-5`
    clip: float = 10.0  # C
    lr: float = 1e-3  # victim learning rate (enters the paper's sensitivity only)
    dataset_size: int = 1  # m in the paper's sensitivity 2·lr·C/m
    steps: int = 1  # DP-SGD: releases composed by the accountant
    sampling_rate: float = 1.0  # DP-SGD: Poisson sampling probability per release
    topk: float | None = None  # keep this fraction of largest-|g| entries (None: no pruning)
    quant_bits: int | None = None  # uniform per-tensor quantisation (None: off)


@dataclasses.dataclass(frozen=True)
class AttackConfig:
    kind: AttackKind = "dlg"
    iterations: int | None = None  # L-BFGS iterations (DLG/iDLG: 300) or signed-Adam steps (IG: 2000)
    restarts: int = 1  # vmapped random initialisations; the best final matching loss wins
    lr: float | None = None  # DLG/iDLG: None = zoom line search, a float = fixed step; IG: Adam step (0.1)
    memory: int = 10  # L-BFGS history
    tv: float = 1e-4  # IG total-variation weight
    seed: int = 0

    def resolved(self) -> AttackConfig:
        """The same config with the attack's own defaults filled in for every None."""
        iterations = self.iterations if self.iterations is not None else (2000 if self.kind == "ig" else 300)
        lr = self.lr if (self.lr is not None or self.kind != "ig") else 0.1
        return dataclasses.replace(self, iterations=iterations, lr=lr)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    data: DataConfig = DataConfig()
    victim: VictimConfig = VictimConfig()
    protection: ProtectionConfig = ProtectionConfig()
    attack: AttackConfig = AttackConfig()
    batch_size: int = 1  # images per client gradient
    num_images: int = 4  # images attacked by the CLI (in batches of `batch_size`)
    epsilons: tuple[float, ...] = (1.0, 10.0, 50.0, 100.0)

    def replace(self, **kw) -> ExperimentConfig:
        return dataclasses.replace(self, **kw)
