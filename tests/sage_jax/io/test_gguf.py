"""GGUF reading on tiny random files written with `gguf.GGUFWriter`: the Q/K un-permutation (Llama) and the
unpermuted Qwen2 layout, against transformers' own GGUF loader."""

import jax
import numpy as np
import pytest
from flax import nnx

from sage_jax.io import gguf as our_gguf
from sage_jax.io import hf, lm_checkpoint
from sage_jax.models.config import LMConfig
from sage_jax.models.decoder import Decoder

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TOKENS = np.random.default_rng(0).integers(0, 128, size=(2, 24)).astype(np.int32)
_HF_TO_GGUF = {v: k for k, v in {**our_gguf._GLOBAL_NAMES}.items()}


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute` (halves -> interleaved pairs), written out independently."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(our_gguf.unpermute(_permute(w, 3), 3), w)


def _gguf_name(name: str) -> str:
    if name in _HF_TO_GGUF:
        return _HF_TO_GGUF[name]
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{ {v: k for k, v in our_gguf._BLOCK_NAMES.items()}[rest]}"


def _write_gguf(path, arch: str, cfg: LMConfig, params) -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.mlp_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(list(bytes_to_unicode().values())[: cfg.vocab_size])
    w.add_token_types([1] * cfg.vocab_size)
    w.add_token_merges([])
    w.add_eos_token_id(1)
    for name, t in hf.from_params(cfg, params).items():
        if arch == "llama" and name.endswith("q_proj.weight"):
            t = _permute(t, cfg.n_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            t = _permute(t, cfg.n_kv_heads)
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,cfg", [("llama", LMConfig.tiny(qkv_bias=False, tie_embeddings=True, norm_eps=1e-5)),
                                      ("qwen2", LMConfig.tiny(norm_eps=1e-6))])
def test_tiny_gguf_matches_transformers(tmp_path, arch, cfg, rel_err):
    cfg = cfg.replace(max_position=256, eos_token_ids=(1,), pad_token_id=1)
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda a: np.asarray(a) + 0.05 * rng.standard_normal(a.shape).astype(np.float32),
                          nnx.to_pure_dict(nnx.state(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)))
    _write_gguf(tmp_path / "tiny.gguf", arch, cfg, params)

    cfg2, params2, tok, _ = our_gguf.read_gguf(tmp_path / "tiny.gguf")
    assert cfg2.replace(norm_eps=cfg.norm_eps) == cfg and tok.eos_token_id == 1
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), params, params2)

    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    with torch.no_grad():
        ref_logits = ref.eval()(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    ours = np.asarray(nnx.jit(lambda m, x: m(x)[0])(lm_checkpoint.build(cfg2, params2), TOKENS))
    err = rel_err(ours, ref_logits)
    print(f"tiny {arch} GGUF rel err {err:.2e}")
    assert err <= 1e-4


def test_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gemma")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'"):
        our_gguf.read_gguf(tmp_path / "x.gguf")


def test_gguf_conversion_cache(tmp_path, monkeypatch):
    from sage_jax.io import load_lm, loader

    cfg = LMConfig.tiny(eos_token_ids=(1,), pad_token_id=1, max_position=256)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)))
    _write_gguf(tmp_path / "tiny.gguf", "qwen2", cfg, params)
    monkeypatch.setenv("SAGE_JAX_CACHE", str(tmp_path / "cache"))
    first = load_lm(tmp_path / "tiny.gguf")
    ckpt = loader.cache_path(tmp_path / "tiny.gguf")  # written by the first load
    assert ckpt.startswith(str(tmp_path / "cache")) and loader.detect(ckpt) == "checkpoint"
    meta = lm_checkpoint.checkpoint.read_metadata(ckpt)
    assert meta["provenance"]["sha256"] == loader.sha256(tmp_path / "tiny.gguf")
    second = load_lm(tmp_path / "tiny.gguf")
    assert first[0] == second[0] and second[2].eos_token_id == 1
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(first[1])),
                 nnx.to_pure_dict(nnx.state(second[1])))
    (tmp_path / "ro").write_text("a file where the cache dir should be")
    monkeypatch.setenv("SAGE_JAX_CACHE", str(tmp_path / "ro"))
    with pytest.warns(UserWarning, match="conversion cache unusable"):
        third = load_lm(tmp_path / "tiny.gguf")
    assert third[0] == first[0]


def test_a_truncated_gguf_names_the_file(tmp_path):
    """A download cut short: one line naming the file, not numpy's reshape error alone."""
    cfg = LMConfig.tiny(norm_eps=1e-6).replace(max_position=256, eos_token_ids=(1,), pad_token_id=1)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)))
    _write_gguf(tmp_path / "tiny.gguf", "qwen2", cfg, params)
    data = (tmp_path / "tiny.gguf").read_bytes()
    for cut in (len(data) // 2, len(data) - 100):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"cut\.gguf .*(truncated|is not a readable GGUF)") as e:
            our_gguf.read_gguf(tmp_path / "cut.gguf")
        assert "\n" not in str(e.value)
