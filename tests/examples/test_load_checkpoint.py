"""`examples/load_checkpoint.py`: every checkpoint kind we write, loaded with plain jax + orbax and run by plain JAX
code, gives what the project's own loaders and forwards give.

Tolerance: float32 outputs agree to RTOL = 1e-4 relative to the reference's largest magnitude (max |ours - ref| /
max |ref|); the two sides order their float32 sums differently (the library runs feature-major fused matmuls).
"""

import ast
import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import sharding
from sage_jax.io import lm_checkpoint, loader
from sage_jax.models import eagle_head, layers
from sage_jax.models.config import LMConfig, RopeConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "load_checkpoint.py")
EAGLE = os.path.join(ROOT, "sage_jax", "assets", "smollm2_eagle")
VLM = os.path.join(ROOT, "sage_jax", "assets", "smollm2_vlm")
DENOISER = os.path.join(ROOT, "pgla_jax", "assets", "lenet28", "denoiser")
DNCNN = os.path.join(ROOT, "pgla_jax", "assets", "lenet28", "dncnn")
RTOL = 1e-4
TOKENS = np.random.default_rng(0).integers(0, 49152, (1, 8)).astype(np.int32)


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def causal(t: int):
    return layers.causal_mask(t, jnp.zeros((1,), jnp.int32))


