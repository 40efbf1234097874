"""Flax NNX model code: config, layers, KV cache, the decoder LM (Llama / Qwen2 families) and its serving form,
the EAGLE-style draft head, and `CausalLM` (what `sage_jax.load` returns)."""

from sage_jax.models.causal_lm import CausalLM
from sage_jax.models.config import LMConfig
from sage_jax.models.decoder import Decoder
from sage_jax.models.kv_cache import KVCache

__all__ = ["CausalLM", "Decoder", "KVCache", "LMConfig"]
