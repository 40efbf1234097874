"""HF directories through the one name table: tiny random Qwen2 / Llama models vs transformers, rope variants,
sharded safetensors, and the `write_hf` inverse."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from sage_jax.io import hf, lm_checkpoint
from sage_jax.models import layers
from sage_jax.models.config import LMConfig
from sage_jax.models.decoder import Decoder

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOKENS = np.random.default_rng(0).integers(0, 128, size=(2, 96)).astype(np.int32)
_SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def _random_hf(config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers initialises norms to 1 and biases to 0: make every tensor count
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _ref_logits(model):
    with torch.no_grad():
        return model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


def _our_logits(path):
    cfg, params, _ = hf.read_hf(path)
    model = lm_checkpoint.build(cfg, params)
    return cfg, np.asarray(nnx.jit(lambda m, x: m(x)[0])(model, TOKENS))


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_tiny_qwen2_matches_transformers(tmp_path, shard, rel_err):
    ref = _random_hf(transformers.Qwen2Config(**_SMALL, tie_word_embeddings=False, rope_theta=1e6))
    kw = {} if shard is None else {"max_shard_size": shard}
    ref.save_pretrained(tmp_path, **kw)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard is not None)
    cfg, ours = _our_logits(tmp_path)
    assert cfg.qkv_bias and not cfg.tie_embeddings
    err = rel_err(ours, _ref_logits(ref))
    print(f"tiny Qwen2 (shard={shard}) rel err {err:.2e}")
    assert err <= 1e-4


ROPES = {
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_tiny_llama_rope_variants_match_transformers(tmp_path, rope, rel_err):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(**_SMALL, head_dim=16, tie_word_embeddings=True, rope_parameters=ROPES[rope])
    ref = _random_hf(config)
    ref.save_pretrained(tmp_path)
    cfg, ours = _our_logits(tmp_path)
    assert cfg.rope.type == rope and cfg.tie_embeddings and not cfg.qkv_bias
    inv_ref, scale_ref = ROPE_INIT_FUNCTIONS[rope](config, "cpu")
    inv, scale = layers.rope_inv_freq(cfg.rope, cfg.head_dim)
    np.testing.assert_allclose(inv, inv_ref.numpy(), rtol=1e-6)
    assert scale == pytest.approx(scale_ref)
    err = rel_err(ours, _ref_logits(ref))  # 96 tokens: past original_max_position, where the scaling matters
    print(f"tiny Llama rope={rope} rel err {err:.2e}")
    assert err <= 1e-4


@pytest.mark.parametrize("cfg", [LMConfig.tiny(), LMConfig.tiny(qkv_bias=False, tie_embeddings=True)],
                         ids=["qwen2_untied", "llama_tied"])
def test_write_hf_round_trip(tmp_path, cfg, rel_err):
    model = Decoder(cfg, rngs=nnx.Rngs(1))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params = jax.tree.map(lambda a: np.asarray(a) + 0.05 * np.random.default_rng(2).standard_normal(a.shape), params)
    model = lm_checkpoint.build(cfg, params)
    hf.write_hf(tmp_path, cfg, params)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = np.asarray(nnx.jit(lambda m, x: m(x)[0])(model, TOKENS))
    err = rel_err(ours, _ref_logits(ref))
    print(f"write_hf {cfg.qkv_bias=} rel err {err:.2e}")
    assert err <= 1e-4
    cfg2, params2, _ = hf.read_hf(tmp_path)  # and our reader inverts our writer exactly
    assert cfg2.replace(max_position=cfg.max_position) == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32), b), params, params2)


def test_language_model_prefix_and_stray_tensors(tmp_path):
    from safetensors.numpy import load_file, save_file

    cfg = LMConfig.tiny()
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)))
    hf.write_hf(tmp_path, cfg, params)
    tensors = load_file(tmp_path / "model.safetensors")
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    renamed["model.visual.blocks.0.norm1.weight"] = np.ones(4, np.float32)  # a VLM's other tower: ignored
    save_file(renamed, tmp_path / "model.safetensors")
    _, params2, _ = hf.read_hf(tmp_path)
    jax.tree.map(np.testing.assert_array_equal, params, params2)
    del renamed["model.language_model.layers.1.mlp.up_proj.weight"]
    save_file(renamed, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="blocks/w_up"):
        hf.read_hf(tmp_path)


def test_hf_config_round_trips_through_from_hf():
    for cfg in [LMConfig.tiny(), LMConfig.smollm2_135m()]:
        assert LMConfig.from_hf(json.loads(json.dumps(hf.hf_config(cfg)))) == cfg


def test_tensor_reader_takes_bfloat16_and_refuses_truncated_files(tmp_path):
    """Hub checkpoints are bfloat16, which `safetensors.numpy` refuses: our reader maps any stored dtype."""
    from safetensors.torch import save_file

    tensors = {"a": torch.randn(3, 5, dtype=torch.bfloat16), "b": torch.randn(4, dtype=torch.float16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    read = hf.tensor_reader(hf.tensor_index(tmp_path))
    for name, t in tensors.items():
        np.testing.assert_array_equal(np.asarray(read(name), np.float32), t.float().numpy())
    assert read("a").dtype.name == "bfloat16"
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-8])
    with pytest.raises(ValueError):
        hf.tensor_reader(hf.tensor_index(tmp_path))("b")
