import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import checkpoint, sharding


@dataclasses.dataclass(frozen=True)
class Cfg:
    width: int = 8
    layers: int = 2
    name: str = "tiny"
    sizes: tuple[int, ...] = (1, 2)


def _params(mesh):
    rng = np.random.default_rng(0)
    w = jax.device_put(rng.normal(size=(8, 16)).astype(np.float32), NamedSharding(mesh, P("data", "model")))
    b = jax.device_put(rng.normal(size=(16,)).astype(np.float32), NamedSharding(mesh, P("model")))
    e = jax.device_put(jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4), NamedSharding(mesh, P()))
    return {"layer": {"kernel": w, "bias": b}, "embed": e}


def test_save_restore_plain_orbax_subprocess(tmp_path, devices):
    mesh = sharding.make_mesh(data=4, model=2)
    params = _params(mesh)
    path = checkpoint.save(tmp_path / "ck", params, config=Cfg(), kind="test", provenance={"source": "unit"})
    meta = json.loads((tmp_path / "ck" / "metadata.json").read_text())
    assert meta["format_version"] == checkpoint.FORMAT_VERSION
    assert meta["config"] == {"width": 8, "layers": 2, "name": "tiny", "sizes": [1, 2]}
    assert meta["config_class"].endswith("Cfg")
    assert meta["params"]["layer/kernel"] == [[8, 16], "float32"]

    out = tmp_path / "restored.npz"
    script = textwrap.dedent(f"""
        import sys, numpy as np, jax, orbax.checkpoint as ocp
        ck, p = ocp.StandardCheckpointer(), {os.path.join(path, "params")!r}
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        md = ck.metadata(p).item_metadata.tree
        tree = ck.restore(p, jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), md))
        flat = {{"/".join(str(k.key) for k in p): np.asarray(v.astype(np.float32))
                for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}}
        np.savez({str(out)!r}, **flat)
        bad = [m for m in sys.modules if m.split(".")[0] in ("flax", "configs", "sage_jax", "pgla_jax")]
        assert not bad, bad
    """)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path)
    got = np.load(out)
    np.testing.assert_array_equal(got["layer/kernel"], np.asarray(params["layer"]["kernel"]))
    np.testing.assert_array_equal(got["layer/bias"], np.asarray(params["layer"]["bias"]))
    np.testing.assert_array_equal(got["embed"], np.asarray(params["embed"].astype(jnp.float32)))


def test_restore_onto_mesh_and_mismatch(tmp_path, devices):
    mesh = sharding.make_mesh(data=4, model=2)
    params = _params(mesh)
    path = checkpoint.save(tmp_path / "ck", params, config=Cfg())
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), params)
    back = checkpoint.restore(path, target)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding

    wrong = dict(target, layer={"kernel": jax.ShapeDtypeStruct((8, 32), jnp.float32), "bias": target["layer"]["bias"]})
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.restore(path, wrong)
    msg = str(e.value)
    assert "\n" not in msg and "'layer/kernel'" in msg and "(8, 16)" in msg and "(8, 32)" in msg

    missing = {"layer": target["layer"]}
    with pytest.raises(checkpoint.CheckpointError, match="unexpected key 'embed'"):
        checkpoint.restore(path, missing)


def test_no_silent_overwrite(tmp_path):
    params = {"w": np.ones((2, 2), np.float32)}
    checkpoint.save(tmp_path / "ck", params)
    with pytest.raises(checkpoint.CheckpointError, match="already holds a checkpoint"):
        checkpoint.save(tmp_path / "ck", {"w": np.zeros((2, 2), np.float32)})
    checkpoint.save(tmp_path / "ck", {"w": np.zeros((2, 2), np.float32)}, overwrite=True)
    np.testing.assert_array_equal(np.asarray(checkpoint.restore(tmp_path / "ck")["w"]), 0)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="is not a checkpoint"):
        checkpoint.read_metadata(tmp_path)


def test_writer_writes_the_same_checkpoint(tmp_path, devices):
    """`Writer` (array by array, slice by slice) writes a checkpoint that restores like `save`'s (onto the mesh,
    through plain Orbax), with the same metadata, and leaves nothing behind when it fails halfway."""
    mesh = sharding.make_mesh(data=4, model=2)
    params = _params(mesh)
    a = checkpoint.save(tmp_path / "a", params, config=Cfg(), kind="test")
    with checkpoint.Writer(tmp_path / "b") as w:
        w.put("embed", params["embed"])
        kernel = np.asarray(params["layer"]["kernel"])
        dst = w.create("layer/kernel", kernel.shape, kernel.dtype, stacked=True)
        for i in range(kernel.shape[0]):  # row by row, as a converter writes the layers of a stacked parameter
            dst[i] = kernel[i]
        w.put("layer/bias", params["layer"]["bias"])
        b = w.commit(config=Cfg(), kind="test")
    meta_a, meta_b = checkpoint.read_metadata(a), checkpoint.read_metadata(b)
    assert {k: meta_a[k] for k in ("params", "config", "kind")} == {k: meta_b[k] for k in ("params", "config", "kind")}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    got = checkpoint.restore(b, abstract)
    assert got["layer"]["kernel"].sharding == params["layer"]["kernel"].sharding
    jax.tree.map(np.testing.assert_array_equal, got, params)
    with pytest.raises(checkpoint.CheckpointError, match="already holds"):
        checkpoint.Writer(b)
    with pytest.raises(RuntimeError, match="truncated"), checkpoint.Writer(tmp_path / "c") as w:
        w.put("embed", params["embed"])
        raise RuntimeError("tensor file truncated")
    with checkpoint.Writer(tmp_path / "d") as w:  # left without `commit`: nothing appears either
        w.put("embed", params["embed"])
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


