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

from configs.sharding import shard
from sage_jax.models import layers
from sage_jax.models.config import LMConfig
from sage_jax.models.kv_cache import KVCache, write_rows

_INIT = nnx.initializers.normal(0.02)


def _param(rngs, shape, axes, dtype, init=_INIT):
    return nnx.Param(init(rngs.params(), shape, dtype), axes=axes)


class Blocks(nnx.Module):
    """All L transformer blocks, each parameter stacked on a leading layer axis (scanned, not unrolled)."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        L, D, N, K, H, F = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim
        dt = jnp.dtype(cfg.param_dtype)
        ones = nnx.initializers.ones
        self.attn_norm = _param(rngs, (L, D), ("layers", "embed"), dt, ones)
        self.wq = _param(rngs, (L, D, N, H), ("layers", "embed", "heads", "head_dim"), dt)
        self.wk = _param(rngs, (L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), dt)
        self.wv = _param(rngs, (L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), dt)
        if cfg.qkv_bias:
            zeros = nnx.initializers.zeros
            self.bq = _param(rngs, (L, N, H), ("layers", "heads", "head_dim"), dt, zeros)
            self.bk = _param(rngs, (L, K, H), ("layers", "kv_heads", "head_dim"), dt, zeros)
            self.bv = _param(rngs, (L, K, H), ("layers", "kv_heads", "head_dim"), dt, zeros)
        self.wo = _param(rngs, (L, N, H, D), ("layers", "heads", "head_dim", "embed"), dt)
        self.mlp_norm = _param(rngs, (L, D), ("layers", "embed"), dt, ones)
        self.w_gate = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), dt)
        self.w_up = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), dt)
        self.w_down = _param(rngs, (L, F, D), ("layers", "mlp", "embed"), dt)


def _block(cfg: LMConfig, p: dict, x, positions, k_cache, v_cache, write_pos, mask):
    """One layer. x: [B,T,D]; k_cache/v_cache: this layer's [B,S,K,H] (None: attend within x only)."""
    dt = jnp.dtype(cfg.dtype)
    inv_freq, rope_scale = layers.rope_inv_freq(cfg.rope, cfg.head_dim)
    h = layers.rms_norm(x, p["attn_norm"], cfg.norm_eps)
    q = jnp.einsum("BTD,DNH->BTNH", h, p["wq"].astype(dt))
    k = jnp.einsum("BTD,DKH->BTKH", h, p["wk"].astype(dt))
    v = jnp.einsum("BTD,DKH->BTKH", h, p["wv"].astype(dt))
    if cfg.qkv_bias:
        # [N, H] biases get explicit leading axes: the project runs with jax_numpy_rank_promotion="raise".
        q, k, v = (a + p[b].astype(dt)[None, None] for a, b in ((q, "bq"), (k, "bk"), (v, "bv")))
    q = shard(layers.apply_rope(q, positions, inv_freq, rope_scale), ("batch", "seq", "heads", "head_dim"))
    k = shard(layers.apply_rope(k, positions, inv_freq, rope_scale), ("batch", "seq", "kv_heads", "head_dim"))
    if k_cache is not None:
        k_cache = write_rows(k_cache, k.astype(k_cache.dtype), write_pos)
        v_cache = write_rows(v_cache, v.astype(v_cache.dtype), write_pos)
        k_all, v_all = k_cache.astype(dt), v_cache.astype(dt)
    else:
        k_all, v_all = k, v
    o = layers.attention(q, k_all, v_all, mask)
    x = x + jnp.einsum("BTNH,NHD->BTD", o, p["wo"].astype(dt))
    x = shard(x, ("batch", "seq", "embed"))
    h = layers.rms_norm(x, p["mlp_norm"], cfg.norm_eps)
    gate = jnp.einsum("BTD,DF->BTF", h, p["w_gate"].astype(dt))
    up = jnp.einsum("BTD,DF->BTF", h, p["w_up"].astype(dt))
    act = shard(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
    x = x + jnp.einsum("BTF,FD->BTD", act, p["w_down"].astype(dt))
    return shard(x, ("batch", "seq", "embed")), k_cache, v_cache


class Decoder(nnx.Module):
    """Llama / Qwen2 decoder LM.

    `forward` returns the last layer's hidden states (before the final norm; the EAGLE feature) and the updated
    cache; `head` maps hidden states to logits; `__call__` does both.
    """

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = jnp.dtype(cfg.param_dtype)
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), dt)
        self.blocks = Blocks(cfg, rngs=rngs)
        self.final_norm = _param(rngs, (cfg.d_model,), ("embed",), dt, nnx.initializers.ones)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), dt)

    def init_cache(self, batch: int, capacity: int, n_layers: int | None = None) -> KVCache:
        cfg = self.cfg
        return KVCache.zeros(n_layers or cfg.n_layers, batch, capacity, cfg.n_kv_heads, cfg.head_dim,
                             jnp.dtype(cfg.dtype))

    def embed_tokens(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        x = jnp.take(self.embed[...], tokens, axis=0).astype(jnp.dtype(self.cfg.dtype))
        return shard(x, ("batch", "seq", "embed"))

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
        x = self.embed_tokens(tokens) if embeddings is None else embeddings.astype(jnp.dtype(cfg.dtype))
        n = cfg.n_layers if n_layers is None else n_layers
        params = {name: var[...][:n] for name, var in vars(self.blocks).items() if isinstance(var, nnx.Param)}
        if cache is not None and cache.k.shape[0] != n:
            raise ValueError(f"cache has {cache.k.shape[0]} layers, running {n}")

        if cache is None:
            def body(x, p):
                x, _, _ = _block(cfg, p, x, positions, None, None, None, mask)
                return x, None

            x, _ = jax.lax.scan(body, x, params)
            return x, None

        # The whole cache rides in the carry and each layer updates its slice in place: scanning it as xs/ys
        # would copy all L layers' caches on every call.
        def body(carry, xs):
            x, kc, vc = carry
            i, p = xs
            x, k_l, v_l = _block(cfg, p, x, positions, kc[i], vc[i], write_pos, mask)
            kc = jax.lax.dynamic_update_index_in_dim(kc, k_l, i, axis=0)
            vc = jax.lax.dynamic_update_index_in_dim(vc, v_l, i, axis=0)
            return (x, kc, vc), None

        (x, kc, vc), _ = jax.lax.scan(body, (x, cache.k, cache.v), (jnp.arange(n), params))
        return x, KVCache(k=kc, v=vc)

    def head(self, hidden: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        cfg = self.cfg
        h = layers.rms_norm(hidden, self.final_norm[...], cfg.norm_eps)
        w = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
        logits = jnp.einsum("BTD,DV->BTV", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
        return shard(logits, ("batch", "seq", "vocab"))

    def __call__(self, tokens, positions=None, mask=None, cache=None, write_pos=None, *, n_layers=None):
        """Logits [B, T, V] (float32), last hidden [B, T, D], updated cache. Defaults: causal, no padding."""
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        if mask is None:
            mask = layers.causal_mask(t, jnp.zeros((b,), jnp.int32))
        hidden, cache = self.forward(tokens, positions, mask, cache, write_pos, n_layers=n_layers)
        return self.head(hidden), hidden, cache
