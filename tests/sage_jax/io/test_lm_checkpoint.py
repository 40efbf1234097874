"""Our LM checkpoint (save -> load, onto meshes), `load_lm` input detection, and the convert CLI."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import sharding
from sage_jax import convert
from sage_jax.io import hf, lm_checkpoint, load_lm, loader, save_lm
from sage_jax.models.config import LMConfig
from sage_jax.models.decoder import Decoder

CFG = LMConfig.tiny()
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 128, size=(2, 12)), jnp.int32)


def _params(cfg=CFG):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(Decoder(cfg, rngs=nnx.Rngs(3)), nnx.Param)))


def _pure(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_lm(path, CFG, _params(), provenance={"source": "test", "sha256": "0" * 64})
    return path


def test_checkpoint_round_trip_is_exact(ckpt):
    cfg, model, tok = load_lm(ckpt)
    assert cfg == CFG and tok is None
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), _pure(model), _params())
    meta = lm_checkpoint.checkpoint.read_metadata(ckpt)
    assert meta["kind"] == "lm" and meta["provenance"]["source"] == "test"


@pytest.mark.parametrize("n_devices,model_axis", [(2, 2), (8, 2)])
def test_checkpoint_restores_onto_a_mesh(ckpt, devices, n_devices, model_axis):
    mesh = sharding.make_mesh(model=model_axis, devices=devices[:n_devices])
    _, model, _ = load_lm(ckpt, mesh=mesh)
    wq = model.blocks.wq[...]
    assert wq.sharding.mesh.shape == mesh.shape
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, None, "model", None)  # heads on `model`
    assert len(wq.addressable_shards) == n_devices
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), _pure(model), _params())
    with sharding.use(mesh):
        sharded = nnx.jit(lambda m, x: m(x)[0])(model, TOKENS)
    plain = lm_checkpoint.build(CFG, _params())(TOKENS)[0]
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(plain), rtol=1e-5, atol=1e-5)


def _same_arrays(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) and x.dtype == y.dtype
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_serving_form_built_while_restoring_equals_the_fused_decoder(ckpt, dtype):
    """`load_serving` (layer by layer from the file) gives the arrays `load_lm(...).serving()` gives."""
    cfg, lm, tok = lm_checkpoint.load_serving(ckpt, dtype=dtype)
    ref = load_lm(ckpt, dtype=dtype)[1].serving()
    assert cfg == ref.cfg and lm.groups == ref.groups == (1, 1) and tok is None
    assert _same_arrays(lm, ref)


@pytest.mark.parametrize("n_devices,model_axis", [(2, 2), (4, 4)])
def test_serving_form_built_while_restoring_onto_a_mesh(ckpt, devices, n_devices, model_axis):
    """On a mesh: the same arrays, cut the same way (the fused groups included) as the fused sharded decoder's."""
    mesh = sharding.make_mesh(model=model_axis, devices=devices[:n_devices])
    _, lm, _ = lm_checkpoint.load_serving(ckpt, mesh=mesh)
    with sharding.use(mesh, "inference"):
        ref = load_lm(ckpt, mesh=mesh)[1].serving()
    assert lm.groups == ref.groups and _same_arrays(lm, ref)
    assert all(x.sharding.is_equivalent_to(y.sharding, x.ndim)
               for x, y in zip(jax.tree.leaves(lm), jax.tree.leaves(ref), strict=True))


_RSS_SCRIPT = """
import json, sys
import jax, numpy as np
from sage_jax.io import lm_checkpoint
jax.block_until_ready(jax.jit(lambda x: x + 1)(np.ones(3)))

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

with open("/proc/self/clear_refs", "w") as f:  # the peak RSS (VmHWM) restarts from here: only loading counts
    f.write("5")
base = status("VmRSS")
if sys.argv[2] == "serving":
    lm = lm_checkpoint.load_serving(sys.argv[1])[1]
else:
    lm = lm_checkpoint.load_lm(sys.argv[1])[1].serving()
jax.block_until_ready(lm)
print(json.dumps({"base": base, "peak": status("VmHWM"), "served": sum(x.nbytes for x in jax.tree.leaves(lm))}))
"""


def _random_checkpoint(path, cfg) -> None:
    """A checkpoint of `cfg` with random weights, written layer by layer (as the converters write one)."""
    _, state = lm_checkpoint.abstract_model(cfg)
    rng = np.random.default_rng(0)
    dt = np.dtype(jnp.dtype(cfg.param_dtype))
    with lm_checkpoint.checkpoint.Writer(path) as w:
        for key, a in sorted(hf.flatten(nnx.to_pure_dict(state)).items()):
            if key.startswith("blocks/"):
                out = w.create(key, a.shape, dt, stacked=True)
                for i in range(a.shape[0]):
                    out[i] = (rng.standard_normal(a.shape[1:], np.float32) * 0.02).astype(dt)
            else:
                w.put(key, (rng.standard_normal(a.shape, np.float32) * 0.02).astype(dt))
        w.commit(config=cfg, kind=lm_checkpoint.KIND)


