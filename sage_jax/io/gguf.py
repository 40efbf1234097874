"""GGUF (llama.cpp) files -> (LMConfig, float32 params in our layout, tokenizer, chat template), without torch.

Weights are dequantized with `gguf.quants.dequantize`, renamed to HF names and sent through the one mapping table
in `sage_jax.io.hf`. llama.cpp's converter permutes the rows of Llama's Q and K projections so that RoPE rotates
interleaved pairs (x[2i], x[2i+1]); our RoPE (like HF's) rotates halves (x[i], x[i + H/2]), so the permutation is
undone here exactly as transformers' GGUF loader does it. Qwen2 files are not permuted.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from sage_jax.io import hf
from sage_jax.models.config import LMConfig, RopeConfig

ARCHITECTURES = ("llama", "qwen2")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")

# The split regex each GGUF `tokenizer.ggml.pre` implies (what llama.cpp and transformers use).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    raise ValueError(f"unsupported GGUF tensor {name!r}")


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` of Q/K rows: per head, interleaved pairs -> halves."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader) -> LMConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; expected one of {ARCHITECTURES}")

    def g(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:  # llama3-style scaling stored as a tensor; not recovered here
        raise ValueError("GGUF files with a rope_freqs tensor (llama3 rope scaling) are not supported")
    n_heads, d_model = int(g("attention.head_count")), int(g("embedding_length"))
    scaling = g("rope.scaling.type", "none")
    rope_kw: dict[str, Any] = {"theta": float(g("rope.freq_base", 10000.0))}
    if scaling in ("linear", "yarn"):
        rope_kw.update(type=scaling, factor=float(g("rope.scaling.factor", 1.0)))
        if scaling == "yarn":
            rope_kw["original_max_position"] = int(g("rope.scaling.original_context_length", g("context_length")))
    elif scaling != "none":
        raise ValueError(f"unsupported GGUF rope scaling {scaling!r}")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id", eos)
    n_vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return LMConfig(
        vocab_size=int(n_vocab), d_model=d_model, n_layers=int(g("block_count")), n_heads=n_heads,
        n_kv_heads=int(g("attention.head_count_kv", n_heads)),
        head_dim=int(g("attention.key_length", g("rope.dimension_count", d_model // n_heads))),
        mlp_dim=int(g("feed_forward_length")), rope=RopeConfig(**rope_kw),
        norm_eps=float(np.float32(g("attention.layer_norm_rms_epsilon", 1e-6))),
        qkv_bias="blk.0.attn_q.bias" in names, tie_embeddings="output.weight" not in names,
        eos_token_ids=() if eos is None else (int(eos),), pad_token_id=int(pad if pad is not None else 0),
        max_position=int(g("context_length", 8192)),
    )


def _tensors(reader, cfg: LMConfig, arch: str):
    from gguf.quants import dequantize

    for t in reader.tensors:
        # `t.data` is in numpy order: rows = output features, i.e. the HF/torch layout.
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(tuple(reversed(t.shape)))
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute(w, cfg.n_heads)
        elif arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute(w, cfg.n_kv_heads)
        yield hf_name(t.name), w


def read_tokenizer(reader):
    """A `transformers.PreTrainedTokenizerFast` (tokenizers backend, no torch) built from the GGUF metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer {kind!r}; only byte-level BPE ('gpt2') is supported")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges") or []]
    # A byte-level vocabulary spells every byte with a printable stand-in; the odd token stored raw is re-spelled.
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode())): i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre == "qwen2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre == "smollm":  # SmolLM2's own tokenizer.json: every digit is its own pre-token
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Type 3 = CONTROL (special, never split), type 4 = USER_DEFINED (matched whole, not special).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3 and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])

    def special(key):
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(i)]

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=special("bos"), eos_token=special("eos"), unk_token=special("unknown"),
        pad_token=special("padding"), chat_template=_field(reader, "tokenizer.chat_template"),
    )


def read_gguf(path: str | os.PathLike) -> tuple[LMConfig, hf.Params, Any, str | None]:
    """A GGUF file -> (config, float32 params in our layout, tokenizer, chat template or None)."""
    from gguf import GGUFReader

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such GGUF file: {path}")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise ValueError(f"{path} is not a readable GGUF file, truncated or damaged ({type(e).__name__}: "
                         f"{e})") from None
    # The reader maps the file: tensors past its end come back short. A truncated download is named as such.
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > os.path.getsize(path):
        raise ValueError(f"{path} is truncated: its tensors need {end:,} bytes, the file has "
                         f"{os.path.getsize(path):,}")
    cfg = read_config(reader)
    params = hf.to_params(cfg, _tensors(reader, cfg, _field(reader, "general.architecture")))
    tokenizer = read_tokenizer(reader)
    return cfg, params, tokenizer, tokenizer.chat_template


def is_gguf(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
