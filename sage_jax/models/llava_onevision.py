"""LLaVA-OneVision (transformers' `LlavaOnevisionForConditionalGeneration`) in Flax NNX: a SigLIP tower, a 2-layer
MLP projector and our Qwen2 `Decoder`, fed the token embeddings with image / video features spliced in at the
`<image>` / `<video>` placeholders.

Parameter tree (`nnx.to_pure_dict(nnx.state(model, nnx.Param))`, the checkpoint layout)::

    lm:            the `Decoder` tree (embed, blocks/*, final_norm, lm_head)
    vision:        the `SiglipVision` tree (patch_embed, patch_bias, pos_embed, blocks/*)
    projector/w1:  [Dv * len(vision_feature_layer), D]   projector/b1: [D]
    projector/w2:  [D, D]                                projector/b2: [D]   (biases only with projector_bias)
    image_newline: [D]

Every shape (tiles per image, grid, unpadding crop, anyres_max downscale, feature counts) is decided on host from
`image_sizes` (`models/anyres.py`); per call shape, one jitted pure function over the parameter dict runs the tower,
the projector, the packing and the LM. Input helpers (`expand_placeholders`, `video_inputs`) live in
`models/llava_inputs.py`.
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

from sage_jax.models import anyres, serving_lm
from sage_jax.models.config import LMConfig, RopeConfig
from sage_jax.models.decoder import Decoder, param
from sage_jax.models.llava_inputs import expand_placeholders, prepare, video_inputs
from sage_jax.models.siglip import ACTIVATIONS, SiglipConfig, SiglipVision, hidden_states

__all__ = ["LlavaOnevision", "LlavaOnevisionConfig", "expand_placeholders", "video_inputs"]

#: The hub checkpoints' `image_grid_pinpoints`: every (h, w) in 384 * {1..6} x 384 * {1..6}.
PINPOINTS_384 = tuple((384 * i, 384 * j) for i in range(1, 7) for j in range(1, 7))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlavaOnevisionConfig:
    """LLaVA-OneVision: the LM, the vision tower, and how image features are selected, laid out and projected."""

    text: LMConfig
    vision: SiglipConfig
    image_token_id: int = 151646
    video_token_id: int | None = 151647  # None: an image-only model
    vision_feature_layer: int | tuple[int, ...] = -1
    vision_feature_select_strategy: str = "full"  # "default" drops each tile's first token
    image_grid_pinpoints: tuple[tuple[int, int], ...] = PINPOINTS_384
    vision_aspect_ratio: str = "anyres_max_9"
    projector_act: str = "gelu"
    projector_bias: bool = True

    def __post_init__(self):
        if self.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', got "
                             f"{self.vision_feature_select_strategy!r}")
        if self.projector_act not in ACTIVATIONS:
            raise ValueError(f"unsupported projector_act {self.projector_act!r}")
        layer = self.vision_feature_layer
        object.__setattr__(self, "vision_feature_layer", layer if isinstance(layer, int) else tuple(layer))
        object.__setattr__(self, "image_grid_pinpoints", tuple(tuple(int(v) for v in p)
                                                               for p in self.image_grid_pinpoints))
        anyres.max_tiles(self.vision_aspect_ratio)  # a clear error now rather than at the first image

    @property
    def feature_layers(self) -> tuple[int, ...]:
        layer = self.vision_feature_layer
        return (layer,) if isinstance(layer, int) else layer

    @property
    def base_tokens(self) -> int:
        """Tokens one tile gives after the select strategy."""
        return self.vision.num_patches - (self.vision_feature_select_strategy == "default")

    def replace(self, **kw) -> LlavaOnevisionConfig:
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlavaOnevisionConfig:
        """From a transformers `config.json` dict of a `llava_onevision` model."""
        if hf.get("model_type") != "llava_onevision":
            raise ValueError(f"expected a llava_onevision config, got model_type {hf.get('model_type')!r}")
        text_hf = dict(hf.get("text_config") or {"model_type": "qwen2"})
        text_hf.setdefault("model_type", "qwen2")
        text = LMConfig.from_hf(text_hf)
        tie = hf.get("tie_word_embeddings") or text_hf.get("tie_word_embeddings", False)
        vision_hf = hf.get("vision_config")
        vision = (SiglipConfig.from_hf(vision_hf) if vision_hf is not None
                  else SiglipConfig.so400m_patch14_384(num_layers=26))
        pinpoints = hf.get("image_grid_pinpoints") or PINPOINTS_384
        return cls(
            text=text.replace(tie_embeddings=bool(tie)), vision=vision,
            image_token_id=int(hf.get("image_token_index", hf.get("image_token_id", 151646))),
            video_token_id=int(hf.get("video_token_index", hf.get("video_token_id", 151647))),
            vision_feature_layer=hf.get("vision_feature_layer", -1),
            vision_feature_select_strategy=hf.get("vision_feature_select_strategy", "full"),
            image_grid_pinpoints=pinpoints, vision_aspect_ratio=hf.get("vision_aspect_ratio", "anyres_max_9"),
            projector_act=hf.get("projector_hidden_act", "gelu"),
            projector_bias=bool(hf.get("multimodal_projector_bias", True)))

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["text"], d["vision"] = self.text.to_json(), self.vision.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LlavaOnevisionConfig:
        d = dict(d)
        d["text"], d["vision"] = LMConfig.from_json(d["text"]), SiglipConfig.from_json(d["vision"])
        return cls(**d)

    # ---------------------------------------------------------------- presets

    @classmethod
    def _qwen2(cls, **kw) -> LMConfig:
        return LMConfig(vocab_size=152128, head_dim=128, rope=RopeConfig(theta=1e6), norm_eps=1e-6, qkv_bias=True,
                        tie_embeddings=False, eos_token_ids=(151645,), pad_token_id=151643, max_position=32768, **kw)

    @classmethod
    def llava_ov_7b(cls) -> LlavaOnevisionConfig:
        """llava-hf/llava-onevision-qwen2-7b-ov-hf: Qwen2-7B + SigLIP so400m (26 of 27 layers)."""
        text = cls._qwen2(d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, mlp_dim=18944)
        return cls(text=text, vision=SiglipConfig.so400m_patch14_384(num_layers=26))

    @classmethod
    def llava_ov_72b(cls) -> LlavaOnevisionConfig:
        """llava-hf/llava-onevision-qwen2-72b-ov-hf: Qwen2-72B + SigLIP so400m (26 of 27 layers)."""
        text = cls._qwen2(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, mlp_dim=29568)
        return cls(text=text, vision=SiglipConfig.so400m_patch14_384(num_layers=26))

    @classmethod
    def tiny(cls, **kw) -> LlavaOnevisionConfig:
        """A test model: 2-layer LM of width 64, 2-layer SigLIP of width 32 on 28-pixel tiles of 2x2 patches."""
        base = dict(
            text=LMConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128,
                          rope=RopeConfig(theta=1e6), qkv_bias=True, tie_embeddings=False, eos_token_ids=(2,),
                          pad_token_id=0, max_position=512),
            vision=SiglipConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, image_size=28,
                                patch_size=14),
            image_token_id=500, video_token_id=501, image_grid_pinpoints=((28, 28), (28, 56), (56, 28), (56, 56)))
        return cls(**{**base, **kw})


class Projector(nnx.Module):
    """linear_1 -> act -> linear_2 (transformers' `LlavaOnevisionMultiModalProjector`)."""

    def __init__(self, cfg: LlavaOnevisionConfig, *, rngs: nnx.Rngs):
        d_in, d = cfg.vision.hidden_size * len(cfg.feature_layers), cfg.text.d_model
        dt = jnp.dtype(cfg.text.param_dtype)
        self.w1 = param(rngs, (d_in, d), (None, "embed"), dt)
        self.w2 = param(rngs, (d, d), (None, "embed"), dt)
        if cfg.projector_bias:
            self.b1 = param(rngs, (d,), ("embed",), dt, nnx.initializers.zeros)
            self.b2 = param(rngs, (d,), ("embed",), dt, nnx.initializers.zeros)


class LlavaOnevision(nnx.Module):
    """`model(**processor_outputs) -> logits`, `embed(...)` (the prefill input), `generate(...)` (greedy)."""

    def __init__(self, cfg: LlavaOnevisionConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.lm = Decoder(cfg.text, rngs=rngs)
        self.vision = SiglipVision(cfg.vision, rngs=rngs)
        self.projector = Projector(cfg, rngs=rngs)
        d = cfg.text.d_model
        self.image_newline = nnx.Param(nnx.initializers.normal(d**-0.5)(rngs.params(), (d,),
                                                                        jnp.dtype(cfg.text.param_dtype)),
                                       axes=("embed",))

    def params(self) -> dict:
        """The parameter tree (module docstring) as a pure dict of arrays."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))

    def embed(self, input_ids, attention_mask=None, pixel_values=None, image_sizes=None, pixel_values_videos=None,
              **kw) -> tuple[Float[Array, "B T D"], Int[Array, "B T"]]:
        """The LM's input: token embeddings with the image / video features spliced in, and the positions (kept
        tokens counted, as transformers' `generate`). Same keywords as `__call__`."""
        b = prepare(self.cfg, input_ids, attention_mask, pixel_values, image_sizes, pixel_values_videos, kw)
        return _embed_jit(self.cfg, b.plan, self.params(), *b.arrays()), jnp.asarray(b.positions)

    def __call__(self, input_ids, attention_mask=None, pixel_values=None, image_sizes=None,
                 pixel_values_videos=None, serving=None, **kw) -> Float[Array, "B T V"]:
        """Float32 logits [B, T, V] of every position, from what the transformers processor returns: input_ids
        [B, T] with each `<image>` / `<video>` already repeated per feature, attention_mask [B, T] (left or right
        padding), pixel_values [N, tiles, 3, S, S] (or [sum of tiles, 3, S, S]), image_sizes [N, 2] (h, w),
        pixel_values_videos [Nv, F, 3, S, S], batch_num_images. Logits at padding positions are unspecified.
        `serving`: the language model's serving form, if already built (`VisionLM`), else fused inside the call."""
        b = prepare(self.cfg, input_ids, attention_mask, pixel_values, image_sizes, pixel_values_videos, kw)
        serving_lm.prepare_matmul(self.cfg.text)
        return _logits(self.cfg, b.plan, self.params(), *b.arrays(), jnp.asarray(b.valid), jnp.asarray(b.positions),
                       serving=serving)

    def generate(self, input_ids, attention_mask=None, pixel_values=None, image_sizes=None,
                 pixel_values_videos=None, *, max_new_tokens: int = 32, serving=None, **kw) -> np.ndarray:
        """Greedy continuation [B, max_new_tokens] with a KV cache (exactly max_new_tokens: no stop at EOS);
        `serving` as `__call__`."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        b = prepare(self.cfg, input_ids, attention_mask, pixel_values, image_sizes, pixel_values_videos, kw)
        serving_lm.prepare_matmul(self.cfg.text)
        out = generate_tokens(self.cfg, b.plan, max_new_tokens, self.params(), *b.arrays(), jnp.asarray(b.valid),
                              jnp.asarray(b.positions), serving=serving)
        return np.asarray(out)


# ----------------------------------------------------------------------------------------------- device functions


def _tile_features(cfg: LlavaOnevisionConfig, params: dict, pixels: Float[Array, "M C S S"]
                   ) -> Float[Array, "M P D"]:
    """Selected hidden states of each tile (concatenated over feature layers), projected to the LM width."""
    states = hidden_states(cfg.vision, params["vision"], pixels, cfg.feature_layers)
    x = states[0] if len(states) == 1 else jnp.concatenate(states, axis=-1)
    if cfg.vision_feature_select_strategy == "default":
        x = x[:, 1:]
    p, dt = params["projector"], jnp.dtype(cfg.text.dtype)

    def linear(y, w, bias):
        y = jnp.einsum("MPE,ED->MPD", y.astype(dt), p[w].astype(dt))
        return y + p[bias].astype(dt)[None, None] if bias in p else y

    return linear(ACTIVATIONS[cfg.projector_act](linear(x, "w1", "b1")), "w2", "b2")


def _resize(x: Float[Array, "Y X D"], out_hw: tuple[int, int]) -> Float[Array, "Y2 X2 D"]:
    """torch bilinear interpolation (align_corners=False) to `out_hw`, as two static matmuls."""
    wy = jnp.asarray(anyres.bilinear_matrix(x.shape[0], out_hw[0]))
    wx = jnp.asarray(anyres.bilinear_matrix(x.shape[1], out_hw[1]))
    hi = jax.lax.Precision.HIGHEST
    return jnp.einsum("oy,px,yxD->opD", wy, wx, x.astype(jnp.float32), precision=hi).astype(x.dtype)


def _image_features(cfg: LlavaOnevisionConfig, layouts, params: dict, tiles: Float[Array, "M C S S"]
                    ) -> Float[Array, "F D"]:
    """transformers' `pack_image_features`, with every shape static (`anyres.ImageLayout`)."""
    feats = _tile_features(cfg, params, tiles)
    newline = params["image_newline"].astype(feats.dtype)
    g, d = cfg.vision.grid, feats.shape[-1]
    out, start = [], 0
    for lay in layouts:
        f = feats[start: start + lay.tiles]
        start += lay.tiles
        if lay.rows == 0:
            out += [f[0], newline[None]]
            continue
        grid = f[1:].reshape(lay.rows, lay.cols, g, g, d).transpose(0, 2, 1, 3, 4).reshape(lay.rows * g, -1, d)
        top, bottom, left, right = lay.crop
        grid = grid[top:bottom, left:right]
        if lay.resized:
            grid = _resize(grid, lay.out_hw)
        h, w = lay.out_hw
        grid = jnp.concatenate([grid, jnp.broadcast_to(newline[None, None], (h, 1, d))], axis=1)
        out += [f[0], grid.reshape(h * (w + 1), d)]
    return jnp.concatenate(out, axis=0)


def _video_features(cfg: LlavaOnevisionConfig, n_videos: int, params: dict, frames: Float[Array, "M C S S"]
                    ) -> Float[Array, "F D"]:
    """transformers' `get_video_features`: frames projected, pooled 2x bilinearly, one newline per video."""
    feats = _tile_features(cfg, params, frames)
    g, d = cfg.vision.grid, feats.shape[-1]
    side = anyres.pooled_side(g)
    pooled = jax.vmap(lambda x: _resize(x, (side, side)))(feats.reshape(-1, g, g, d))
    pooled = pooled.reshape(n_videos, -1, d)
    newline = jnp.broadcast_to(params["image_newline"].astype(feats.dtype)[None, None], (n_videos, 1, d))
    return jnp.concatenate([pooled, newline], axis=1).reshape(-1, d)


def embed_inputs(cfg, plan, params, tokens, tiles, frames, image_slots, video_slots) -> Float[Array, "B T D"]:
    """The language model's input embeddings [B, T, D]: token embeddings with the visual features written into
    `image_slots` / `video_slots` (flat indices into B·T) in `plan`'s order. Pure: training jits it inside its
    step."""
    x = serving_lm.embed_tokens(cfg.text, params["lm"]["embed"], tokens)
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    if plan.images:
        flat = flat.at[image_slots].set(_image_features(cfg, plan.images, params, tiles).astype(flat.dtype))
    if plan.videos:
        flat = flat.at[video_slots].set(_video_features(cfg, plan.videos, params, frames).astype(flat.dtype))
    return flat.reshape(b, t, d)


_embed_jit = jax.jit(embed_inputs, static_argnums=(0, 1))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _logits(cfg, plan, params, tokens, tiles, frames, image_slots, video_slots, valid, positions, serving=None):
    x = embed_inputs(cfg, plan, params, tokens, tiles, frames, image_slots, video_slots)
    model = serving_lm.serving_params(cfg.text, params["lm"]) if serving is None else serving
    t = tokens.shape[1]
    # A query sees the earlier kept tokens, and always itself (so a padding query stays finite).
    mask = (jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]) | jnp.eye(t, dtype=bool)[None]
    hidden, _ = model.forward(None, positions, mask, embeddings=x)
    return model.head(hidden).astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def generate_tokens(cfg, plan, max_new, params, tokens, tiles, frames, image_slots, video_slots, valid, positions,
                    serving=None):
    """Greedy continuation [B, max_new] of left-padded prompts (`valid` [B, T], `positions` [B, T]); jitted once
    per (config, plan, max_new). `serving`: the language model's serving form, else fused from params["lm"]."""
    x = embed_inputs(cfg, plan, params, tokens, tiles, frames, image_slots, video_slots)
    model = serving_lm.serving_params(cfg.text, params["lm"]) if serving is None else serving
    b, t = tokens.shape
    s = t + max_new
    slots = jnp.arange(s, dtype=jnp.int32)
    prompt = jnp.concatenate([valid, jnp.zeros((b, max_new), bool)], axis=1)  # [B, S]: kept prompt slots
    q = jnp.arange(t, dtype=jnp.int32)
    causal = slots[None, None, :] <= q[None, :, None]
    mask = (causal & prompt[:, None, :]) | (slots[None, None, :] == q[None, :, None])  # a padding query sees itself
    hidden, cache = model.forward(None, positions, mask, model.init_cache(b, s), jnp.zeros((b,), jnp.int32),
                                  embeddings=x)
    first = jnp.argmax(model.head(hidden[:, -1:])[:, 0], axis=-1).astype(jnp.int32)
    n_kept = valid.sum(axis=1).astype(jnp.int32)

    def step(i, carry):
        cache, tok, out = carry
        out = out.at[:, i].set(tok)
        seen = prompt | ((slots >= t) & (slots <= t + i))[None]
        h, cache = model.forward(tok[:, None], (n_kept + i)[:, None], seen[:, None, :], cache,
                                 jnp.full((b,), t + i, jnp.int32))
        return cache, jnp.argmax(model.head(h)[:, 0], axis=-1).astype(jnp.int32), out

    out = jnp.zeros((b, max_new), jnp.int32)
    _, last, out = jax.lax.fori_loop(0, max_new - 1, step, (cache, first, out))
    return out.at[:, max_new - 1].set(last)
