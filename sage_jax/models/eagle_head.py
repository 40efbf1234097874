"""EAGLE-style draft head: one decoder layer over [target feature ; next-token embedding], reusing the target's
embedding, final norm and LM head (frozen, passed in, never owned).

At position t the head reads concat(f_{t-1}, E[x_t]) where f is the target's last-layer hidden state BEFORE its
final norm (what `Decoder.forward` / `LM.forward` return) and E the target's embedding, maps it with a linear
`fc` [2D -> D] and one pre-norm transformer layer (RoPE, GQA, its own one-layer KV cache) to f̂_t; the logits of
x_{t+1} are the target's final norm + LM head applied to f̂_t.

EAGLE-3-style heads (`taps`, a trainable `lm_head`) differ in two places, after EAGLE-3 (arXiv 2503.01840):
* the feature the head reads where the TARGET provides it is not the last hidden state but the inputs of a low, a
  middle and a high layer (`LM.forward(taps=...)`; for L = 30 layers 2, 15 and 27, HF's `hidden_states[2, 15,
  27]`), concatenated [Z = 3D] and projected back to D by `fuse` (`fuse_features`). Where the head feeds itself
  (deeper draft levels) it reads its own f̂ [D] as before. It is trained without feature regression: f̂ is
  then only the head's state, not a prediction of the target's;
* its own final norm and LM head over the reduced vocabulary ([D, Vd], trainable; warm-started from the
  target's rows) instead of the target's frozen rows.

Parameter tree (a pure nested dict; the checkpoint layout, kind "eagle_head" in `sage_jax.io.lm_checkpoint`)::

    fc:    [2D, D]   input projection of concat(feature, embedding)
    fc_b:  [D]
    layer: the fused per-layer dict of `sage_jax.models.serving_lm.fuse_layer`:
           attn_norm [D], wqkv [D, (N+2K)H], bqkv [(N+2K)H] (qkv_bias only), wo [NH, D],
           mlp_norm [D], w_gate_up [D, 2F], w_down [F, D]
    fuse:  [Z, D]    EAGLE-3-style only: the tapped features' projection
    final_norm [D], lm_head [D, Vd]   own-head only

`head_cfg` is an `LMConfig` with n_layers=1 and the target's d_model / vocab_size (see `head_config`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from configs.sharding import shard
from sage_jax.models import serving_lm
from sage_jax.models.config import LMConfig
from sage_jax.models.draft_vocab import DraftVocab
from sage_jax.models.kv_cache import KVCache

_INIT = nnx.initializers.normal(0.02)


def head_config(target: LMConfig, **overrides) -> LMConfig:
    """The head's layer config: the target's attention / MLP shapes, one layer (`overrides` e.g. mlp_dim)."""
    return target.replace(n_layers=1, **overrides)


class EagleHead(nnx.Module):
    """The head's parameters as an NNX module (for init and sharding metadata); compute is `eagle_forward`.
    `n_taps` > 0 adds `fuse` [n_taps·D, D]; `head_vocab` > 0 adds an own final norm and LM head [D, head_vocab]."""

    def __init__(self, cfg: LMConfig, *, n_taps: int = 0, head_vocab: int = 0, rngs: nnx.Rngs):
        if cfg.n_layers != 1:
            raise ValueError(f"an EAGLE head has one layer, the config says {cfg.n_layers}")
        d, n, k, h, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim
        dt = jnp.dtype(cfg.param_dtype)

        def p(shape, axes, init=_INIT):
            return nnx.Param(init(rngs.params(), shape, dt), axes=axes)

        ones, zeros = nnx.initializers.ones, nnx.initializers.zeros
        self.fc = p((2 * d, d), (None, "embed"))
        self.fc_b = p((d,), ("embed",), zeros)
        layer = {
            "attn_norm": p((d,), ("embed",), ones),
            "wqkv": p((d, (n + 2 * k) * h), ("embed", None)),
            "wo": p((n * h, d), (None, "embed")),
            "mlp_norm": p((d,), ("embed",), ones),
            "w_gate_up": p((d, 2 * f), ("embed", None)),
            "w_down": p((f, d), (None, "embed")),
        }
        if cfg.qkv_bias:
            layer["bqkv"] = p(((n + 2 * k) * h,), (None,), zeros)
        self.layer = nnx.Dict(layer)
        if n_taps:
            self.fuse = p((n_taps * d, d), (None, "embed"), nnx.initializers.normal((n_taps * d) ** -0.5))
        if head_vocab:
            self.final_norm = p((d,), ("embed",), ones)
            self.lm_head = p((d, head_vocab), ("embed", "vocab"))

    def params(self) -> dict:
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))


def init_params(cfg: LMConfig, seed: int = 0, *, n_taps: int = 0, head_vocab: int = 0) -> dict:
    """Fresh head parameters (pure dict, the layout above)."""
    return EagleHead(cfg, n_taps=n_taps, head_vocab=head_vocab, rngs=nnx.Rngs(seed)).params()


def warm_start(params: dict, vocab_ids, target_embed: Float[Array, "V D"], target_final_norm: Float[Array, " D"],
               target_lm_head: Float[Array, "D V"] | None) -> dict:
    """An own-head head's `lm_head` / `final_norm` set to the target's rows for `vocab_ids` and its norm (the
    starting point of training: the head first predicts as the target's head would). A head without them gains
    them, in its `fc`'s dtype: it then computes exactly what it did with the target's rows."""
    ids = jnp.asarray(vocab_ids, jnp.int32)
    rows = jnp.take(target_embed, ids, axis=0).T if target_lm_head is None else jnp.take(target_lm_head, ids, axis=1)
    if "lm_head" in params and params["lm_head"].shape != rows.shape:
        raise ValueError(f"lm_head {params['lm_head'].shape} does not fit {len(ids)} vocabulary ids")
    dt = (params["lm_head"] if "lm_head" in params else params["fc"]).dtype
    return {**params, "lm_head": rows.astype(dt), "final_norm": jnp.asarray(target_final_norm, dt)}


def fuse_features(head_params: dict, features: Float[Array, "B T Z"]) -> Float[Array, "B T D"]:
    """Target-provided features -> the head's input width: `fuse` on the tapped features of an EAGLE-3-style
    head; the last hidden state as it is for a plain one."""
    if "fuse" not in head_params:
        return features
    w = head_params["fuse"]
    return jnp.einsum("BTZ,ZD->BTD", features.astype(w.dtype), w)


def init_cache(cfg: LMConfig, batch: int, capacity: int) -> KVCache:
    """The head's own one-layer KV cache."""
    return KVCache.zeros(1, batch, capacity, cfg.n_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype))