def random_like(abstract, seed: int) -> dict:
    """Random float32 arrays shaped like a tree of abstract ones (numpy: no per-op compiles of an eager init)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: rng.normal(0.0, 0.3, a.shape).astype(np.float32), abstract)


@pytest.fixture(scope="session")
def ex():
    """The example script as a module (it is not a package: imported from its file)."""
    spec = importlib.util.spec_from_file_location("load_checkpoint_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _rank_promotion():
    # The example broadcasts as users write JAX (a [D] scale times [B, T, D]); the suite's conftest makes that an
    # error for the library's own code.
    with jax.numpy_rank_promotion("allow"):
        yield


@pytest.fixture(scope="session")
def smollm2_ckpt(tmp_path_factory):
    """The shipped SmolLM2-135M-Instruct GGUF converted by `sage_jax.convert`, once (its checksum memo in a private
    cache dir, never the user's)."""
    from sage_jax import convert

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SAGE_JAX_CACHE", str(tmp_path_factory.mktemp("sage_jax_cache")))
        out = str(tmp_path_factory.mktemp("ckpt") / "smollm2")
        assert convert.main([loader.default_target(), out]) == 0
    return out


@pytest.fixture(scope="session")
def smollm2(smollm2_ckpt):
    """The project's side: (config, Decoder) restored by `sage_jax.io.lm_checkpoint`."""
    cfg, model, _ = lm_checkpoint.load_lm(smollm2_ckpt)
    return cfg, model


@pytest.fixture(scope="session")
def smollm2_plain(ex, smollm2_ckpt):
    """The example's side: (config dict, params dict)."""
    return ex.load_lm(smollm2_ckpt)


def test_imports_only_jax_numpy_orbax_and_the_standard_library():
    with open(SCRIPT) as f:
        tree = ast.parse(f.read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    third_party = {m for m in imported if m.split(".")[0] not in sys.stdlib_module_names | {"__future__"}}
    assert third_party == {"jax", "jax.numpy", "numpy", "orbax.checkpoint"}, third_party


def test_rope_frequencies_match_the_library(ex):
    for rope in (RopeConfig(theta=1e5), RopeConfig(type="linear", factor=2.0),
                 RopeConfig(theta=5e5, type="llama3", factor=8.0, original_max_position=8192),
                 RopeConfig(theta=1e6, type="yarn", factor=4.0, original_max_position=4096),
                 RopeConfig(theta=1e4, type="yarn", factor=4.0, original_max_position=256, attention_factor=1.3)):
        for head_dim in (8, 64, 128):
            want = layers.rope_inv_freq(rope, head_dim)
            got = ex.rope_frequencies(LMConfig.tiny(rope=rope).to_json()["rope"], head_dim)
            np.testing.assert_allclose(got[0], want[0], rtol=1e-6, err_msg=f"{rope.type} H={head_dim}")
            assert got[1] == pytest.approx(want[1])


def test_lm_logits_match(ex, smollm2, smollm2_plain):
    cfg, model = smollm2
    ref_logits, ref_hidden, _ = model(jnp.asarray(TOKENS))
    plain_cfg, params = smollm2_plain
    assert LMConfig.from_json(plain_cfg) == cfg
    hidden, _ = jax.jit(lambda p, x: ex.lm_hidden(p, plain_cfg, p["embed"][x]))(params, TOKENS)
    logits = jax.jit(lambda p, h: ex.lm_head(p, plain_cfg, h))(params, hidden)
    assert ex.n_params(params) == 134_515_008  # SmolLM2-135M, tied embeddings
    err_h, err = rel_err(hidden, ref_hidden), rel_err(logits, ref_logits)
    print(f"SmolLM2 logits [1, 8, 49152]: relative error {err:.1e} (last hidden {err_h:.1e})")
    assert err < RTOL and err_h < RTOL
    assert (np.argmax(logits, -1) == np.argmax(ref_logits, -1)).all()


def test_eagle_head_matches(ex, smollm2, smollm2_plain):
    """The shipped head (bfloat16, reduced vocabulary of 8192 ids) on the target's own features."""
    cfg, model = smollm2
    _, ref_hidden, _ = model(jnp.asarray(TOKENS))
    head_cfg, head, vocab_ids, _ = lm_checkpoint.load_head(EAGLE)
    weights = eagle_head.EagleWeights.build(head_cfg, head, vocab_ids, cfg, model.embed[...], None)
    prev = eagle_head.shift_features(ref_hidden)
    ref_logits, ref_feats, _ = jax.jit(lambda w, embed, norm, x, f: eagle_head.eagle_forward(
        w.head, head_cfg, embed, norm, None, x, f, jnp.arange(8)[None], causal(8), vocab=w.vocab))(
        weights, model.embed[...], model.final_norm[...], jnp.asarray(TOKENS), prev)

    _, target = smollm2_plain
    config, params = ex.load_eagle_head(EAGLE)
    assert params["vocab_ids"].shape == (8192,) and params["head"]["fc"].dtype == jnp.float32
    logits, feats = jax.jit(lambda p, t, x, f: ex.eagle_forward(p, config, t, x, f))(params, target, TOKENS, prev)
    err = rel_err(logits, ref_logits)
    print(f"EAGLE head draft logits [1, 8, 8192]: relative error {err:.1e} (features {rel_err(feats, ref_feats):.1e})")
    assert err < RTOL and rel_err(feats, ref_feats) < RTOL


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, devices):
    """A tiny Qwen2-style LM (q/k/v biases, untied head, YaRN RoPE) saved while sharded over 8 devices:
    (path, config, the same model on one device)."""
    cfg = LMConfig.tiny(rope=RopeConfig(theta=1e4, type="yarn", factor=4.0, original_max_position=64))
    params = random_like(nnx.to_pure_dict(lm_checkpoint.abstract_model(cfg)[1]), 1)
    path = tmp_path_factory.mktemp("tiny") / "qwen2"
    lm_checkpoint.save_lm(path, cfg, params)
    _, sharded, _ = lm_checkpoint.load_lm(path, mesh=sharding.make_mesh(model=2, devices=devices))
    assert len(sharded.blocks.wq[...].addressable_shards) == 8
    lm_checkpoint.save_lm(path, cfg, sharded.params(), overwrite=True)  # written from 8 devices
    return str(path), cfg, lm_checkpoint.build(cfg, params)


def test_sharded_qwen2_style_lm_matches(ex, tiny_qwen2):
    path, cfg, model = tiny_qwen2
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12))
    ref, _, _ = model(jnp.asarray(tokens))
    plain_cfg, params = ex.load_lm(path)
    assert params["blocks"]["bq"].sharding.device_set == {jax.devices()[0]}  # restored onto one device
    err = rel_err(ex.lm_logits(params, plain_cfg, tokens), ref)
    print(f"tiny Qwen2 (YaRN, biases, untied, saved sharded) logits: relative error {err:.1e}")
    assert err < RTOL


