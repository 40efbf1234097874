"""Frozen, hashable model configs (usable as static `jax.jit` arguments) with named presets."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

RopeType = Literal["default", "linear", "llama3", "yarn"]
Attention = Literal["xla", "pallas"]
ATTENTIONS: tuple[str, ...] = ("xla", "pallas")
Matmul = Literal["auto", "xla", "exact"]
MATMULS: tuple[str, ...] = ("auto", "xla", "exact")
PALLAS_HEAD_DIMS = (64, 128)  # what `pallas_kernels.tree_attention`'s kernels take


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding and its context-extension variants (the `rope_scaling` / `rope_parameters` of HF)."""

    theta: float = 10000.0
    type: RopeType = "default"
    factor: float = 1.0  # linear / llama3 / yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position: int = 8192  # llama3 / yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None -> 0.1 ln(factor) + 1
    # Multimodal RoPE (Qwen2.5-VL): consecutive runs of these many frequency pairs (summing to H/2) read the
    # temporal, height and width position streams in turn; empty for a text LM.
    mrope_section: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMConfig:
    """A decoder-only LM of the Llama / Qwen2 family.

    Attributes:
      vocab_size: V.  d_model: D.  n_layers: L.  n_heads: N.  n_kv_heads: K (GQA when K < N).  head_dim: H.
      mlp_dim: F (SwiGLU).  rope: rotary config.  norm_eps: RMSNorm epsilon.
      qkv_bias: Qwen2 has q/k/v biases, Llama does not.  tie_embeddings: LM head = embedding transposed.
      param_dtype / dtype: storage and compute dtypes ("float32" or "bfloat16").
      eos_token_ids: tokens that end a sequence.  pad_token_id: the id used for padding.
      max_position: the context length the weights were trained for (informational; caches may be shorter).
      attention: how the serving forwards that read a KV cache attend: "xla" (a dense [B, T, S] mask, einsums) or
        "pallas" (the tree-attention kernel of `pallas_kernels/tree_attention`, interpreted on CPU; head dims 64
        and 128). A choice of the run, not of the weights: checkpoints do not store it.
      matmul: how the serving layers multiply by their weights: "auto" (on CPU, the few float32 rows of a decode
        or verify step go through `cpu_kernels.skinny_matmul`'s kernel, everything else through XLA's dot) or
        "xla" (always XLA's dot), or "exact": the shape-invariant mode, in which a row of a forward has the same
        bits whether the forward holds 1 row or 1,024 and a speculative tree's node computes as the same token
        decoded alone would (dense parts in fixed row tiles, attention one query at a time over the whole cache:
        `serving_lm._exact_block`), so that speculative decoding equals plain decoding bit for bit in any dtype.
        A choice of the run, not stored either.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope: RopeConfig = RopeConfig()
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = True
    param_dtype: str = "float32"
    dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    max_position: int = 8192
    attention: Attention = "xla"
    matmul: Matmul = "auto"

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.matmul not in MATMULS:
            raise ValueError(f"matmul must be one of {', '.join(MATMULS)}, got {self.matmul!r}")
        if self.attention == "pallas" and self.head_dim not in PALLAS_HEAD_DIMS:
            raise ValueError(f"the Pallas tree-attention kernels support head dims "
                             f"{' and '.join(map(str, PALLAS_HEAD_DIMS))}, this model has {self.head_dim}")

    def replace(self, **kw) -> LMConfig:
        return dataclasses.replace(self, **kw)

    # ---------------------------------------------------------------- presets

    @classmethod
    def smollm2_135m(cls) -> LMConfig:
        """HuggingFaceTB/SmolLM2-135M-Instruct (Llama architecture)."""
        return cls(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, mlp_dim=1536,
                   rope=RopeConfig(theta=100000.0), norm_eps=1e-5, tie_embeddings=True, eos_token_ids=(2,),
                   pad_token_id=2)

    @classmethod
    def tiny(cls, **kw) -> LMConfig:
        """A 2-layer test model (Qwen2-style biases, GQA)."""
        base = dict(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                    qkv_bias=True, tie_embeddings=False, eos_token_ids=(1,), pad_token_id=0)
        return cls(**{**base, **kw})

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LMConfig:
        """From a transformers `config.json` dict (LlamaForCausalLM / Qwen2ForCausalLM)."""
        arch = (hf.get("architectures") or [""])[0]
        model_type = hf.get("model_type", "")
        if model_type not in ("llama", "qwen2", "mistral") and not arch.startswith(("Llama", "Qwen2", "Mistral")):
            raise ValueError(f"unsupported architecture {arch or model_type!r}; expected a Llama or Qwen2 model")
        n_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
        rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        theta = rp.get("rope_theta", hf.get("rope_theta", 10000.0))
        rtype = rp.get("rope_type", rp.get("type", "default")) or "default"
        if rtype not in ("default", "linear", "llama3", "yarn"):
            raise ValueError(f"unsupported rope type {rtype!r}")
        rope = RopeConfig(
            theta=float(theta), type=rtype, factor=float(rp.get("factor", 1.0)),
            low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rp.get("high_freq_factor", 4.0)),
            original_max_position=int(rp.get("original_max_position_embeddings",
                                             hf.get("max_position_embeddings", 8192))),
            beta_fast=float(rp.get("beta_fast", 32.0)), beta_slow=float(rp.get("beta_slow", 1.0)),
            attention_factor=rp.get("attention_factor"),
        )
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        pad = hf.get("pad_token_id")
        qkv_bias = model_type == "qwen2" or arch.startswith("Qwen2") or bool(hf.get("attention_bias", False))
        return cls(
            vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads", n_heads), head_dim=head_dim,
            mlp_dim=hf["intermediate_size"], rope=rope, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=qkv_bias, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            eos_token_ids=eos, pad_token_id=int(pad if pad is not None else (eos[0] if eos else 0)),
            max_position=int(hf.get("max_position_embeddings", 8192)),
        )

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        del d["attention"], d["matmul"]  # choices of the run
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LMConfig:
        d = dict(d)
        rope = dict(d.get("rope", {}))
        rope["mrope_section"] = tuple(rope.get("mrope_section", ()))
        d["rope"] = RopeConfig(**rope)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d.pop("attention", None)
        d.pop("matmul", None)
        return cls(**d)