@jax.named_scope(serving_lm.MODEL_SCOPE)
def eagle_features(head_params: dict, head_cfg: LMConfig, target_embed: Float[Array, "V D"],
                   tokens: Int[Array, "B T"], features_prev: Float[Array, "B T D"], positions: Int[Array, "B T"],
                   mask: Bool[Array, "B T S"], cache: KVCache | None = None, write_pos: Int[Array, " B"] | None = None,
                   embeddings: Float[Array, "B T D"] | None = None
                   ) -> tuple[Float[Array, "B T D"], KVCache | None]:
    """f̂ [B, T, D] (the predicted target features) and the updated cache; no LM head. `embeddings`: the token
    embeddings to read instead of `target_embed[tokens]` (a multimodal prompt's, visual features spliced in)."""
    dt = jnp.dtype(head_cfg.dtype)
    e = serving_lm.embed_tokens(head_cfg, target_embed, tokens) if embeddings is None else embeddings.astype(dt)
    x = jnp.concatenate([features_prev.astype(dt), e], axis=-1)
    if "fc_t" in head_params:  # serving form (`EagleWeights.build`): [D, I], the layers' feature-major matmul
        b, t, i = x.shape
        x = serving_lm.project(head_cfg, head_params["fc_t"].astype(dt), x.reshape(b * t, i).T).T.reshape(b, t, -1)
    else:
        x = jnp.einsum("BTI,ID->BTD", x, head_params["fc"].astype(dt))
    x = x + head_params["fc_b"].astype(dt)[None, None]
    x = shard(x, ("batch", "seq", "embed"))
    layer = serving_lm.serving_layer(head_params["layer"])  # serving drafts convert once at load (`EagleWeights.load`)
    if cache is None:
        x, _, _ = serving_lm.block(head_cfg, layer, x, positions, None, None, None, mask)
        return x, None
    if cache.n_layers != 1:
        raise ValueError(f"an EAGLE head's cache has one layer, got {cache.n_layers}")
    mask = serving_lm.resolve_mask(head_cfg, mask, cache.capacity)
    x, k, v = serving_lm.block(head_cfg, layer, x, positions, cache.k[0], cache.v[0], write_pos, mask)
    return x, KVCache(k=(k,), v=(v,))