def test_eagle3_style_head_matches(ex, tiny_qwen2, tmp_path):
    """A head that fuses two tapped target layers and has its own LM head over 16 ids (and q/k/v biases)."""
    _, cfg, model = tiny_qwen2
    head_cfg, taps = eagle_head.head_config(cfg), (1, 0)
    abstract = nnx.eval_shape(lambda: eagle_head.EagleHead(head_cfg, n_taps=2, head_vocab=16, rngs=nnx.Rngs(0)))
    params = random_like(abstract.params(), 2)
    ids = np.sort(np.random.default_rng(2).choice(cfg.vocab_size, 16, replace=False)).astype(np.int32)
    lm_checkpoint.save_head(str(tmp_path / "head"), head_cfg, params, target_cfg=cfg, vocab_ids=ids, taps=taps)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 6)))
    pos, mask = jnp.broadcast_to(jnp.arange(6), (2, 6)), layers.causal_mask(6, jnp.zeros((2,), jnp.int32))

    target = model.params()
    w = eagle_head.EagleWeights.build(head_cfg, params, ids, cfg, target["embed"], target["lm_head"], taps)

    @jax.jit
    def reference(w, lm, tokens):
        _, _, tapped = lm.forward(tokens, pos, mask, taps=taps)
        prev = eagle_head.shift_features(eagle_head.fuse_features(w.head, tapped))
        return eagle_head.eagle_forward(w.head, head_cfg, lm.embed, lm.final_norm, lm.lm_head, tokens, prev, pos,
                                        mask, vocab=w.vocab)[0]

    config, plain = ex.load_eagle_head(str(tmp_path / "head"))

    @jax.jit
    def ours(params, target, tokens):
        hidden, inputs = ex.lm_hidden(target, cfg.to_json(), target["embed"][tokens])
        feats = ex.eagle_target_features(params, config, hidden, inputs)
        return ex.eagle_forward(params, config, target, tokens, ex.shift_right(feats))[0]

    logits = ours(plain, target, tokens)
    err = rel_err(logits, reference(w, model.serving(), tokens))
    print(f"tiny EAGLE-3-style head draft logits [2, 6, 16]: relative error {err:.1e}")
    assert err < RTOL


def test_vlm_matches(ex, smollm2_ckpt, smollm2_plain):
    """The shipped LLaVA-OneVision (its LM "default": the converted SmolLM2): preprocessing against transformers'
    image processor, visual embeddings and the spliced LM forward against the project's model."""
    from PIL import Image

    from sage_jax.io.vision_lm import _image_processor

    image = np.random.default_rng(4).integers(0, 256, (28, 28, 3), dtype=np.uint8)
    tiles = ex.preprocess_image(VLM, image)
    processed = _image_processor(os.path.join(VLM, "processor"))(images=[Image.fromarray(image)], return_tensors="np")
    np.testing.assert_allclose(tiles, processed["pixel_values"][0], atol=1e-5)

    with pytest.MonkeyPatch.context() as mp:  # the "default" LM: the checkpoint converted above
        mp.setattr(loader, "default_target", lambda: smollm2_ckpt)
        _, cfg, module = loader.load_vlm_checkpoint(VLM)
    n_feat = 16 + 4 * 5  # the whole-image tile's 4x4 patches, then the grid tile's 4 rows of 4 + newline
    ids = np.concatenate([[1, 504, 28], np.full(n_feat, cfg.image_token_id), [30, 2]])[None]
    inputs = dict(input_ids=ids, pixel_values=tiles[None], image_sizes=np.array([[28, 28]]))
    ref_embeddings, _ = module.embed(**inputs)
    ref_logits = module(**inputs)

    config, params = ex.load_vlm(VLM)
    assert config["language_model"] == "default" and "lm" not in params
    visual = jax.jit(lambda p, x: ex.visual_embeddings(p, config, x))(params, tiles)
    lm_cfg, lm = smollm2_plain
    logits = jax.jit(lambda p, t, v: ex.vlm_logits(p, lm_cfg, t, cfg.image_token_id, v))(lm, ids, visual)
    err_v, err = rel_err(visual, ref_embeddings[0, 3:3 + n_feat]), rel_err(logits, ref_logits)
    print(f"VLM visual embeddings [36, 576]: relative error {err_v:.1e}; spliced logits [1, 41, 49152]: {err:.1e}")
    assert err_v < RTOL and err < RTOL