def _largest_file(folder):
    files = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]
    return max(files, key=os.path.getsize)


def test_every_checkpoint_carries_its_sums_and_every_load_checks_them(tmp_path, monkeypatch):
    """Saved by `save` and by `Writer`: SHA256SUMS lists metadata.json and every file under params/; a flipped byte
    or a truncated file is a one-line `CheckpointError` from `restore` and from `Reader` (not garbage, not Orbax's
    traceback); a file added later beside the checkpoint is not a damage."""
    monkeypatch.setenv("SAGE_JAX_CACHE", str(tmp_path / "cache"))  # digests remembered per stamp: a fresh memo
    params = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64)}
    a = checkpoint.save(tmp_path / "a", params)
    with checkpoint.Writer(tmp_path / "b") as w:
        w.put("w", params["w"])
        b = w.commit()
    for path in (a, b):
        sums = checkpoint.read_sums(path)
        assert "metadata.json" in sums and any(r.startswith("params/") for r in sums)
        assert sorted(sums) == checkpoint.summed_files(path)
        (tmp_path / "extra").write_text("")
        os.replace(tmp_path / "extra", os.path.join(path, "datastore.npz"))  # added later: not its business
        np.testing.assert_array_equal(np.asarray(checkpoint.restore(path)["w"]), params["w"])
    victim = _largest_file(os.path.join(a, "params"))
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    for load in (checkpoint.restore, checkpoint.Reader):
        with pytest.raises(checkpoint.CheckpointError, match="does not match its sha256") as e:
            load(a)
        assert "\n" not in str(e.value)
    victim = _largest_file(os.path.join(b, "params"))
    os.truncate(victim, 10)
    with pytest.raises(checkpoint.CheckpointError, match="does not match its sha256"):
        checkpoint.restore(b)
    # Without sums (a checkpoint written before them) a truncated file is still one line, from Orbax's error.
    os.remove(os.path.join(b, checkpoint.SUMS_FILE))
    for load in (checkpoint.restore, lambda p: checkpoint.Reader(p).read("w")):
        with pytest.raises(checkpoint.CheckpointError, match="damaged or incomplete") as e:
            load(b)
        assert "\n" not in str(e.value) and os.fspath(b) in str(e.value)


def test_a_remembered_digest_never_hides_bytes_changed_in_place(tmp_path, monkeypatch):
    """A file's digest is remembered after a first read; bytes changed in place afterwards, at the same size and
    with the mtime set back, are read again (the stamp holds the ctime), so a checkpoint changed so fails its sums."""
    import time

    from configs import provenance

    monkeypatch.setenv("SAGE_JAX_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 64)
    first = checkpoint.verified_sha256(f)
    assert os.listdir(tmp_path / "cache" / "sha256")  # remembered
    st = os.stat(f)
    time.sleep(0.05)  # past the file system's timestamp tick
    with open(f, "r+b") as h:
        h.seek(10)
        h.write(b"b")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(f).st_size == st.st_size and os.stat(f).st_mtime_ns == st.st_mtime_ns
    assert checkpoint.verified_sha256(f) == provenance.file_sha256(str(f)) != first


def test_training_checkpoints_carry_their_sums_and_a_damaged_step_is_one_line(tmp_path):
    """`seal_step` / `restore_step`: a training run's checkpoints are checked like every other; a damaged step
    (sealed or from before the sums) is one line that names its folder and how to resume from the step before."""
    import orbax.checkpoint as ocp

    state = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64)}
    abstract = ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
    with ocp.CheckpointManager(tmp_path / "ckpt", options=ocp.CheckpointManagerOptions(max_to_keep=2)) as mngr:
        for step in (1, 2):
            mngr.save(step, args=ocp.args.StandardSave({"w": state["w"] + step}))
            checkpoint.seal_step(mngr, step)
        assert checkpoint.read_sums(checkpoint.step_folder(mngr, 2))
        np.testing.assert_array_equal(checkpoint.restore_step(mngr, 2, abstract)["w"], state["w"] + 2)
        os.truncate(_largest_file(checkpoint.step_folder(mngr, 2)), 10)
        with pytest.raises(checkpoint.CheckpointError, match="does not match its sha256") as e:
            checkpoint.restore_step(mngr, 2, abstract)
        assert "\n" not in str(e.value) and f"delete {checkpoint.step_folder(mngr, 2)} to resume" in str(e.value)
        os.remove(os.path.join(checkpoint.step_folder(mngr, 2), checkpoint.SUMS_FILE))
        with pytest.raises(checkpoint.CheckpointError, match="damaged or incomplete") as e:
            checkpoint.restore_step(mngr, 2, abstract)
        assert "\n" not in str(e.value)
        np.testing.assert_array_equal(checkpoint.restore_step(mngr, 1, abstract)["w"], state["w"] + 1)
