"""The SigLIP vision tower (transformers' `SiglipVisionModel`) in Flax NNX, encoder layers stacked on a leading axis.

Parameter tree (`nnx.to_pure_dict(nnx.state(tower, nnx.Param))`; Dv the tower's width, Fv its MLP width,
C channels, p the patch side, P = (image_size / p)^2 patches)::

    patch_embed: [C, p, p, Dv]    patch_bias: [Dv]    pos_embed: [P, Dv]
    blocks/ln1_scale, ln1_bias, ln2_scale, ln2_bias: [L, Dv]
    blocks/wq, wk, wv, wo: [L, Dv, Dv]   (heads fused: column n*H + h)    blocks/bq, bk, bv, bo: [L, Dv]
    blocks/w_fc1: [L, Dv, Fv]   blocks/b_fc1: [L, Fv]   blocks/w_fc2: [L, Fv, Dv]   blocks/b_fc2: [L, Dv]

The pooling head and `post_layernorm` are not here: LLaVA reads `hidden_states[i]`, which SigLIP records before
its final norm (`capture_outputs(tie_last_hidden_states=False)`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Annotated, Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from configs.schema import POSITIVE, Range
from configs.sharding import shard
from sage_jax.models.decoder import param

#: transformers' ACT2FN names -> jax (the tanh approximation is `gelu_pytorch_tanh` / `gelu_new`).
ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SiglipConfig:
    """A SigLIP vision tower. `num_layers` counts the layers kept (LLaVA-OneVision keeps 26 of so400m's 27)."""

    hidden_size: Annotated[int, POSITIVE]
    intermediate_size: Annotated[int, POSITIVE]
    num_layers: Annotated[int, POSITIVE]
    num_heads: Annotated[int, POSITIVE]
    image_size: Annotated[int, POSITIVE]
    patch_size: Annotated[int, POSITIVE]
    num_channels: Annotated[int, POSITIVE] = 3
    norm_eps: Annotated[float, Range(0.0)] = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    param_dtype: str = "float32"
    dtype: str = "float32"

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")
        if self.image_size < self.patch_size:
            raise ValueError(f"image_size={self.image_size} is smaller than patch_size={self.patch_size}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; expected one of {sorted(ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid(self) -> int:
        """Patches per side of one tile (a "valid" convolution: so400m's 384 pixels give 27 patches of 14)."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid**2

    def replace(self, **kw) -> SiglipConfig:
        return dataclasses.replace(self, **kw)

    @classmethod
    def so400m_patch14_384(cls, num_layers: int = 27) -> SiglipConfig:
        return cls(hidden_size=1152, intermediate_size=4304, num_layers=num_layers, num_heads=16, image_size=384,
                   patch_size=14)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> SiglipConfig:
        """From a `SiglipVisionConfig` dict; missing keys take transformers' SigLIP defaults."""
        return cls(hidden_size=hf.get("hidden_size", 768), intermediate_size=hf.get("intermediate_size", 3072),
                   num_layers=hf.get("num_hidden_layers", 12), num_heads=hf.get("num_attention_heads", 12),
                   image_size=hf.get("image_size", 224), patch_size=hf.get("patch_size", 16),
                   num_channels=hf.get("num_channels", 3), norm_eps=float(hf.get("layer_norm_eps", 1e-6)),
                   hidden_act=hf.get("hidden_act", "gelu_pytorch_tanh"))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SiglipConfig:
        return cls(**d)


class SiglipBlocks(nnx.Module):
    """The L encoder layers, every parameter stacked on a leading layer axis."""

    def __init__(self, cfg: SiglipConfig, *, rngs: nnx.Rngs):
        L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        dt = jnp.dtype(cfg.param_dtype)
        ones, zeros = nnx.initializers.ones, nnx.initializers.zeros
        for n in ("ln1", "ln2"):
            setattr(self, f"{n}_scale", param(rngs, (L, D), ("layers", None), dt, ones))
            setattr(self, f"{n}_bias", param(rngs, (L, D), ("layers", None), dt, zeros))
        for n in ("q", "k", "v", "o"):
            setattr(self, f"w{n}", param(rngs, (L, D, D), ("layers", None, None), dt))
            setattr(self, f"b{n}", param(rngs, (L, D), ("layers", None), dt, zeros))
        self.w_fc1 = param(rngs, (L, D, F), ("layers", None, "mlp"), dt)
        self.b_fc1 = param(rngs, (L, F), ("layers", "mlp"), dt, zeros)
        self.w_fc2 = param(rngs, (L, F, D), ("layers", "mlp", None), dt)
        self.b_fc2 = param(rngs, (L, D), ("layers", None), dt, zeros)


class SiglipVision(nnx.Module):
    """Patch embedding + learned positions + pre-norm encoder layers; see `hidden_states`."""

    def __init__(self, cfg: SiglipConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, p, C = cfg.hidden_size, cfg.patch_size, cfg.num_channels
        dt = jnp.dtype(cfg.param_dtype)
        self.patch_embed = param(rngs, (C, p, p, D), (None, None, None, None), dt)
        self.patch_bias = param(rngs, (D,), (None,), dt, nnx.initializers.zeros)
        self.pos_embed = param(rngs, (cfg.num_patches, D), (None, None), dt)
        self.blocks = SiglipBlocks(cfg, rngs=rngs)

    def __call__(self, pixels, layers=(-1,)):
        return hidden_states(self.cfg, nnx.to_pure_dict(nnx.state(self, nnx.Param)), pixels, layers)


def layer_norm(x: Float[Array, "... D"], scale: Float[Array, " D"], bias: Float[Array, " D"], eps: float
               ) -> Float[Array, "... D"]:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    lead = (1,) * (x.ndim - 1)
    return (y * scale.astype(jnp.float32).reshape(*lead, -1) + bias.astype(jnp.float32).reshape(*lead, -1)
            ).astype(x.dtype)


def _block(cfg: SiglipConfig, p: dict, x: Float[Array, "M P D"]) -> Float[Array, "M P D"]:
    dt = jnp.dtype(cfg.dtype)
    m, n_p, d = x.shape
    n, h = cfg.num_heads, cfg.head_dim

    def linear(y, w, b):
        return jnp.einsum("MPD,DE->MPE", y, w.astype(dt)) + b.astype(dt)[None, None]

    y = layer_norm(x, p["ln1_scale"], p["ln1_bias"], cfg.norm_eps)
    q, k, v = (linear(y, p[f"w{c}"], p[f"b{c}"]).reshape(m, n_p, n, h) for c in "qkv")
    s = jnp.einsum("MPNH,MQNH->MNPQ", q, k, preferred_element_type=jnp.float32) * (h**-0.5)
    a = jax.nn.softmax(s, axis=-1).astype(dt)  # bidirectional: every patch sees every patch of its tile
    o = jnp.einsum("MNPQ,MQNH->MPNH", a, v).reshape(m, n_p, d)
    x = x + linear(o, p["wo"], p["bo"])
    y = layer_norm(x, p["ln2_scale"], p["ln2_bias"], cfg.norm_eps)
    y = linear(ACTIVATIONS[cfg.hidden_act](linear(y, p["w_fc1"], p["b_fc1"])), p["w_fc2"], p["b_fc2"])
    return shard(x + y, ("batch", None, None))


def embed_patches(cfg: SiglipConfig, params: dict, pixels: Float[Array, "M C Y X"]) -> Float[Array, "M P D"]:
    """The stride-p, kernel-p convolution as one matmul over non-overlapping patches (row-major, as Conv2d's
    `flatten(2)`), plus the learned positions. Tiles have the trained size, so no position interpolation."""
    m, c, y, x = pixels.shape
    pp, g = cfg.patch_size, cfg.grid
    if (c, y, x) != (cfg.num_channels, cfg.image_size, cfg.image_size):
        raise ValueError(f"pixels have shape [{c}, {y}, {x}] per tile, the tower expects "
                         f"[{cfg.num_channels}, {cfg.image_size}, {cfg.image_size}]")
    dt = jnp.dtype(cfg.dtype)
    n = g * pp  # the last image_size % p pixels fall outside every patch
    patches = pixels[:, :, :n, :n].astype(dt).reshape(m, c, g, pp, g, pp)
    e = jnp.einsum("MCiyjx,CyxD->MijD", patches, params["patch_embed"].astype(dt)).reshape(m, g * g, -1)
    return e + params["patch_bias"].astype(dt)[None, None] + params["pos_embed"].astype(dt)[None]


def hidden_states(cfg: SiglipConfig, params: dict, pixels: Float[Array, "M C Y X"], layers=(-1,)
                  ) -> list[Float[Array, "M P D"]]:
    """transformers' `hidden_states[i]` for each i of `layers`: i = 0 the embeddings, i = l the output of layer l,
    negative i counted from L + 1 (so -1 is the last layer, before `post_layernorm`). Runs only the layers the
    deepest requested state needs, as scans between the requested depths."""
    n = cfg.num_layers
    depths = [i % (n + 1) if -(n + 1) <= i <= n else None for i in layers]
    if None in depths:
        raise ValueError(f"vision_feature_layer {tuple(layers)} out of range for a {n}-layer tower")
    blocks = params["blocks"]
    x = embed_patches(cfg, params, pixels)
    states = {0: x}
    done = 0
    for depth in sorted(set(depths)):
        if depth > done:
            seg = {k: v[done:depth] for k, v in blocks.items()}
            x, _ = jax.lax.scan(lambda h, p: (_block(cfg, p, h), None), x, seg)
            done = depth
        states[depth] = x
    return [states[d] for d in depths]