def test_denoiser_unet_matches(ex):
    """The shipped conditional U-Net on an encoded noisy LeNet gradient, at a fractional timestep."""
    from pgla_jax.denoise import denoiser_checkpoint as dstore
    from pgla_jax.denoise.unet import UNet

    tree, cfg, _ = dstore.load(DENOISER)
    codec = dstore.make_codec(cfg)
    rng = np.random.default_rng(5)
    g = jnp.asarray(rng.normal(0, 0.05, codec.size), jnp.float32)
    unet = nnx.eval_shape(lambda: UNet(cfg.unet, rngs=nnx.Rngs(0)))  # no random init to throw away (25 s eager)
    dstore.load_pure(unet, tree)
    x = codec.encode(codec.unflatten(g))[None]  # [1, 116, 116, 1]
    cond = jnp.asarray(rng.normal(0, 0.5, x.shape), jnp.float32)
    t = jnp.asarray([37.5])
    ref = nnx.jit(lambda m, x, t, c: m(x, t, c))(unet, x, t, cond)

    config, params = ex.load_denoiser(DENOISER)
    encoded = ex.encode_gradient(config, g)
    np.testing.assert_array_equal(encoded, x[0])
    eps = jax.jit(lambda p, x, t, c: ex.unet_forward(p, config, x, t, c))(params, encoded[None], t, cond)
    err = rel_err(eps, ref)
    print(f"U-Net predicted noise [1, 116, 116, 1]: relative error {err:.1e}")
    assert err < RTOL


def test_dncnn_matches(ex):
    from pgla_jax.denoise import denoiser_checkpoint as dstore
    from pgla_jax.denoise import dncnn

    tree, cfg, _ = dstore.load(DNCNN, dncnn.KIND)
    model = nnx.eval_shape(lambda: dncnn.DnCNN(cfg.dncnn_depth, cfg.dncnn_width, rngs=nnx.Rngs(0)))
    dstore.load_pure(model, tree)
    y = jnp.asarray(np.random.default_rng(6).normal(0, 0.05, (2, 116, 116, 1)), jnp.float32)
    ref = nnx.jit(lambda m, y: m(y))(model, y)
    config, params = ex.load_dncnn(DNCNN)
    err = rel_err(jax.jit(lambda p, y: ex.dncnn_forward(p, config, y))(params, y), ref)
    print(f"DnCNN output [2, 116, 116, 1]: relative error {err:.1e}")
    assert err < RTOL


@pytest.mark.parametrize("asset", ["lenet28", "patches32"])
def test_gaussian_prior_matches(ex, asset):
    """The shipped Gaussian priors' closed-form noise prediction, at two noise levels."""
    from pgla_jax.denoise import prior

    path = os.path.join(ROOT, "pgla_jax", "assets", asset, "prior")
    lib = prior.load(path)
    config, params = ex.load_prior(path)
    rng = np.random.default_rng(7)
    g = jnp.asarray(np.asarray(lib.mean) + rng.normal(0, 0.05, lib.size), jnp.float32)
    x = jnp.stack([ex.encode_gradient(config, g)] * 2)
    abar = jnp.asarray([0.99, 0.6])
    err = rel_err(jax.jit(ex.prior_eps)(params, x, abar), prior.eps(lib, x, abar))
    print(f"{asset} prior predicted noise {list(x.shape)}: relative error {err:.1e}")
    assert err < RTOL


@pytest.fixture(scope="session")
def script_env():
    """As a user runs it: one host device, none of the suite's JAX settings."""
    return {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}


def test_script_runs_as_a_user_runs_it(script_env):
    """The command line on the small kinds."""
    out = subprocess.run([sys.executable, SCRIPT, DNCNN, VLM], capture_output=True, text=True, timeout=300,
                         env=script_env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == f"pgla-dncnn {DNCNN}: 9,649 parameters"
    assert lines[1].startswith("  denoised [1, 116, 116, 1]: sum ")
    assert lines[2] == f"vlm {VLM}: 2,255,040 parameters"  # the shipped tower (1,810,944), projector and newline
    assert lines[3].startswith("  visual embeddings [36, 576]: sum ") and len(lines) == 4


def test_bad_path_is_one_line_and_exit_code_2(script_env, tmp_path):
    missing = str(tmp_path / "missing")
    out = subprocess.run([sys.executable, SCRIPT, DNCNN, missing], capture_output=True, text=True, timeout=120,
                         env=script_env)
    assert out.returncode == 2 and out.stdout == "", (out.returncode, out.stdout)  # checked before any work
    assert out.stderr == f"error: {missing} is not a checkpoint (expected metadata.json and params/)\n", out.stderr


def test_refusals_in_process(ex, tmp_path, capsys):
    """A directory that is not a checkpoint, and a draft head without its target LM: one line, exit code 2."""
    assert ex.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path} is not a checkpoint (expected metadata.json and params/)\n"
    assert ex.main([EAGLE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give its target LM checkpoint too (--target LM_CKPT)" in err
