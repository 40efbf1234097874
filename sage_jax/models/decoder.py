"""Decoder-only LM of the Llama / Qwen2 family in Flax NNX, layers stacked on a leading `layers` axis.

Parameter tree (the checkpoint layout, `nnx.to_pure_dict(nnx.state(model, nnx.Param))`)::

    embed:      [V, D]                 ("vocab", "embed")
    blocks/attn_norm: [L, D]           blocks/mlp_norm: [L, D]
    blocks/wq:  [L, D, N, H]           blocks/bq: [L, N, H]   (only with qkv_bias)
    blocks/wk, wv: [L, D, K, H]        blocks/bk, bv: [L, K, H]
    blocks/wo:  [L, N, H, D]
    blocks/w_gate, w_up: [L, D, F]     blocks/w_down: [L, F, D]
    final_norm: [D]
    lm_head:    [D, V]                 (only without tied embeddings)

The forward pass writes the new tokens' keys/values into a `KVCache` at per-row offsets and attends under an
explicit [B, T, S] visibility mask, so one function serves prefill, decode steps and tree verification.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from sage_jax.models import layers, serving_lm
from sage_jax.models.config import LMConfig
from sage_jax.models.kv_cache import KVCache

_INIT = nnx.initializers.normal(0.02)


def param(rngs: nnx.Rngs, shape, axes, dtype, init=_INIT) -> nnx.Param:
    """A parameter drawn by `init` (default N(0, 0.02)) and labelled with its logical axes (configs.sharding)."""
    return nnx.Param(init(rngs.params(), shape, dtype), axes=axes)


class Blocks(nnx.Module):
    """All L transformer blocks, each parameter stacked on a leading layer axis (scanned, not unrolled)."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        L, D, N, K, H, F = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim
        dt = jnp.dtype(cfg.param_dtype)
        ones = nnx.initializers.ones
        self.attn_norm = param(rngs, (L, D), ("layers", "embed"), dt, ones)
        self.wq = param(rngs, (L, D, N, H), ("layers", "embed", "heads", "head_dim"), dt)
        self.wk = param(rngs, (L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), dt)
        self.wv = param(rngs, (L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), dt)
        if cfg.qkv_bias:
            zeros = nnx.initializers.zeros
            self.bq = param(rngs, (L, N, H), ("layers", "heads", "head_dim"), dt, zeros)
            self.bk = param(rngs, (L, K, H), ("layers", "kv_heads", "head_dim"), dt, zeros)
            self.bv = param(rngs, (L, K, H), ("layers", "kv_heads", "head_dim"), dt, zeros)
        self.wo = param(rngs, (L, N, H, D), ("layers", "heads", "head_dim", "embed"), dt)
        self.mlp_norm = param(rngs, (L, D), ("layers", "embed"), dt, ones)
        self.w_gate = param(rngs, (L, D, F), ("layers", "embed", "mlp"), dt)
        self.w_up = param(rngs, (L, D, F), ("layers", "embed", "mlp"), dt)
        self.w_down = param(rngs, (L, F, D), ("layers", "mlp", "embed"), dt)


class Decoder(nnx.Module):
    """Llama / Qwen2 decoder LM.

    `forward` returns the last layer's hidden states (before the final norm; the EAGLE feature) and the updated
    cache; `head` maps hidden states to logits; `__call__` does both.
    """

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = jnp.dtype(cfg.param_dtype)
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), dt)
        self.blocks = Blocks(cfg, rngs=rngs)
        self.final_norm = param(rngs, (cfg.d_model,), ("embed",), dt, nnx.initializers.ones)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), dt)

    def init_cache(self, batch: int, capacity: int, n_layers: int | None = None) -> KVCache:
        cfg = self.cfg
        return KVCache.zeros(n_layers or cfg.n_layers, batch, capacity, cfg.n_kv_heads, cfg.head_dim,
                             jnp.dtype(cfg.dtype))

    def embed_tokens(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        return serving_lm.embed_tokens(self.cfg, self.embed[...], tokens)

    def forward(
        self,
        tokens: Int[Array, "B T"] | None,
        positions: Int[Array, "B T"],
        mask: Bool[Array, "B T S"],
        cache: KVCache | None = None,
        write_pos: Int[Array, " B"] | None = None,
        *,
        n_layers: int | None = None,
        embeddings: Float[Array, "B T D"] | None = None,
    ) -> tuple[Float[Array, "B T D"], KVCache | None]:
        """Runs the first `n_layers` (default all) layers.

        With a cache, the T new tokens' keys/values are written at `write_pos[b] + [0, T)` first and the queries
        attend over all S cache slots under `mask`; without one, they attend among themselves (S = T).
        `embeddings` replaces the token lookup (e.g. image features spliced into the sequence).
        """
        cfg = self.cfg
        n = cfg.n_layers if n_layers is None else n_layers
        if cache is not None:
            # Decoding with a cache runs the serving form (per-layer fused weights, unrolled): see models/serving_lm.py.
            return serving_lm.serving_params(cfg, self.params()).truncated(n).forward(
                tokens, positions, mask, cache, write_pos, embeddings=embeddings)

        x = self.embed_tokens(tokens) if embeddings is None else embeddings.astype(jnp.dtype(cfg.dtype))
        params = {name: var[...][:n] for name, var in vars(self.blocks).items() if isinstance(var, nnx.Param)}

        def body(x, p):
            layer = serving_lm.serving_layer(serving_lm.fuse_layer(cfg, p))
            x, _, _ = serving_lm.block(cfg, layer, x, positions, None, None, None, mask)
            return x, None

        x, _ = jax.lax.scan(body, x, params)
        return x, None

    def head(self, hidden: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        lm_head = None if self.cfg.tie_embeddings else self.lm_head[...]
        return serving_lm.head(self.cfg, self.embed[...], self.final_norm[...], lm_head, hidden)

    def params(self) -> dict:
        """The canonical parameter tree (the checkpoint layout) as a pure dict of arrays."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))

    def serving(self) -> serving_lm.LM:
        """This model in serving form (per-layer, fused weights): the form the decoding loops run. With
        `matmul="auto"` on CPU the skinny kernel is built and loaded here, before any forward is traced."""
        serving_lm.prepare_matmul(self.cfg)
        params = self.params()
        groups, shardings = serving_lm.serving_layout(self.cfg, params)  # on a mesh: laid out and cut for its shards
        build = jax.jit(serving_lm.serving_params, static_argnums=(0, 2), out_shardings=shardings)
        return build(self.cfg, params, groups)

    def __call__(self, tokens, positions=None, mask=None, cache=None, write_pos=None, *, n_layers=None):
        """Logits [B, T, V] (float32), last hidden [B, T, D], updated cache. Defaults: causal, no padding."""
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        if mask is None:
            mask = layers.causal_mask(t, jnp.zeros((b,), jnp.int32))
        hidden, cache = self.forward(tokens, positions, mask, cache, write_pos, n_layers=n_layers)
        return self.head(hidden), hidden, cache
