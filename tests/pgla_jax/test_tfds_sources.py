"""tensorflow-datasets without TensorFlow: the offline builders prepare and read back exactly the offline data, the
CLIs read them by name, and an unprepared dataset is a one-line error naming it, its folder and the fix."""

import subprocess
import sys

import numpy as np
import pytest

from pgla_jax import attack, data, prepare_data, tfds_sources
from pgla_jax.config import DataConfig


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tfds")
    assert prepare_data.main(["pgla_mnist5k", "pgla_patches", "--data-dir", str(root)]) == 0
    return str(root)


def test_offline_builders_read_back_the_offline_data(tfds_dir):
    mnist = data.load(DataConfig(name="tfds:pgla_mnist5k", path=tfds_dir))
    ref = data.load_mnist5k()
    np.testing.assert_array_equal(mnist.images, ref.images)  # MNIST is 8-bit: the uint8 records are exact
    np.testing.assert_array_equal(mnist.labels, ref.labels)
    assert mnist.num_classes == 10 and mnist.images.dtype == np.float32
    patches = tfds_sources.load("pgla_patches", "test", tfds_dir)
    ref = data.skimage_patches(n=256, seed=1)
    assert patches.images.shape == (256, 32, 32, 3) and patches.num_classes == ref.num_classes
    np.testing.assert_array_equal(patches.labels, ref.labels)  # written unshuffled: the source's order
    assert np.abs(patches.images - ref.images).max() <= 0.5 / 255 + 1e-6  # 8-bit rounding of box-filtered photos
    assert not np.array_equal(tfds_sources.load("pgla_patches", "train", tfds_dir).images[:4], patches.images[:4])
    # Read through tfds' data source, yet TensorFlow itself never came in (a fresh process: nothing else loaded it).
    code = ("import sys; from pgla_jax import tfds_sources as t; t.load('pgla_patches', 'test', sys.argv[1]); "
            "print('tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, tfds_dir], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unprepared_or_unknown_datasets_are_one_line_errors(tmp_path, tfds_dir):
    with pytest.raises(data.DataError, match=r"tfds dataset cifar100 is not prepared in .*prepare_data cifar100"):
        tfds_sources.load("cifar100", "test", str(tmp_path))  # never downloads: the catalogue builder is not run
    with pytest.raises(data.DataError, match="no split 'validation'"):
        tfds_sources.load("pgla_patches", "validation", tfds_dir)
    with pytest.raises(data.DataError, match="unknown tfds dataset 'no_such_set'"):
        tfds_sources.load("no_such_set", "train", tfds_dir)


@pytest.mark.parametrize("argv,needle", [
    (["--data", "tfds:cifar100", "--config", "patches_lenet", "--denoiser", "none"], "tfds dataset cifar100 is not "
     "prepared in"),
    (["--data", "imagenet"], "unknown data set 'imagenet'"),
])
def test_attack_cli_data_errors(tmp_path, capsys, argv, needle):
    assert attack.main([*argv, "--data-path", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_prepare_data_cli_unknown_name_is_exit_2(tmp_path, capsys):
    assert prepare_data.main(["no_such_set", "--data-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: unknown tfds dataset 'no_such_set'")


@pytest.mark.integration
def test_attack_cli_reads_a_tfds_dataset(tfds_dir, tmp_path, capsys):
    # The colour victim on the tfds copy of the patches, a few iterations: the same code path a TPU VM takes with
    # --data tfds:cifar100.
    argv = ["--config", "patches_lenet", "--data", "tfds:pgla_patches", "--data-path", tfds_dir, "--denoiser",
            "none", "--denoisers", "none", "--images", "1", "--epsilons", "100", "--iterations", "5",
            "--out", str(tmp_path / "o"), "--json"]
    assert attack.main(argv) == 0
    assert '"results"' in capsys.readouterr().out


def _catalogue_offline(name, data_dir, images, labels):
    """Prepares the tensorflow-datasets catalogue's own `name` (its builder: name, version, features, PNG-encoded
    images) in `data_dir` from offline images instead of its download: what `prepare_data NAME` leaves on a machine
    with network, made here without network or TensorFlow (the PNGs encoded by PIL)."""
    import io

    import tensorflow_datasets as tfds
    from PIL import Image

    base = tfds.builder_cls(name)

    def png(x):
        buf = io.BytesIO()
        Image.fromarray(x).save(buf, "PNG")
        return buf.getvalue()

    def split_generators(self, dl_manager):
        del dl_manager  # nothing downloaded
        return {"test": self._generate_examples(None)}

    def generate_examples(self, _):
        for i, (x, y) in enumerate(zip(images, labels, strict=True)):
            row = {"image": png(x), "label": int(y)}
            if name == "cifar100":
                row.update(id=f"test_{i:05d}", coarse_label=int(y) // 5)
            yield i, row

    cls = type(base.__name__, (base,), {"name": name, "_split_generators": split_generators,
                                         "_generate_examples": generate_examples, "__module__": __name__},
               skip_registration=True)
    cls(data_dir=data_dir, file_format="array_record").download_and_prepare()


@pytest.mark.parametrize("name,side,classes", [("cifar100", 32, 100), ("stl10", 96, 10)])
def test_catalogue_loaders_read_what_prepare_data_leaves(tmp_path, name, side, classes):
    """CIFAR-100 and STL-10 through the same path as on a machine that prepared them (`tfds.builder(name)` reading
    the catalogue's records: PNG images decoded by PIL, its class count), from 6 offline colour patches resized to
    the data set's size (the attack CLI reads a tfds dataset by name: `test_attack_cli_reads_a_tfds_dataset`)."""
    from PIL import Image

    from pgla_jax import patches

    src = patches.skimage_patches(n=6, seed=3)
    images = np.stack([np.asarray(Image.fromarray(np.round(x * 255).astype(np.uint8)).resize((side, side)))
                       for x in src.images])
    labels = np.asarray(src.labels) % classes
    _catalogue_offline(name, str(tmp_path), images, labels)
    ds = tfds_sources.load(name, "test", str(tmp_path))
    assert ds.images.shape == (6, side, side, 3) and ds.num_classes == classes
    # Shuffled on write, as the catalogue's builders are; PNG is lossless: each record is one of the images, whole.
    order = [next(j for j in range(6) if np.array_equal(x, images[j].astype(np.float32) / 255.0)) for x in ds.images]
    assert sorted(order) == list(range(6))
    np.testing.assert_array_equal(ds.labels, labels[order])
