"""The paper's noise-prediction U-Net (lucidrains `denoising-diffusion-pytorch` lineage) in Flax NNX.

Structure as in `noisePredictModels/Unet/UNet.py`: a 1×1 init conv; per level two ResNet blocks (weight-standardised
3×3 conv → GroupNorm → time scale/shift → SiLU, twice), a residual pre-norm *linear* attention and a space-to-depth
downsample (a 3×3 conv at the last level); in the middle ResNet → full attention → ResNet; the way up mirrors it
with skip concatenation and nearest ×2 upsampling; a final ResNet block on [x, init features] and a 1×1 conv.
Time: sinusoidal(width) → Linear(4·width) → GELU → Linear.

`dims=1` is the same network over a [L, C] signal (p-diff-style 1-D diffusion of the flat gradient). Activations
name logical axes only (`configs/sharding.py`): the batch axis is data-parallel.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from configs import sharding
from pgla_jax.config import UNetConfig


def _ws_conv(lhs, rhs, *args, **kwargs):
    # Weight standardisation (zero mean, unit variance per output channel) keeps GroupNorm'd activations well scaled
    # with small batches, the reason the lucidrains U-Net uses it. Kernel layout: spatial..., in, out.
    axes = tuple(range(rhs.ndim - 1))
    mean = rhs.mean(axis=axes, keepdims=True)
    var = rhs.var(axis=axes, keepdims=True)
    return jax.lax.conv_general_dilated(lhs, (rhs - mean) * jax.lax.rsqrt(var + 1e-5), *args, **kwargs)


def _conv(cin: int, cout: int, k: int, dims: int, rngs: nnx.Rngs, *, ws: bool = False, bias: bool = True):
    kw = {"conv_general_dilated": _ws_conv} if ws else {}
    return nnx.Conv(cin, cout, (k,) * dims, padding="SAME", use_bias=bias, rngs=rngs, **kw)


def sinusoidal(t: Float[Array, " B"], dim: int) -> Float[Array, "B D"]:
    half = dim // 2
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half) / (half - 1))
    args = t.astype(jnp.float32)[:, None] * freqs[None]
    return jnp.concatenate([jnp.sin(args), jnp.cos(args)], axis=-1)


class Block(nnx.Module):
    def __init__(self, cin: int, cout: int, groups: int, dims: int, *, rngs: nnx.Rngs):
        self.proj = _conv(cin, cout, 3, dims, rngs, ws=True)
        self.norm = nnx.GroupNorm(cout, num_groups=groups, rngs=rngs)

    def __call__(self, x, scale_shift=None):
        x = self.norm(self.proj(x))
        if scale_shift is not None:
            scale, shift = scale_shift
            x = x * (scale + 1.0) + shift
        return jax.nn.silu(x)


class ResnetBlock(nnx.Module):
    def __init__(self, cin: int, cout: int, time_dim: int, groups: int, dims: int, *, rngs: nnx.Rngs):
        self.mlp = nnx.Linear(time_dim, 2 * cout, rngs=rngs)
        self.block1 = Block(cin, cout, groups, dims, rngs=rngs)
        self.block2 = Block(cout, cout, groups, dims, rngs=rngs)
        self.res = _conv(cin, cout, 1, dims, rngs) if cin != cout else None

    def __call__(self, x: Float[Array, "B ... C"], temb: Float[Array, "B E"]) -> Float[Array, "B ... D"]:
        ss = self.mlp(jax.nn.silu(temb))
        ss = ss.reshape((ss.shape[0],) + (1,) * (x.ndim - 2) + (ss.shape[-1],))
        h = self.block1(x, tuple(jnp.split(ss, 2, axis=-1)))
        h = self.block2(h)
        return h + (x if self.res is None else self.res(x))


class LinearAttention(nnx.Module):
    """Linear attention (softmax over features for q, over positions for k): O(N) in the number of positions.
    Applied as Residual(PreNorm(·)) with a GroupNorm(1) pre-norm and a GroupNorm(1) after the output conv."""

    def __init__(self, dim: int, heads: int, head_dim: int, dims: int, *, rngs: nnx.Rngs):
        self.heads, self.head_dim = heads, head_dim
        self.prenorm = nnx.GroupNorm(dim, num_groups=1, rngs=rngs)
        self.qkv = _conv(dim, 3 * heads * head_dim, 1, dims, rngs, bias=False)
        self.out = _conv(heads * head_dim, dim, 1, dims, rngs)
        self.outnorm = nnx.GroupNorm(dim, num_groups=1, rngs=rngs)

    def __call__(self, x: Float[Array, "B ... C"]) -> Float[Array, "B ... C"]:
        b, spatial = x.shape[0], x.shape[1:-1]
        q, k, v = jnp.split(self.qkv(self.prenorm(x)).reshape(b, -1, 3, self.heads, self.head_dim), 3, axis=2)
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]  # [B, N, heads, d]
        q = jax.nn.softmax(q, axis=-1) * self.head_dim**-0.5
        k = jax.nn.softmax(k, axis=1)
        context = jnp.einsum("bnhd,bnhe->bhde", k, v)
        out = jnp.einsum("bhde,bnhd->bnhe", context, q).reshape(b, *spatial, self.heads * self.head_dim)
        return x + self.outnorm(self.out(out))


class Attention(nnx.Module):
    """Full softmax attention over all positions (the middle of the U-Net only), residual pre-norm."""

    def __init__(self, dim: int, heads: int, head_dim: int, dims: int, *, rngs: nnx.Rngs):
        self.heads, self.head_dim = heads, head_dim
        self.prenorm = nnx.GroupNorm(dim, num_groups=1, rngs=rngs)
        self.qkv = _conv(dim, 3 * heads * head_dim, 1, dims, rngs, bias=False)
        self.out = _conv(heads * head_dim, dim, 1, dims, rngs)

    def __call__(self, x: Float[Array, "B ... C"]) -> Float[Array, "B ... C"]:
        b, spatial = x.shape[0], x.shape[1:-1]
        qkv = self.qkv(self.prenorm(x)).reshape(b, -1, 3, self.heads, self.head_dim)
        out = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
        return x + self.out(out.reshape(b, *spatial, self.heads * self.head_dim))


class Downsample(nnx.Module):
    """Space-to-depth (each 2×2 — or 2 in 1-D — patch into channels), then a 1×1 conv: no information lost."""

    def __init__(self, cin: int, cout: int, dims: int, *, rngs: nnx.Rngs):
        self.dims = dims
        self.conv = _conv(cin * 2**dims, cout, 1, dims, rngs)

    def __call__(self, x):
        if self.dims == 1:
            b, n, c = x.shape
            x = x.reshape(b, n // 2, 2 * c)
        else:
            b, h, w, c = x.shape
            x = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, h // 2, w // 2, 4 * c)
        return self.conv(x)


class Upsample(nnx.Module):
    def __init__(self, cin: int, cout: int, dims: int, *, rngs: nnx.Rngs):
        self.conv = _conv(cin, cout, 3, dims, rngs)

    def __call__(self, x):
        for axis in range(1, x.ndim - 1):
            x = jnp.repeat(x, 2, axis=axis)
        return self.conv(x)


class Level(nnx.Module):
    def __init__(self, cin: int, cout: int, time_dim: int, cfg: UNetConfig, *, up: bool, last: bool, rngs: nnx.Rngs):
        d, g = cfg.dims, cfg.groups
        # Down: blocks work at cin and the resampler maps to cout. Up: blocks see [x, skip] and map to cout.
        width = cout if up else cin
        self.block1 = ResnetBlock(cout + cin if up else cin, width, time_dim, g, d, rngs=rngs)
        self.block2 = ResnetBlock(cout + cin if up else cin, width, time_dim, g, d, rngs=rngs)
        self.attn = LinearAttention(width, cfg.heads, cfg.head_dim, d, rngs=rngs)
        if last:
            self.resample = _conv(width, cin if up else cout, 3, d, rngs)
        elif up:
            self.resample = Upsample(width, cin, d, rngs=rngs)
        else:
            self.resample = Downsample(width, cout, d, rngs=rngs)


class UNet(nnx.Module):
    """ε̂(x_t, t[, cond]): input [B, *spatial, 1 + cond_channels] → [B, *spatial, 1]; spatial sides must be
    multiples of `cfg.multiple`."""

    def __init__(self, cfg: UNetConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        w, d = cfg.width, cfg.dims
        time_dim = 4 * w
        self.init_conv = _conv(1 + cfg.cond_channels, w, 1, d, rngs)
        self.time1 = nnx.Linear(w, time_dim, rngs=rngs)
        self.time2 = nnx.Linear(time_dim, time_dim, rngs=rngs)
        chans = [w] + [w * m for m in cfg.mults]
        in_out = list(zip(chans[:-1], chans[1:]))
        n = len(in_out)
        self.downs = nnx.List([Level(ci, co, time_dim, cfg, up=False, last=i == n - 1, rngs=rngs)
                               for i, (ci, co) in enumerate(in_out)])
        mid = chans[-1]
        self.mid1 = ResnetBlock(mid, mid, time_dim, cfg.groups, d, rngs=rngs)
        self.mid_attn = Attention(mid, cfg.heads, cfg.head_dim, d, rngs=rngs)
        self.mid2 = ResnetBlock(mid, mid, time_dim, cfg.groups, d, rngs=rngs)
        self.ups = nnx.List([Level(ci, co, time_dim, cfg, up=True, last=i == n - 1, rngs=rngs)
                             for i, (ci, co) in enumerate(reversed(in_out))])
        self.final_block = ResnetBlock(2 * w, w, time_dim, cfg.groups, d, rngs=rngs)
        self.final_conv = _conv(w, 1, 1, d, rngs)

    def __call__(self, x: Float[Array, "B ... C"], t: Float[Array, " B"],
                 cond: Float[Array, "B ... K"] | None = None) -> Float[Array, "B ... 1"]:
        x = sharding.shard(x, ("batch",) + (None,) * (x.ndim - 1))
        if self.cfg.cond_channels:
            x = jnp.concatenate([x, jnp.zeros_like(x) if cond is None else cond], axis=-1)
        x = self.init_conv(x)
        r = x
        temb = self.time2(jax.nn.gelu(self.time1(sinusoidal(t, self.cfg.width)), approximate=False))
        skips = []
        for lvl in self.downs:
            x = lvl.block1(x, temb)
            skips.append(x)
            x = lvl.attn(lvl.block2(x, temb))
            skips.append(x)
            x = lvl.resample(x)
        x = self.mid2(self.mid_attn(self.mid1(x, temb)), temb)
        for lvl in self.ups:
            x = lvl.block1(jnp.concatenate([x, skips.pop()], axis=-1), temb)
            x = lvl.attn(lvl.block2(jnp.concatenate([x, skips.pop()], axis=-1), temb))
            x = lvl.resample(x)
        x = self.final_block(jnp.concatenate([x, r], axis=-1), temb)
        return self.final_conv(x)
