"""Flax NNX model code: config, layers, KV cache, decoder LM (Llama / Qwen2 families)."""

from sage_jax.models.config import LMConfig
from sage_jax.models.decoder import Decoder
from sage_jax.models.kv_cache import KVCache

__all__ = ["Decoder", "KVCache", "LMConfig"]