def eagle_forward(head_params: dict, head_cfg: LMConfig, target_embed: Float[Array, "V D"],
                  target_final_norm: Float[Array, " D"], target_lm_head: Float[Array, "D V"] | None,
                  tokens: Int[Array, "B T"], features_prev: Float[Array, "B T D"], positions: Int[Array, "B T"],
                  mask: Bool[Array, "B T S"], cache: KVCache | None = None, write_pos: Int[Array, " B"] | None = None,
                  *, vocab: DraftVocab | None = None
                  ) -> tuple[Float[Array, "B T V"], Float[Array, "B T D"], KVCache | None]:
    """(logits, f̂, cache). Pure; jit it with `head_cfg` static.

    tokens[b, t] = x_t, features_prev[b, t] = f_{t-1} (the target's feature of the previous token, or the head's
    own prediction f̂_{t-1} when drafting several steps ahead). `target_lm_head` None = tied embeddings.
    With a cache, keys/values go to slots `write_pos[b] + [0, T)` and `mask` [B, T, S] ranges over the cache;
    without one, the T tokens attend among themselves under `mask` [B, T, T].
    With `vocab`, the logits cover only its Vd ids ([B, T, Vd]; `vocab.to_full` / `vocab.log_probs_full` map them
    back to the full vocabulary) and `target_lm_head` is ignored (the subset head was gathered by `vocab`).
    """
    feats, cache = eagle_features(head_params, head_cfg, target_embed, tokens, features_prev, positions, mask,
                                  cache, write_pos)
    norm = head_params.get("final_norm", target_final_norm)  # an own head brings its own norm
    if vocab is not None and "vocab_rows" in head_params:  # serving form: the subset's rows [Vd, D], as a tied head
        logits = serving_lm.head(head_cfg, head_params["vocab_rows"], norm, None, feats)
    elif vocab is not None:
        logits = serving_lm.head(head_cfg, None, norm, vocab.head, feats)
    else:
        logits = serving_lm.head(head_cfg, target_embed, target_final_norm, target_lm_head, feats)
    return logits, feats, cache


def shift_features(features: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
    """Target features f_t -> the head's input f_{t-1} (zeros at t = 0): teacher forcing."""
    return jnp.concatenate([jnp.zeros_like(features[:, :1]), features[:, :-1]], axis=1)


@flax.struct.dataclass
class EagleWeights:
    """A head ready for decoding: its params (layer in serving form), an optional reduced vocabulary, its layer
    config and the target layers it taps (static; () = the last hidden state). A pytree, so it is an argument of
    the compiled loops."""

    head: dict
    vocab: DraftVocab | None
    cfg: LMConfig = flax.struct.field(pytree_node=False)
    taps: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())

    def with_attention(self, attention: str) -> EagleWeights:
        """This head with its cache-reading forwards attending the `LMConfig.attention` way ("xla" / "pallas")."""
        return self if attention == self.cfg.attention else self.replace(cfg=self.cfg.replace(attention=attention))

    def with_matmul(self, matmul: str) -> EagleWeights:
        """This head with its layer multiplying the `LMConfig.matmul` way ("auto" / "xla")."""
        return self if matmul == self.cfg.matmul else self.replace(cfg=self.cfg.replace(matmul=matmul))

    @classmethod
    def build(cls, cfg: LMConfig, params: dict, vocab_ids, target_cfg: LMConfig, target_embed: Float[Array, "V D"],
              target_lm_head: Float[Array, "D V"] | None, taps: tuple[int, ...] = ()) -> EagleWeights:
        """From stored head params for a target with `target_cfg` and these embedding / LM-head arrays (the
        reduced vocabulary's head rows are gathered once, here, unless the head has its own). ValueError when the
        head is for another target or its parts do not fit together."""
        if cfg.d_model != target_cfg.d_model or cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"the head is for d_model={cfg.d_model}, vocab={cfg.vocab_size}; the target has "
                             f"d_model={target_cfg.d_model}, vocab={target_cfg.vocab_size}")
        taps = tuple(int(i) for i in taps)
        width = params["fuse"].shape[0] if "fuse" in params else 0
        if width != len(taps) * cfg.d_model:
            raise ValueError(f"the head's fuse projection does not fit its taps {taps}")
        if any(not 0 <= i < target_cfg.n_layers for i in taps):
            raise ValueError(f"the head taps layers {taps}; the target has {target_cfg.n_layers}")
        params = dict(params)
        own = params.pop("lm_head", None)
        if own is not None:
            if vocab_ids is None or own.shape != (cfg.d_model, len(vocab_ids)):
                raise ValueError("a head with its own LM head needs its vocabulary ids, one per head column")
            vocab = DraftVocab(ids=jnp.asarray(vocab_ids, jnp.int32), head=own, vocab_size=cfg.vocab_size)
        else:
            vocab = None if vocab_ids is None else DraftVocab.build(vocab_ids, target_embed, target_lm_head)
        # Once, not per draft level: the layer's matrices [out, in], and fc and the vocabulary's head rows the same
        # way round, which the decode steps' few rows multiply fastest on CPU (`serving_lm.project`).
        params["layer"] = serving_lm.serving_layer(params["layer"])
        params["fc_t"] = params.pop("fc").T
        if vocab is not None:
            params["vocab_rows"] = vocab.head.T
        return cls(head=params, vocab=vocab, cfg=cfg, taps=taps)
