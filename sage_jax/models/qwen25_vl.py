"""Qwen2.5-VL in Flax NNX: the vision tower (`qwen25_vision`) feeding the project's `Decoder` through spliced
embeddings and multimodal rotary positions (M-RoPE).

Parameter tree (`nnx.to_pure_dict(nnx.state(model, nnx.Param))`)::

    lm:     the `Decoder` layout (models/decoder.py): embed, blocks/*, final_norm, lm_head
    vision: the tower's layout (models/qwen25_vision.py): patch_embed, blocks/*, merger/*

Usage, with inputs as transformers' processor makes them (pad tokens already expanded, `expand_placeholders`)::

    logits = model(input_ids, attention_mask, pixel_values=..., image_grid_thw=...)      # [B, T, V] float32
    tokens = model.generate(input_ids, attention_mask, pixel_values=..., image_grid_thw=..., max_new_tokens=32)

Everything whose shape depends on the images (the tower's index arrays, where features go, M-RoPE positions) is
computed on the host in numpy; the model runs as one jitted pure function of the parameters per call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from sage_jax.models import qwen25_vision, serving_lm
from sage_jax.models.config import LMConfig, RopeConfig
from sage_jax.models.decoder import Decoder
from sage_jax.models.qwen25_inputs import prepare, rope_index
from sage_jax.models.qwen25_vision import Qwen25Vision, Qwen25VisionConfig

__all__ = ["Qwen25VL", "Qwen25VLConfig", "Qwen25VisionConfig", "rope_index"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen25VLConfig:
    """Attributes: text (the LM, with rope.mrope_section); vision; the special token ids; tokens_per_second (the
    temporal M-RoPE step of one second of video)."""

    text: LMConfig
    vision: Qwen25VisionConfig
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tokens_per_second: float = 2

    def __post_init__(self):
        if sum(self.text.rope.mrope_section) != self.text.head_dim // 2:
            raise ValueError(f"mrope_section {self.text.rope.mrope_section} must sum to head_dim/2 = "
                             f"{self.text.head_dim // 2}")
        if self.vision.out_hidden_size != self.text.d_model:
            raise ValueError(f"vision out_hidden_size {self.vision.out_hidden_size} != d_model {self.text.d_model}")

    def replace(self, **kw) -> Qwen25VLConfig:
        return dataclasses.replace(self, **kw)

    @classmethod
    def _make(cls, text: dict, vision: dict, **kw) -> Qwen25VLConfig:
        rope = RopeConfig(theta=1e6, mrope_section=(16, 24, 24))
        base = dict(n_heads=text["d_model"] // 128, head_dim=128, rope=rope, norm_eps=1e-6, qkv_bias=True,
                    tie_embeddings=False, eos_token_ids=(151645,), pad_token_id=151643, max_position=128000)
        vbase = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, window_size=112,
                     fullatt_block_indexes=(7, 15, 23, 31), out_hidden_size=text["d_model"])
        return cls(text=LMConfig(**{**base, **text}), vision=Qwen25VisionConfig(**{**vbase, **vision}), **kw)

    @classmethod
    def qwen25_vl_7b(cls) -> Qwen25VLConfig:
        """Qwen/Qwen2.5-VL-7B-Instruct."""
        return cls._make(dict(vocab_size=152064, d_model=3584, n_layers=28, n_kv_heads=4, mlp_dim=18944), {})

    @classmethod
    def qwen25_vl_72b(cls) -> Qwen25VLConfig:
        """Qwen/Qwen2.5-VL-72B-Instruct."""
        return cls._make(dict(vocab_size=152064, d_model=8192, n_layers=80, n_kv_heads=8, mlp_dim=29568), {})

    @classmethod
    def tiny(cls, **kw) -> Qwen25VLConfig:
        """A test model: 2 LM layers of width 64, a 4-block vision tower of width 32 whose 56-pixel windows hold
        2x2 merged tokens (block 2 full attention); special ids 1..6 of a 256-token vocabulary."""
        text = LMConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128,
                        rope=RopeConfig(theta=1e6, mrope_section=(2, 3, 3)), qkv_bias=True, tie_embeddings=False,
                        eos_token_ids=(2,), pad_token_id=0, max_position=1024)
        vision = Qwen25VisionConfig(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                    window_size=56, fullatt_block_indexes=(2,))
        base = dict(text=text, vision=vision, image_token_id=3, video_token_id=4, vision_start_token_id=5,
                    vision_end_token_id=6, tokens_per_second=2)
        return cls(**{**base, **kw})

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Qwen25VLConfig:
        """From the `config.json` dict of a Qwen2_5_VLForConditionalGeneration: transformers v5's nested
        `text_config` or the older flat layout (text fields at the top, `rope_scaling` of type "mrope")."""
        if hf.get("model_type") != "qwen2_5_vl":
            raise ValueError(f"not a Qwen2.5-VL config: model_type {hf.get('model_type')!r}, expected 'qwen2_5_vl'")
        flat = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
        t = {**flat, **(hf.get("text_config") or {})}
        rp = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
        mrope = tuple(rp.pop("mrope_section", (16, 24, 24)))
        rp.setdefault("rope_theta", t.get("rope_theta", 1e6))
        if rp.get("rope_type", rp.get("type", "default")) in ("mrope", "default", None):
            rp = {"rope_type": "default", "rope_theta": rp["rope_theta"]}
        t = {k: v for k, v in t.items() if k != "rope_scaling"}
        text = LMConfig.from_hf({**t, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                 "rope_parameters": rp})
        text = text.replace(rope=dataclasses.replace(text.rope, mrope_section=mrope), qkv_bias=True)
        v = hf["vision_config"]
        vision = Qwen25VisionConfig(
            depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
            num_heads=v["num_heads"], out_hidden_size=v.get("out_hidden_size", text.d_model),
            patch_size=v.get("patch_size", v.get("spatial_patch_size", 14)),
            temporal_patch_size=v.get("temporal_patch_size", 2), spatial_merge_size=v.get("spatial_merge_size", 2),
            window_size=v.get("window_size", 112), fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", ())),
            in_channels=v.get("in_channels", v.get("in_chans", 3)), hidden_act=v.get("hidden_act", "silu"),
            rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
        ids = {k: int(hf[k]) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                       "vision_end_token_id") if hf.get(k) is not None}
        return cls(text=text, vision=vision, tokens_per_second=v.get("tokens_per_second", 4), **ids)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "text": self.text.to_json()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Qwen25VLConfig:
        v = dict(d["vision"])
        v["fullatt_block_indexes"] = tuple(v.get("fullatt_block_indexes", ()))
        return cls(**{**d, "text": LMConfig.from_json(d["text"]), "vision": Qwen25VisionConfig(**v)})


# ------------------------------------------------------------------------------------------- pure functions


def _embed(cfg: Qwen25VLConfig, params: dict, ids, pixels, lay, src) -> Float[Array, "B T D"]:
    """Token embeddings with the vision features put where `src` >= 0 (src: index into the features)."""
    emb = serving_lm.embed_tokens(cfg.text, params["lm"]["embed"], ids)
    if pixels is None:
        return emb
    feats = qwen25_vision.forward(cfg.vision, params["vision"], pixels, lay).astype(emb.dtype)
    return jnp.where((src >= 0)[..., None], jnp.take(feats, jnp.maximum(src, 0), axis=0), emb)


@functools.partial(jax.jit, static_argnums=0)
def _embed_jit(cfg, params, ids, pixels, lay, src):
    return _embed(cfg, params, ids, pixels, lay, src)


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg: Qwen25VLConfig, params, ids, pixels, lay, src, positions, valid, serving=None
            ) -> Float[Array, "B T V"]:
    serving = serving_lm.serving_params(cfg.text, params["lm"]) if serving is None else serving
    t = ids.shape[1]
    # A query sees the earlier kept tokens and always itself (so a padding query stays finite).
    mask = (jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]) | jnp.eye(t, dtype=bool)[None]
    hidden, _ = serving.forward(None, positions, mask, embeddings=_embed(cfg, params, ids, pixels, lay, src))
    return serving.head(hidden).astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=(0, 9))
def _generate(cfg: Qwen25VLConfig, params, ids, pixels, lay, src, positions, valid, deltas, n_new: int,
              serving=None) -> Int[Array, "B n_new"]:
    """Greedy: a prefill of the prompt into a KV cache of T + n_new slots, then n_new - 1 one-token steps."""
    serving = serving_lm.serving_params(cfg.text, params["lm"]) if serving is None else serving
    b, t = ids.shape
    s = t + n_new
    cache = serving.init_cache(b, s)
    slot = jnp.arange(s, dtype=jnp.int32)
    valid_s = jnp.concatenate([valid, jnp.ones((b, n_new), bool)], axis=1)  # [B, S]
    q = jnp.arange(t, dtype=jnp.int32)
    mask = ((slot[None, None, :] <= q[None, :, None]) & valid_s[:, None, :]) | (slot[None, None, :] == q[None, :, None])
    hidden, cache = serving.forward(None, positions, mask, cache, jnp.zeros((b,), jnp.int32),
                                    embeddings=_embed(cfg, params, ids, pixels, lay, src))
    last = t - 1 - jnp.argmax(valid[:, ::-1], axis=1)  # the last kept token (left or right padding)
    h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)
    tok = jnp.argmax(serving.head(h_last)[:, -1], axis=-1).astype(jnp.int32)
    # After the prompt all three M-RoPE streams advance together: plain RoPE at (kept tokens so far) + delta.
    base = jnp.sum(valid, axis=1, dtype=jnp.int32) + deltas

    def step(k, carry):
        out, tok, cache = carry
        mask = (slot[None, None, :] <= t + k) & valid_s[:, None, :]
        hidden, cache = serving.forward(tok[:, None], (base + k)[:, None], mask, cache,
                                        jnp.full((b,), t + k, jnp.int32))
        tok = jnp.argmax(serving.head(hidden)[:, -1], axis=-1).astype(jnp.int32)
        return out.at[:, k + 1].set(tok), tok, cache

    out = jnp.zeros((b, n_new), jnp.int32).at[:, 0].set(tok)
    out, _, _ = jax.lax.fori_loop(0, n_new - 1, step, (out, tok, cache))
    return out


# ---------------------------------------------------------------------------------------------------- model


class Qwen25VL(nnx.Module):
    """Qwen2.5-VL: `lm` (a `Decoder`) and `vision` (the tower). Calls take what transformers' processor makes."""

    def __init__(self, cfg: Qwen25VLConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.lm = Decoder(cfg.text, rngs=rngs)
        self.vision = Qwen25Vision(cfg.vision, rngs=rngs)

    def params(self) -> dict:
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))

    def _prepare(self, *args) -> dict:
        return prepare(self.cfg, *args)

    def embed(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None,
              pixel_values_videos=None, video_grid_thw=None, second_per_grid_ts=None, **unexpected
              ) -> tuple[Float[Array, "B T D"], Int[Array, "B T 3"], Int[Array, " B"]]:
        """The prefill inputs: embeddings with the vision features spliced in, M-RoPE positions [B, T, 3], and
        the deltas: decode step k after the prompt sits at 1-D position (kept prompt tokens + k) + deltas[b]."""
        x = self._prepare(input_ids, attention_mask, pixel_values, image_grid_thw, pixel_values_videos,
                          video_grid_thw, second_per_grid_ts, unexpected)
        emb = _embed_jit(self.cfg, self.params(), x["ids"], x["pixels"], x["lay"], x["src"])
        return emb, jnp.asarray(x["positions"]), jnp.asarray(x["deltas"])

    def __call__(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None,
                 pixel_values_videos=None, video_grid_thw=None, second_per_grid_ts=None, serving=None, **unexpected
                 ) -> Float[Array, "B T V"]:
        """Float32 logits [B, T, V] of every position (those at padding are unspecified). `serving`: the language
        model's serving form, if already built (`VisionLM`), else it is fused from `lm` inside the call."""
        x = self._prepare(input_ids, attention_mask, pixel_values, image_grid_thw, pixel_values_videos,
                          video_grid_thw, second_per_grid_ts, unexpected)
        serving_lm.prepare_matmul(self.cfg.text)
        return _logits(self.cfg, self.params(), x["ids"], x["pixels"], x["lay"], x["src"], x["positions"],
                       x["valid"], serving=serving)

    def generate(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None,
                 pixel_values_videos=None, video_grid_thw=None, second_per_grid_ts=None, *,
                 max_new_tokens: int = 32, serving=None, **unexpected) -> np.ndarray:
        """Greedy continuation [B, max_new_tokens] (no stop tokens), compiled once per input shapes; `serving` as
        `__call__`."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        x = self._prepare(input_ids, attention_mask, pixel_values, image_grid_thw, pixel_values_videos,
                          video_grid_thw, second_per_grid_ts, unexpected)
        serving_lm.prepare_matmul(self.cfg.text)
        out = _generate(self.cfg, self.params(), x["ids"], x["pixels"], x["lay"], x["src"], x["positions"],
                        x["valid"], x["deltas"], int(max_new_tokens), serving=serving)
        return np.asarray(out)