@pytest.mark.integration
def test_loading_a_1b_model_holds_one_copy_of_its_weights(tmp_path):
    """A 1.1B-parameter model in bf16 (TinyLlama-1.1B's shape, 2.2 GB) with random weights: building its serving
    form while restoring raises the process's peak RSS by at most 1.15x the served weights (measured: 1.10); the
    earlier way, restoring the `Decoder` and then fusing it, by several times them (measured in separate processes,
    from the RSS after importing jax)."""
    cfg = LMConfig(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, head_dim=64,
                   mlp_dim=5632, tie_embeddings=False, param_dtype="bfloat16", dtype="bfloat16")
    path = tmp_path / "1b"
    _random_checkpoint(path, cfg)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = {}
    for how in ("serving", "decoder"):
        proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(path), how], capture_output=True, text=True,
                              env=env, timeout=900)
        assert proc.returncode == 0, proc.stderr[-2000:]
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        out[how] = (r["peak"] - r["base"]) / r["served"]
        assert r["served"] > 2e9
    print(f"peak RSS growth / served weights: serving form while restoring {out['serving']:.2f}, "
          f"Decoder then fused {out['decoder']:.2f}")
    assert out["serving"] <= 1.15 < out["decoder"]


def test_bfloat16_and_mismatched_params(ckpt):
    cfg, model, _ = load_lm(ckpt, dtype="bfloat16")
    assert cfg.param_dtype == cfg.dtype == "bfloat16" and model.embed[...].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_lm(ckpt, dtype="float16")
    with pytest.raises(ValueError, match="does not fit the config"):
        lm_checkpoint.build(CFG.replace(mlp_dim=32), _params())


def test_load_lm_rejects_missing_and_unknown_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        load_lm(tmp_path / "nope")
    (tmp_path / "x.bin").write_bytes(b"not a model")
    for bad in (tmp_path, tmp_path / "x.bin"):
        with pytest.raises(ValueError, match="is not a GGUF file, an HF directory"):
            load_lm(bad)


def test_hf_dir_loads_without_torch(tmp_path):
    """The runtime path (HF dir with a tokenizer -> load_lm -> forward) never imports torch."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(vocab={chr(97 + i): i for i in range(26)}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.write_hf(tmp_path, CFG, _params(), tokenizer=PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="a"))
    code = ("import sys; from sage_jax.io import load_lm; cfg, m, tok = load_lm(sys.argv[1]); "
            "import jax.numpy as jnp; m(jnp.asarray([tok.encode('abc')])); "
            "assert 'torch' not in sys.modules, 'torch was imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_convert_cli(tmp_path, capsys):
    src = tmp_path / "hf"
    hf.write_hf(src, CFG, _params())
    out = tmp_path / "ckpt"
    assert convert.main([str(src), str(out), "--dtype", "bfloat16"]) == 0
    cfg, model, _ = load_lm(out)
    assert cfg.param_dtype == "bfloat16" and model.blocks.wq[...].dtype == jnp.bfloat16
    assert loader.detect(out) == "checkpoint"
    capsys.readouterr()
    for argv in ([str(tmp_path / "missing"), str(tmp_path / "o1")],  # missing SRC
                 [str(src), str(out)],  # OUT exists, no --force
                 [str(tmp_path / "hf" / "config.json"), str(tmp_path / "o2")]):  # not a model
        assert convert.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert convert.main([str(src), str(out), "--force"]) == 0
    assert load_lm(out)[0].param_dtype == "float32"


@pytest.mark.integration
def test_convert_cli_process_exit_code(tmp_path):
    r = subprocess.run([sys.executable, "-m", "sage_jax.convert", str(tmp_path / "missing.gguf"), str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


def test_convert_force_replaces_out_whole_and_a_failure_leaves_it(ckpt, tmp_path, capsys):
    """--force never merges: a stale checkpoint inside OUT would shadow the new one. The new checkpoint is written
    beside OUT and renamed into place; a run that fails (or is interrupted) leaves OUT as it was, and nothing
    partial beside it."""
    out = tmp_path / "out"
    (out / "params").mkdir(parents=True)
    (out / "params" / "stale").write_text("an older export")
    (out / "metadata.json").write_text("{}")
    assert convert.main([str(ckpt), str(out), "--to", "hf"]) == 2  # never without --force
    assert "--force" in capsys.readouterr().err
    assert convert.main([str(tmp_path / "missing.gguf"), str(out), "--force"]) == 2
    capsys.readouterr()
    assert (out / "params" / "stale").read_text() == "an older export" and (out / "metadata.json").read_text() == "{}"
    assert convert.main([str(ckpt), str(out), "--force", "--to", "hf"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert not (out / "params").exists() and not (out / "metadata.json").exists()
    cfg, model, _ = load_lm(out)  # the HF export alone
    assert cfg.n_layers == CFG.n_layers
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no partial folder left beside it
