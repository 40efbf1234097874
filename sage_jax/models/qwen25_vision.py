"""Qwen2.5-VL's vision tower in Flax NNX: a ViT over 14x14x2 patches with 2-D rotary embeddings, window attention
in most blocks and full (per-frame) attention in a few, and a patch merger that turns each 2x2 group of patches
into one language-model token.

Parameter tree (`nnx.to_pure_dict(nnx.state(tower, nnx.Param))`), Lv = depth, Dv = hidden_size, Fv =
intermediate_size, U = spatial_merge_size², Do = out_hidden_size::

    patch_embed:        [C*Tp*p*p, Dv]       (the Conv3d (Dv, C, Tp, p, p) flattened to act on pixel_values rows)
    blocks/norm1, norm2: [Lv, Dv]            (RMSNorm scales)
    blocks/wqkv: [Lv, Dv, 3*Dv]   blocks/bqkv: [Lv, 3*Dv]     (q | k | v, heads contiguous within each)
    blocks/wo:   [Lv, Dv, Dv]     blocks/bo:   [Lv, Dv]
    blocks/w_gate, w_up: [Lv, Dv, Fv]   blocks/b_gate, b_up: [Lv, Fv]
    blocks/w_down: [Lv, Fv, Dv]         blocks/b_down: [Lv, Dv]
    merger/norm: [Dv]   merger/w1: [U*Dv, U*Dv]   merger/b1: [U*Dv]   merger/w2: [U*Dv, Do]   merger/b2: [Do]

Shapes depend on the images' grids, so the index arrays (window order, rotary positions, attention segments) are
computed on the host by `layout` and the forward (`forward`) is a pure function of parameters and those arrays.
In this module P is the number of patches, Q the same patches as keys, D the tower's width Dv.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from sage_jax.models import layers
from sage_jax.models.decoder import param


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen25VisionConfig:
    """The vision tower (HF `Qwen2_5_VLVisionConfig`).

    Attributes:
      depth: blocks.  hidden_size: width Dv.  intermediate_size: SwiGLU width.  num_heads: attention heads.
      patch_size / temporal_patch_size: a patch spans p x p pixels of Tp consecutive frames.
      spatial_merge_size: m; each m x m group of patches becomes one LM token.
      window_size: window attention's side in pixels (window_size // m // p merged tokens).
      out_hidden_size: the LM width.  fullatt_block_indexes: blocks with full (per-frame) attention.
      rope_theta: base of the 2-D rotary embedding.  norm_eps: RMSNorm epsilon (1e-6 in every published model).
    """

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = ()
    in_channels: int = 3
    norm_eps: float = 1e-6
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    param_dtype: str = "float32"
    dtype: str = "float32"

    def __post_init__(self):
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"hidden_size {self.hidden_size} / num_heads {self.num_heads} must be a multiple of 4")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported vision hidden_act {self.hidden_act!r}; Qwen2.5-VL uses silu")
        if any(not 0 <= i < self.depth for i in self.fullatt_block_indexes):
            raise ValueError(f"fullatt_block_indexes {self.fullatt_block_indexes} outside 0..{self.depth - 1}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one pixel_values row: C * Tp * p * p."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


class VisionBlocks(nnx.Module):
    """All blocks, each parameter stacked on a leading layer axis."""

    def __init__(self, cfg: Qwen25VisionConfig, *, rngs: nnx.Rngs):
        L, D, F = cfg.depth, cfg.hidden_size, cfg.intermediate_size
        dt = jnp.dtype(cfg.param_dtype)
        ones, zeros = nnx.initializers.ones, nnx.initializers.zeros
        self.norm1 = param(rngs, (L, D), ("layers", "embed"), dt, ones)
        self.norm2 = param(rngs, (L, D), ("layers", "embed"), dt, ones)
        self.wqkv = param(rngs, (L, D, 3 * D), ("layers", "embed", None), dt)
        self.bqkv = param(rngs, (L, 3 * D), ("layers", None), dt, zeros)
        self.wo = param(rngs, (L, D, D), ("layers", None, "embed"), dt)
        self.bo = param(rngs, (L, D), ("layers", "embed"), dt, zeros)
        self.w_gate = param(rngs, (L, D, F), ("layers", "embed", "mlp"), dt)
        self.b_gate = param(rngs, (L, F), ("layers", "mlp"), dt, zeros)
        self.w_up = param(rngs, (L, D, F), ("layers", "embed", "mlp"), dt)
        self.b_up = param(rngs, (L, F), ("layers", "mlp"), dt, zeros)
        self.w_down = param(rngs, (L, F, D), ("layers", "mlp", "embed"), dt)
        self.b_down = param(rngs, (L, D), ("layers", "embed"), dt, zeros)


class Merger(nnx.Module):
    """RMSNorm, then each U consecutive patches concatenated through Linear-GELU-Linear to the LM width."""

    def __init__(self, cfg: Qwen25VisionConfig, *, rngs: nnx.Rngs):
        D, M = cfg.hidden_size, cfg.hidden_size * cfg.spatial_merge_size**2
        dt = jnp.dtype(cfg.param_dtype)
        self.norm = param(rngs, (D,), ("embed",), dt, nnx.initializers.ones)
        self.w1 = param(rngs, (M, M), (None, None), dt)
        self.b1 = param(rngs, (M,), (None,), dt, nnx.initializers.zeros)
        self.w2 = param(rngs, (M, cfg.out_hidden_size), (None, "embed"), dt)
        self.b2 = param(rngs, (cfg.out_hidden_size,), ("embed",), dt, nnx.initializers.zeros)


class Qwen25Vision(nnx.Module):
    def __init__(self, cfg: Qwen25VisionConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.patch_embed = param(rngs, (cfg.patch_dim, cfg.hidden_size), (None, "embed"),
                                  jnp.dtype(cfg.param_dtype))
        self.blocks = VisionBlocks(cfg, rngs=rngs)
        self.merger = Merger(cfg, rngs=rngs)


# ------------------------------------------------------------------------------------------------ host layout


def layout(cfg: Qwen25VisionConfig, grid_thw: np.ndarray) -> dict[str, np.ndarray]:
    """Index arrays of one forward over images/videos with these (t, h, w) patch grids, rows of pixel_values in
    their order (the reference's `get_vision_position_ids`, `get_vision_window_index`, `get_vision_cu_seqlens`).

    Returns (P = Σ t·h·w patches, P/U merged tokens):
      perm [P]: the patch rows in window order (windows made contiguous, merge groups kept whole);
      pos_hw [P, 2]: each permuted patch's (row, column) for the rotary embedding;
      window_seg [P], frame_seg [P]: attention segments of window and full blocks (a window; a frame);
      unperm [P/U]: merged tokens back from window order to the input order.
    """
    m = cfg.spatial_merge_size
    u = m * m
    win = cfg.window_size // m // cfg.patch_size  # a window's side in merged tokens
    pos, win_index, unit_window, unit_frame = [], [], [], []
    n_units = n_windows = n_frames = 0
    for t, h, w in np.asarray(grid_thw, np.int64).reshape(-1, 3).tolist():
        lh, lw = h // m, w // m
        # Rotary (row, column) of every patch, in the processor's order: merge groups of m x m patches, row-major.
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        hw = np.stack([a.reshape(lh, m, lw, m).transpose(0, 2, 1, 3).reshape(-1) for a in (hh, ww)], -1)
        pos.append(np.tile(hw, (t, 1)))
        # Windows of win x win merged tokens per frame; the grid is padded to whole windows (as the reference
        # pads, a whole extra window when it divides evenly; empty windows simply hold no token).
        ph, pw = win - lh % win, win - lw % win
        nh, nw = (lh + ph) // win, (lw + pw) // win
        index = np.pad(np.arange(t * lh * lw).reshape(t, lh, lw), ((0, 0), (0, ph), (0, pw)), constant_values=-1)
        index = index.reshape(t, nh, win, nw, win).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, win * win)
        window_id = np.broadcast_to(np.arange(t * nh * nw).reshape(t, nh * nw, 1), index.shape)
        keep = index >= 0
        win_index.append(index[keep] + n_units)
        unit_window.append(window_id[keep] + n_windows)
        unit_frame.append(np.repeat(np.arange(t) + n_frames, lh * lw))
        n_units, n_windows, n_frames = n_units + t * lh * lw, n_windows + t * nh * nw, n_frames + t
    window_index = np.concatenate(win_index)
    perm = (window_index[:, None] * u + np.arange(u)[None]).reshape(-1)
    return {
        "perm": perm.astype(np.int32),
        "pos_hw": np.concatenate(pos)[perm].astype(np.int32),
        "window_seg": np.repeat(np.concatenate(unit_window), u).astype(np.int32),
        # The window order never crosses a frame, so a frame's patches stay one contiguous segment.
        "frame_seg": np.repeat(np.concatenate(unit_frame)[window_index], u).astype(np.int32),
        "unperm": np.argsort(window_index).astype(np.int32),
    }


# ---------------------------------------------------------------------------------------------------- forward


def _attention(cfg: Qwen25VisionConfig, q: Float[Array, "P N H"], k: Float[Array, "Q N H"],
               v: Float[Array, "Q N H"], seg: Int[Array, " P"]) -> Float[Array, "P N H"]:
    """Block-diagonal attention over segments as a dense [P, Q] mask (a segment-aware kernel could skip the masked
    blocks); softmax in float32 as the reference's."""
    s = jnp.einsum("PNH,QNH->NPQ", q, k, preferred_element_type=jnp.float32) * (cfg.head_dim**-0.5)
    s = jnp.where((seg[:, None] == seg[None, :])[None], s, layers.MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("NPQ,QNH->PNH", p, v)


def _rotate(x: Float[Array, "P N H"], cos: Float[Array, "P 1 H"], sin: Float[Array, "P 1 H"]
            ) -> Float[Array, "P N H"]:
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return (xf * cos + jnp.concatenate([-x2, x1], axis=-1) * sin).astype(x.dtype)


def _block(cfg: Qwen25VisionConfig, p: dict, x: Float[Array, "P D"], cos, sin, seg) -> Float[Array, "P D"]:
    dt = jnp.dtype(cfg.dtype)
    n_p, d = x.shape
    h = layers.rms_norm(x, p["norm1"], cfg.norm_eps)
    qkv = (h @ p["wqkv"].astype(dt) + p["bqkv"].astype(dt)[None]).reshape(n_p, 3, cfg.num_heads, cfg.head_dim)
    q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
    o = _attention(cfg, q, k, v, seg).reshape(n_p, d)
    x = x + o @ p["wo"].astype(dt) + p["bo"].astype(dt)[None]
    h = layers.rms_norm(x, p["norm2"], cfg.norm_eps)
    gate = h @ p["w_gate"].astype(dt) + p["b_gate"].astype(dt)[None]
    up = h @ p["w_up"].astype(dt) + p["b_up"].astype(dt)[None]
    return x + (jax.nn.silu(gate) * up) @ p["w_down"].astype(dt) + p["b_down"].astype(dt)[None]


def forward(cfg: Qwen25VisionConfig, params: dict, pixels: Float[Array, "P C"], lay: dict
            ) -> Float[Array, "P/U Do"]:
    """pixel_values rows (any number of images and videos, grids as given to `layout`) -> LM-width features, one
    per merged token, in the input order. Pure: run it under `jax.jit` with `lay = layout(cfg, grid_thw)`."""
    dt = jnp.dtype(cfg.dtype)
    x = jnp.take(pixels.astype(dt), lay["perm"], axis=0) @ params["patch_embed"].astype(dt)  # [P, D]
    # 2-D rotary: the first half of each head's frequencies turn with the row, the second with the column.
    quarter = cfg.head_dim // 4
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, 2 * quarter, 2, dtype=np.float32) / (2 * quarter))
    pos = lay["pos_hw"].astype(jnp.float32)
    angles = jnp.concatenate([pos[:, :1] * inv[None], pos[:, 1:] * inv[None]], axis=-1)  # [P, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]  # [P, 1, H]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    blocks = params["blocks"]
    for i in range(cfg.depth):  # unrolled: XLA:CPU copies each layer's slice under a scan (see models/serving_lm.py)
        seg = lay["frame_seg"] if i in cfg.fullatt_block_indexes else lay["window_seg"]
        x = _block(cfg, {k: v[i] for k, v in blocks.items()}, x, cos, sin, seg)
    mp = params["merger"]
    h = layers.rms_norm(x, mp["norm"], cfg.norm_eps).reshape(-1, mp["w1"].shape[0])  # U patches per row
    h = jax.nn.gelu(h @ mp["w1"].astype(dt) + mp["b1"].astype(dt)[None], approximate=False)
    out = h @ mp["w2"].astype(dt) + mp["b2"].astype(dt)[None]
    return jnp.take(out, lay["unperm"], axis=0)
