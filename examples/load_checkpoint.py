"""Load every kind of checkpoint this project writes with only `jax`, `numpy` and `orbax.checkpoint`, and run it.

Nothing here imports the project (no sage_jax, pgla_jax, configs, flax or transformers): the file documents the
checkpoint format for code outside it, and each forward below is plain JAX. Copy the parts you need.

The format, one layout for every kind (`configs/checkpoint.py`)::

    CKPT/
      metadata.json   {"format": "sage-jax-checkpoint", "format_version": 1, "kind": ..., "config": {...},
                       "params": {"a/b/c": [shape, dtype], ...}, "provenance": {...}}
      params/         an Orbax checkpoint of a plain nested dict of arrays (string keys)
      tokenizer/ ...  optional files beside them (LMs and VLMs: the tokenizer; VLMs: processor/)

The kinds, and the forward each runs here (B batch, T tokens, D model width, V vocabulary):

    lm             a Llama / Qwen2 decoder (`python -m sage_jax.convert` writes one from a GGUF file or an HF
                   directory): token ids [B, T] -> logits [B, T, V]
    eagle_head     an EAGLE-style draft head of a target LM: the target's features [B, T, D] and token ids
                   [B, T] -> draft logits [B, T, Vd] over its reduced vocabulary `vocab_ids` [Vd]
    vlm            LLaVA-OneVision (SigLIP tower + projector): one image -> visual embeddings [F, D]; with the
                   language model, a prompt with the image spliced in -> logits [B, T, V]
    pgla-denoiser  the diffusion U-Net over encoded gradients: noisy gradient image [B, S, S, 1] and timestep
                   [B] -> predicted noise [B, S, S, 1]
    pgla-dncnn     the DnCNN baseline: noisy gradient image [B, S, S, 1] -> denoised image
    pgla-gaussian-prior
                   a Gaussian prior of clean gradients (per layer: mean, top-K directions, their variances, one
                   variance for the rest): noisy gradient image [B, S, S, 1] and ᾱ [B] -> its closed-form
                   predicted noise E[ε | x_t] [B, S, S, 1]

Everything computes in float32, whatever dtype the checkpoint stores. Run it::

    python examples/load_checkpoint.py CKPT [CKPT ...] [--target LM_CKPT]

It prints, per checkpoint, its kind, parameter count, the forward's output shape and a checksum of it. A draft head,
and a VLM that does not store its language model (`"language_model": "default"`: the one it was trained around,
SmolLM2-135M-Instruct converted by `sage_jax.convert`), read the LM of `--target`, by default the first `lm`
checkpoint on the command line. A path that is not a checkpoint: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

FORMAT, FORMAT_VERSION = "sage-jax-checkpoint", 1
KINDS = ("lm", "eagle_head", "vlm", "pgla-denoiser", "pgla-dncnn", "pgla-gaussian-prior")

# ============================================================================================ the format


def read_metadata(path: str) -> dict:
    """The checkpoint's metadata.json; ValueError (one line) when `path` is not a checkpoint of this format."""
    file = os.path.join(path, "metadata.json")
    if not os.path.isfile(file) or not os.path.isdir(os.path.join(path, "params")):
        raise ValueError(f"{path} is not a checkpoint (expected metadata.json and params/)")
    with open(file) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{file}: format {meta.get('format')!r} version {meta.get('format_version')} is not "
                         f"{FORMAT} version <= {FORMAT_VERSION}")
    return meta


def restore_params(path: str) -> dict:
    """The params tree on one device, whatever topology saved it (a checkpoint written sharded over 8 devices
    included): the restore target's shapes and dtypes come from the checkpoint's own Orbax metadata."""
    params_dir = os.path.abspath(os.path.join(path, "params"))  # Orbax wants an absolute path
    ckptr = ocp.StandardCheckpointer()
    stored = ckptr.metadata(params_dir).item_metadata.tree
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), stored)
    return ckptr.restore(params_dir, target)


def load(path: str, kind: str) -> tuple[dict, dict]:
    """(config, params) of a checkpoint of `kind`, floating-point arrays cast to float32."""
    meta = read_metadata(path)
    if meta.get("kind") != kind:
        raise ValueError(f"{path} holds a {meta.get('kind')!r} checkpoint, not {kind!r}")
    params = jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                          restore_params(path))
    return meta["config"], params


def load_lm(path: str) -> tuple[dict, dict]:
    """config: the LMConfig fields (vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, rope, ...)."""
    return load(path, "lm")


def load_eagle_head(path: str) -> tuple[dict, dict]:
    """config: {"head": the head layer's LMConfig, "target": the target's or None, "vocab_size": Vd, "taps"}."""
    return load(path, "eagle_head")


def load_vlm(path: str) -> tuple[dict, dict]:
    """config: {"architecture", "model": {"text", "vision", "image_token_id", ...}[, "language_model"]}."""
    return load(path, "vlm")


def load_denoiser(path: str) -> tuple[dict, dict]:
    """config: pgla_jax's DenoiserConfig ({"unet", "diffusion", "layout", "side", ...})."""
    return load(path, "pgla-denoiser")


def load_dncnn(path: str) -> tuple[dict, dict]:
    """config: as the denoiser's (the DnCNN reads none of it: its depth is in the params)."""
    return load(path, "pgla-dncnn")


def load_prior(path: str) -> tuple[dict, dict]:
    """config: the DenoiserConfig it was fitted for; params: {"mean" [G], "pad" [2] (mean, variance of the padding),
    "blocks": {"000": {"vecs" [n, K] (stored float16), "vals" [K], "rest" [], "bounds" [2] (start, stop)}, ...}}."""
    return load(path, "pgla-gaussian-prior")


def n_params(params: dict) -> int:
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params) if jnp.issubdtype(a.dtype, jnp.floating))


# ============================================================================================ lm
# Params: embed [V, D]; blocks/{attn_norm, mlp_norm} [L, D]; blocks/wq [L, D, N, H]; blocks/{wk, wv} [L, D, K, H];
# blocks/{bq [L, N, H], bk, bv [L, K, H]} (Qwen2 only); blocks/wo [L, N, H, D]; blocks/{w_gate, w_up} [L, D, F];
# blocks/w_down [L, F, D]; final_norm [D]; lm_head [D, V] (untied only). N query heads share K key/value heads.


def rms_norm(x, scale, eps: float):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rope_frequencies(rope: dict, head_dim: int) -> tuple[np.ndarray, float]:
    """RoPE's inverse frequencies [H/2] and attention scale, with transformers' context-extension variants."""
    inv = 1.0 / rope["theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kind, factor = rope.get("type", "default"), rope.get("factor", 1.0)
    if kind == "default":
        return inv.astype(np.float32), 1.0
    if kind == "linear":
        return (inv / factor).astype(np.float32), 1.0
    old = rope["original_max_position"]
    if kind == "llama3":
        # Wavelengths beyond old / low_freq_factor slow down by `factor`, below old / high_freq_factor stay, and
        # the band between interpolates.
        lo, hi = rope["low_freq_factor"], rope["high_freq_factor"]
        keep = np.clip((old * inv / (2 * math.pi) - lo) / (hi - lo), 0.0, 1.0)
        return (keep * inv + (1 - keep) * inv / factor).astype(np.float32), 1.0
    if kind == "yarn":
        def dim_of(turns):  # the dimension whose wavelength fits `turns` times into the original context
            return head_dim * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(rope["theta"]))

        lo = max(math.floor(dim_of(rope["beta_fast"])), 0)
        hi = min(math.ceil(dim_of(rope["beta_slow"])), head_dim - 1)
        ramp = np.clip((np.arange(head_dim // 2) - lo) / ((hi - lo) or 0.001), 0.0, 1.0)
        scale = rope.get("attention_factor")
        if scale is None:
            scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        return (ramp * inv / factor + (1 - ramp) * inv).astype(np.float32), float(scale)
    raise ValueError(f"unknown rope type {kind!r}")


def apply_rope(x, positions, inv_freq: np.ndarray, scale: float):
    """x [B, T, N, H] rotated by positions [T]: the pairs (x[i], x[i + H/2]) turn together ("rotate half")."""
    angles = positions[:, None] * inv_freq  # [T, H/2]
    cos, sin = (jnp.cos(angles) * scale)[:, None, :], (jnp.sin(angles) * scale)[:, None, :]  # [T, 1, H/2]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def decoder_layer(cfg: dict, w: dict, x, positions):
    """One pre-norm layer over x [B, T, D]: causal grouped-query attention with RoPE, then a SwiGLU MLP."""
    n, k, h = cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"]
    inv_freq, rope_scale = rope_frequencies(cfg["rope"], h)
    y = rms_norm(x, w["attn_norm"], cfg["norm_eps"])
    q = jnp.einsum("BTD,DNH->BTNH", y, w["wq"]) + w.get("bq", 0.0)
    key = jnp.einsum("BTD,DKH->BTKH", y, w["wk"]) + w.get("bk", 0.0)
    val = jnp.einsum("BTD,DKH->BTKH", y, w["wv"]) + w.get("bv", 0.0)
    q, key = apply_rope(q, positions, inv_freq, rope_scale), apply_rope(key, positions, inv_freq, rope_scale)
    key, val = jnp.repeat(key, n // k, axis=2), jnp.repeat(val, n // k, axis=2)  # query head j reads kv head j // (N/K)
    s = jnp.einsum("BTNH,BSNH->BNTS", q, key) / math.sqrt(h)
    t = x.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)  # causal
    o = jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(s, axis=-1), val)
    x = x + jnp.einsum("BTNH,NHD->BTD", o, w["wo"])
    y = rms_norm(x, w["mlp_norm"], cfg["norm_eps"])
    return x + (jax.nn.silu(y @ w["w_gate"]) * (y @ w["w_up"])) @ w["w_down"]


def lm_hidden(params: dict, cfg: dict, embeddings):
    """embeddings [B, T, D] -> (last hidden state [B, T, D] before the final norm, every layer's input
    [L, B, T, D]). Positions are 0..T-1 (no padding)."""
    positions = jnp.arange(embeddings.shape[1], dtype=jnp.float32)

    def step(x, w):
        return decoder_layer(cfg, w, x, positions), x

    return jax.lax.scan(step, embeddings, params["blocks"])  # layers stacked on a leading axis


def lm_head(params: dict, cfg: dict, hidden):
    """Final norm and LM head (the embedding, transposed, when tied): hidden [B, T, D] -> logits [B, T, V]."""
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    return rms_norm(hidden, params["final_norm"], cfg["norm_eps"]) @ head


def lm_logits(params: dict, cfg: dict, tokens):
    """The LM forward: token ids [B, T] -> logits [B, T, V]."""
    hidden, _ = lm_hidden(params, cfg, params["embed"][tokens])
    return lm_head(params, cfg, hidden)


# ============================================================================================ eagle_head
# Params: head/fc [2D, D], head/fc_b [D], head/layer: one decoder layer with fused projections (attn_norm [D],
# wqkv [D, (N+2K)H], bqkv (Qwen2 only), wo [NH, D], mlp_norm [D], w_gate_up [D, 2F], w_down [F, D]);
# EAGLE-3-style heads also head/fuse [len(taps)·D, D] and their own head/final_norm [D], head/lm_head [D, Vd];
# vocab_ids [Vd]: the full-vocabulary id of each draft logit (absent: the full vocabulary).


def unfuse_layer(cfg: dict, w: dict) -> dict:
    """A head's fused layer -> the LM layer layout `decoder_layer` reads."""
    d, n, k, h, f = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"], cfg["mlp_dim"]
    wq, wk, wv = jnp.split(w["wqkv"], [n * h, (n + k) * h], axis=1)
    out = {"attn_norm": w["attn_norm"], "mlp_norm": w["mlp_norm"], "wq": wq.reshape(d, n, h),
           "wk": wk.reshape(d, k, h), "wv": wv.reshape(d, k, h), "wo": w["wo"].reshape(n, h, d),
           "w_gate": w["w_gate_up"][:, :f], "w_up": w["w_gate_up"][:, f:], "w_down": w["w_down"]}
    if "bqkv" in w:
        bq, bk, bv = jnp.split(w["bqkv"], [n * h, (n + k) * h])
        out.update(bq=bq.reshape(n, h), bk=bk.reshape(k, h), bv=bv.reshape(k, h))
    return out


def eagle_target_features(params: dict, config: dict, hidden, layer_inputs):
    """What the head reads of the target at each position: its last hidden state [B, T, D] (`lm_hidden`), or for
    an EAGLE-3-style head the inputs of the `taps` layers concatenated and projected by `fuse`."""
    taps = config.get("taps") or []
    if not taps:
        return hidden
    return jnp.concatenate([layer_inputs[i] for i in taps], axis=-1) @ params["head"]["fuse"]


def eagle_forward(params: dict, config: dict, target: dict, tokens, features_prev):
    """Teacher-forced drafting: at position t the head reads the target's feature of the previous token,
    features_prev [B, T, D] (zeros at t = 0), and the embedding of token t [B, T], and predicts token t + 1.
    -> (draft logits [B, T, Vd], column i scoring token vocab_ids[i]; the predicted features [B, T, D])."""
    head, cfg = params["head"], config["head"]
    x = jnp.concatenate([features_prev, target["embed"][tokens]], axis=-1) @ head["fc"] + head["fc_b"]
    positions = jnp.arange(tokens.shape[1], dtype=jnp.float32)
    features = decoder_layer(cfg, unfuse_layer(cfg, head["layer"]), x, positions)
    if "lm_head" in head:  # an own head over the reduced vocabulary
        norm, out = head["final_norm"], head["lm_head"]
    else:  # the target's norm and head, restricted to the draft vocabulary
        norm = target["final_norm"]
        out = target["lm_head"] if "lm_head" in target else target["embed"].T
        if "vocab_ids" in params:
            out = out[:, params["vocab_ids"]]
    return rms_norm(features, norm, cfg["norm_eps"]) @ out, features


def shift_right(features):
    """f_t [B, T, D] -> f_{t-1}, zeros at t = 0."""
    return jnp.concatenate([jnp.zeros_like(features[:, :1]), features[:, :-1]], axis=1)


# ============================================================================================ vlm
# Params (LLaVA-OneVision): vision/patch_embed [C, p, p, Dv], vision/patch_bias [Dv], vision/pos_embed [P, Dv];
# vision/blocks/{ln1,ln2}_{scale,bias} [Lv, Dv], vision/blocks/w{q,k,v,o} [Lv, Dv, Dv] (heads fused),
# vision/blocks/b{q,k,v,o} [Lv, Dv], vision/blocks/w_fc1 [Lv, Dv, Fv], b_fc1, w_fc2 [Lv, Fv, Dv], b_fc2;
# projector/w1 [Dv·(feature layers), D], b1 [D], w2 [D, D], b2 [D]; image_newline [D]; lm: the LM layout above
# (absent when the config says "language_model": "default").

ACTIVATIONS = {"gelu": functools.partial(jax.nn.gelu, approximate=False),
               "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
               "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
               "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x), "silu": jax.nn.silu, "relu": jax.nn.relu}
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def preprocess_image(path: str, image) -> np.ndarray:
    """An RGB image uint8 [S, S, 3] of the tower's tile size -> the two tiles LLaVA-OneVision reads [2, 3, S, S]
    (the whole image, then the one-tile grid: the same pixels), scaled and normalised as the checkpoint's
    processor/preprocessor_config.json says. Other sizes need anyres tiling (transformers' image processor)."""
    file = os.path.join(path, "processor", "preprocessor_config.json")
    proc = {}
    if os.path.isfile(file):
        with open(file) as f:
            proc = json.load(f)
    x = np.asarray(image, np.float32) * proc.get("rescale_factor", 1 / 255)
    x = (x - np.asarray(proc.get("image_mean", CLIP_MEAN), np.float32)) / np.asarray(
        proc.get("image_std", CLIP_STD), np.float32)
    return np.stack([x.transpose(2, 0, 1)] * 2)


def layer_norm(x, scale, bias, eps: float):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def siglip_layer(cfg: dict, w: dict, x):
    """One pre-norm encoder layer over x [M, P, Dv]: bidirectional attention among a tile's patches, then MLP."""
    m, p, d = x.shape
    n = cfg["num_heads"]
    y = layer_norm(x, w["ln1_scale"], w["ln1_bias"], cfg["norm_eps"])
    q, k, v = ((y @ w[f"w{c}"] + w[f"b{c}"]).reshape(m, p, n, d // n) for c in "qkv")
    a = jax.nn.softmax(jnp.einsum("MPNH,MQNH->MNPQ", q, k) / math.sqrt(d // n), axis=-1)
    x = x + jnp.einsum("MNPQ,MQNH->MPNH", a, v).reshape(m, p, d) @ w["wo"] + w["bo"]
    y = layer_norm(x, w["ln2_scale"], w["ln2_bias"], cfg["norm_eps"])
    return x + ACTIVATIONS[cfg["hidden_act"]](y @ w["w_fc1"] + w["b_fc1"]) @ w["w_fc2"] + w["b_fc2"]


def siglip_states(params: dict, cfg: dict, tiles):
    """tiles [M, C, S, S] -> every hidden state [Lv + 1, M, P, Dv]: the patch embeddings, then each layer's output
    (transformers' `hidden_states`; LLaVA reads them before SigLIP's post-layernorm)."""
    m, c = tiles.shape[:2]
    p, g = cfg["patch_size"], cfg["image_size"] // cfg["patch_size"]
    patches = tiles[:, :, : g * p, : g * p].reshape(m, c, g, p, g, p)  # a stride-p, kernel-p convolution
    x = jnp.einsum("MCiyjx,CyxD->MijD", patches, params["patch_embed"]).reshape(m, g * g, -1)
    x = x + params["patch_bias"] + params["pos_embed"]
    _, outs = jax.lax.scan(lambda h, w: (siglip_layer(cfg, w, h),) * 2, x, params["blocks"])
    return jnp.concatenate([x[None], outs])


def visual_embeddings(params: dict, config: dict, tiles):
    """The features of one image of the tile's size, tiles [2, 3, S, S] (`preprocess_image`) -> [F, D]: the
    whole-image tile's P patches, then the grid tile's g x g patches row by row, `image_newline` after each row
    (F = P + g·(g + 1)); all projected to the LM's width."""
    cfg = config["model"]
    if config["architecture"] != "llava_onevision":
        raise ValueError(f"this example runs LLaVA-OneVision VLMs, not {config['architecture']!r}")
    vision, size = cfg["vision"], cfg["vision"]["image_size"]
    if [size, size] not in cfg["image_grid_pinpoints"] or cfg["vision_feature_select_strategy"] != "full":
        raise ValueError("this example packs one tile-sized image with a one-tile grid and the 'full' strategy")
    states = siglip_states(params["vision"], vision, tiles)  # [Lv + 1, 2, P, Dv]
    layers = cfg["vision_feature_layer"]
    x = jnp.concatenate([states[i] for i in ([layers] if isinstance(layers, int) else layers)], axis=-1)
    w = params["projector"]
    x = ACTIVATIONS[cfg["projector_act"]](x @ w["w1"] + w.get("b1", 0.0)) @ w["w2"] + w.get("b2", 0.0)
    g, d = size // vision["patch_size"], x.shape[-1]
    newline = jnp.broadcast_to(params["image_newline"], (g, 1, d))
    grid = jnp.concatenate([x[1].reshape(g, g, d), newline], axis=1).reshape(-1, d)
    return jnp.concatenate([x[0], grid])


def vlm_logits(lm: dict, lm_cfg: dict, tokens, image_token_id: int, visual):
    """tokens [B, T] holding F `image_token_id` placeholders, visual [F, D] -> logits [B, T, V]: the LM forward on
    the token embeddings with the visual embeddings in the placeholders' place (in row-major order)."""
    flat = tokens.reshape(-1)
    is_image = flat == image_token_id
    k = jnp.maximum(jnp.cumsum(is_image) - 1, 0)  # the k-th placeholder takes visual[k]
    x = jnp.where(is_image[:, None], visual[k], lm["embed"][flat]).reshape(*tokens.shape, -1)
    hidden, _ = lm_hidden(lm, lm_cfg, x)
    return lm_head(lm, lm_cfg, hidden)


# ============================================================================================ pgla-denoiser / dncnn
# Flax layers, channels last: a conv is {kernel [*window, in, out], bias [out]}, a dense {kernel [in, out], bias},
# a GroupNorm {scale, bias}. The U-Net's tree: init_conv, time1, time2, downs/<i>/{block1, block2, attn,
# resample}, mid1, mid_attn, mid2, ups/<i>/..., final_block, final_conv (pgla_jax/denoise/unet.py).


def encode_gradient(config: dict, gradient):
    """A flat gradient [G] -> the denoiser's input: padded with its mean to side x side [side, side, 1] (layout
    "image2d", side the smallest multiple of the U-Net's downsampling factor that holds it, or the config's
    `side`) or to a length L [L, 1] ("vector1d"). The gradient is the victim model's leaves flattened in sorted
    path order; decoding is `x.reshape(-1)[:G]`."""
    multiple = 2 ** (len(config["unet"]["mults"]) - 1)
    g = gradient.shape[0]
    if config["layout"] == "image2d":
        side = config.get("side") or -(-math.ceil(math.sqrt(g)) // multiple) * multiple
        shape = (side, side, 1)
    elif config["layout"] == "vector1d":
        shape = (-(-g // multiple) * multiple, 1)
    else:
        raise ValueError(f"this example encodes the image2d and vector1d layouts, not {config['layout']!r}")
    pad = jnp.full((math.prod(shape) - g,), gradient.mean())
    return jnp.concatenate([gradient, pad]).reshape(shape)


def conv(p: dict, x, standardize: bool = False):
    """'SAME' convolution of x [B, *spatial, C]; `standardize`: weight standardisation per output channel."""
    w = p["kernel"]
    if standardize:
        axes = tuple(range(w.ndim - 1))
        w = (w - w.mean(axes, keepdims=True)) * jax.lax.rsqrt(w.var(axes, keepdims=True) + 1e-5)
    spec = {3: ("NWC", "WIO", "NWC"), 4: ("NHWC", "HWIO", "NHWC")}[x.ndim]
    y = jax.lax.conv_general_dilated(x, w, (1,) * (x.ndim - 2), "SAME", dimension_numbers=spec)
    return y + p["bias"] if "bias" in p else y


def group_norm(p: dict, x, groups: int, eps: float = 1e-6):
    """Statistics per example over the spatial axes and each group of consecutive channels."""
    b, c = x.shape[0], x.shape[-1]
    g = x.reshape(b, -1, groups, c // groups)
    g = (g - g.mean((1, 3), keepdims=True)) * jax.lax.rsqrt(g.var((1, 3), keepdims=True) + eps)
    return g.reshape(x.shape) * p["scale"] + p["bias"]


def resnet_block(p: dict, x, temb, groups: int):
    """(standardised conv -> GroupNorm -> time scale/shift -> SiLU), (conv -> GroupNorm -> SiLU), residual."""
    scale, shift = jnp.split(jax.nn.silu(temb) @ p["mlp"]["kernel"] + p["mlp"]["bias"], 2, axis=-1)  # [B, C]
    per_example = (x.shape[0],) + (1,) * (x.ndim - 2) + (-1,)
    h = group_norm(p["block1"]["norm"], conv(p["block1"]["proj"], x, True), groups)
    h = jax.nn.silu(h * (1 + scale.reshape(per_example)) + shift.reshape(per_example))
    h = jax.nn.silu(group_norm(p["block2"]["norm"], conv(p["block2"]["proj"], h, True), groups))
    return h + (conv(p["res"], x) if "res" in p else x)


def attention_heads(p: dict, x, heads: int):
    """1x1-conv q, k, v of x after a GroupNorm(1): three [B, positions, heads, head_dim]."""
    qkv = conv(p["qkv"], group_norm(p["prenorm"], x, 1))
    q, k, v = jnp.split(qkv.reshape(x.shape[0], -1, 3, heads, qkv.shape[-1] // (3 * heads)), 3, axis=2)
    return q[:, :, 0], k[:, :, 0], v[:, :, 0]


def linear_attention(p: dict, x, heads: int):
    """Residual linear attention: softmax over features for q, over positions for k."""
    q, k, v = attention_heads(p, x, heads)
    q = jax.nn.softmax(q, axis=-1) / math.sqrt(q.shape[-1])
    context = jnp.einsum("bnhd,bnhe->bhde", jax.nn.softmax(k, axis=1), v)
    out = jnp.einsum("bhde,bnhd->bnhe", context, q).reshape(x.shape[:-1] + (-1,))
    return x + group_norm(p["outnorm"], conv(p["out"], out), 1)


def full_attention(p: dict, x, heads: int):
    """Residual softmax attention over all positions (the U-Net's middle)."""
    q, k, v = attention_heads(p, x, heads)
    a = jax.nn.softmax(jnp.einsum("bnhd,bmhd->bhnm", q, k) / math.sqrt(q.shape[-1]), axis=-1)
    return x + conv(p["out"], jnp.einsum("bhnm,bmhd->bnhd", a, v).reshape(x.shape[:-1] + (-1,)))


def downsample(p: dict, x):
    """Space-to-depth (each 2x2 patch, or pair in 1-D, into channels), then a 1x1 conv."""
    if x.ndim == 3:
        return conv(p["conv"], x.reshape(x.shape[0], x.shape[1] // 2, -1))
    b, h, w, c = x.shape
    x = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, h // 2, w // 2, 4 * c)
    return conv(p["conv"], x)


def upsample(p: dict, x):
    """Nearest-neighbour x2 along every spatial axis, then a 3x3 conv."""
    for axis in range(1, x.ndim - 1):
        x = jnp.repeat(x, 2, axis=axis)
    return conv(p["conv"], x)


def timestep_embedding(t, dim: int):
    """Sinusoidal embedding of (possibly fractional) timesteps t [B] -> [B, dim]."""
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(dim // 2) / (dim // 2 - 1))
    args = t[:, None] * freqs[None]
    return jnp.concatenate([jnp.sin(args), jnp.cos(args)], axis=-1)


def unet_forward(params: dict, config: dict, x, t, cond=None):
    """The noise prediction ε̂(x_t, t): x [B, *spatial, 1] (encoded noisy gradients), t [B] (0-based step of
    `config["diffusion"]["timesteps"]`, fractional allowed) -> [B, *spatial, 1]. A conditional model
    (`cond_channels` > 0) also reads the observation `cond` [B, *spatial, K] (zeros when None)."""
    cfg = config["unet"]
    groups, heads = cfg["groups"], cfg["heads"]
    if cfg["cond_channels"]:
        x = jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (cfg["cond_channels"],)) if cond is None else cond], -1)
    x = conv(params["init_conv"], x)
    r = x
    dense = lambda p, y: y @ p["kernel"] + p["bias"]  # noqa: E731
    temb = dense(params["time2"], jax.nn.gelu(dense(params["time1"], timestep_embedding(t, cfg["width"])),
                                              approximate=False))
    skips = []
    for i in range(len(params["downs"])):
        p = params["downs"][str(i)]
        x = resnet_block(p["block1"], x, temb, groups)
        skips.append(x)
        x = linear_attention(p["attn"], resnet_block(p["block2"], x, temb, groups), heads)
        skips.append(x)
        x = downsample(p["resample"], x) if "conv" in p["resample"] else conv(p["resample"], x)  # last: 3x3 conv
    x = resnet_block(params["mid1"], x, temb, groups)
    x = resnet_block(params["mid2"], full_attention(params["mid_attn"], x, heads), temb, groups)
    for i in range(len(params["ups"])):
        p = params["ups"][str(i)]
        x = resnet_block(p["block1"], jnp.concatenate([x, skips.pop()], axis=-1), temb, groups)
        x = resnet_block(p["block2"], jnp.concatenate([x, skips.pop()], axis=-1), temb, groups)
        x = linear_attention(p["attn"], x, heads)
        x = upsample(p["resample"], x) if "conv" in p["resample"] else conv(p["resample"], x)
    x = resnet_block(params["final_block"], jnp.concatenate([x, r], axis=-1), temb, groups)
    return conv(params["final_conv"], x)


def dncnn_forward(params: dict, config: dict, y):
    """The blind DnCNN: y [B, H, W, 1] -> y minus its noise estimate (conv+ReLU, (conv+GroupNorm(4)+ReLU) x
    (depth - 2), conv)."""
    h = jax.nn.relu(conv(params["first"], y))
    for i in range(len(params["mid"])):
        h = jax.nn.relu(group_norm(params["norms"][str(i)], conv(params["mid"][str(i)], h), 4))
    return y - conv(params["last"], h)


def prior_eps(params: dict, x, abar):
    """E[ε | x_t] for x_t = √ᾱ·x_0 + √(1 − ᾱ)·ε, x_0 ~ N(μ, Σ) per layer with Σ = U diag(λ) Uᵀ + ρ (I − U Uᵀ):
    √(1 − ᾱ)·(ᾱΣ + (1 − ᾱ)I)⁻¹(x_t − √ᾱ·μ), the padding a scalar Gaussian. x: [B, ...] in a flat layout."""
    flat = x.reshape(x.shape[0], -1)
    size = params["mean"].shape[0]
    a, c = abar[:, None], 1.0 - abar[:, None]
    r = flat[:, :size] - jnp.sqrt(a) * params["mean"][None]
    parts, lo = [], 0
    for key in sorted(params["blocks"]):  # consecutive layers ("bounds" holds each one's [start, stop) too)
        blk = params["blocks"][key]
        q, rr = jnp.linalg.qr(blk["vecs"])  # the float16-stored directions, orthonormal again
        u = q * jnp.sign(jnp.diag(rr))[None]
        lo, hi = lo, lo + u.shape[0]
        z = r[:, lo:hi] @ u
        inside = (z / (a * blk["vals"][None] + c)) @ u.T
        outside = (r[:, lo:hi] - z @ u.T) / (a * blk["rest"] + c)
        parts.append(inside + outside)
        lo = hi
    mean_pad, var_pad = params["pad"][0], params["pad"][1]
    parts.append((flat[:, size:] - jnp.sqrt(a) * mean_pad) / (a * var_pad + c))
    return (jnp.sqrt(c) * jnp.concatenate(parts, axis=1)).reshape(x.shape)


# ============================================================================================ the command line


#: The demo gradient's length: the shipped denoisers' victim, a LeNet on 28x28 images, has 13,426 parameters.
DEMO_GRADIENT_SIZE = 13_426


@functools.lru_cache(maxsize=1)
def _lm_once(path: str) -> tuple[dict, dict]:
    """`load_lm`, remembered: several heads and VLMs on one command line share their target."""
    return load_lm(path)


def demo(path: str, kind: str, target: str | None) -> tuple[dict, list[tuple[str, jax.Array]]]:
    """Loads the checkpoint at `path` and runs its forward on fixed inputs: (params, [(output name, output)])."""
    rng = np.random.default_rng(0)
    if kind == "lm":
        cfg, params = _lm_once(path)
        tokens = jnp.asarray(rng.integers(0, cfg["vocab_size"], (1, 8)))
        return params, [("logits", jax.jit(lambda p, x: lm_logits(p, cfg, x))(params, tokens))]

    if kind == "eagle_head":
        config, params = load_eagle_head(path)
        if target is None:
            raise ValueError(f"{path} is a draft head: give its target LM checkpoint too (--target LM_CKPT)")
        lm_cfg, lm = _lm_once(target)
        if lm_cfg["d_model"] != config["head"]["d_model"] or lm_cfg["vocab_size"] != config["head"]["vocab_size"]:
            raise ValueError(f"{path} is a head for another target than {target}")
        tokens = jnp.asarray(rng.integers(0, lm_cfg["vocab_size"], (1, 8)))

        @jax.jit
        def draft(params, lm, tokens):  # the target's forward gives the features the head reads
            hidden, layer_inputs = lm_hidden(lm, lm_cfg, lm["embed"][tokens])
            features = eagle_target_features(params, config, hidden, layer_inputs)
            return eagle_forward(params, config, lm, tokens, shift_right(features))[0]

        return params, [("draft logits", draft(params, lm, tokens))]

    if kind == "vlm":
        config, params = load_vlm(path)
        cfg = config["model"]
        size = cfg["vision"]["image_size"]
        tiles = preprocess_image(path, rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
        visual = jax.jit(lambda p, x: visual_embeddings(p, config, x))(params, tiles)
        outputs = [("visual embeddings", visual)]
        lm_cfg, lm = cfg["text"], params.get("lm")
        if lm is None and target is not None:  # "language_model": "default": the LM it was trained around
            lm_cfg, lm = _lm_once(target)
            if lm_cfg["d_model"] != cfg["text"]["d_model"] or lm_cfg["vocab_size"] != cfg["text"]["vocab_size"]:
                raise ValueError(f"{path} was trained around another LM than {target}")
        if lm is not None:  # a short prompt around the image: text, F placeholders, text
            image_id = cfg["image_token_id"]
            tokens = jnp.asarray(np.concatenate([[1, 2, 3], np.full(visual.shape[0], image_id), [4, 5]])[None])
            logits = jax.jit(lambda p, t, v: vlm_logits(p, lm_cfg, t, image_id, v))(lm, tokens, visual)
            outputs.append(("logits, image spliced in", logits))
        return params, outputs

    if kind in ("pgla-denoiser", "pgla-dncnn"):
        config, params = load_denoiser(path) if kind == "pgla-denoiser" else load_dncnn(path)
        noisy = rng.normal(0, 0.01, DEMO_GRADIENT_SIZE) + rng.normal(0, 0.01, DEMO_GRADIENT_SIZE)
        x = encode_gradient(config, jnp.asarray(noisy, jnp.float32))[None]  # [1, side, side, 1]
        if kind == "pgla-dncnn":
            return params, [("denoised", jax.jit(lambda p, y: dncnn_forward(p, config, y))(params, x))]
        t = jnp.asarray([100.0])
        eps = jax.jit(lambda p, y, s: unet_forward(p, config, y, s))(params, x, t)
        return params, [("predicted noise", eps)]

    if kind == "pgla-gaussian-prior":
        config, params = load_prior(path)
        size = params["mean"].shape[0]
        noisy = params["mean"] + rng.normal(0, 0.05, size)
        x = encode_gradient(config, jnp.asarray(noisy, jnp.float32))[None]
        eps = jax.jit(prior_eps)(params, x, jnp.asarray([0.99]))
        return params, [("predicted noise at ᾱ = 0.99", eps)]

    raise ValueError(f"{path}: unknown checkpoint kind {kind!r} (this example knows {', '.join(KINDS)})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+", metavar="CKPT", help="checkpoint directories of any kind")
    ap.add_argument("--target", metavar="LM_CKPT",
                    help="the LM of draft heads and of VLMs without one (default: the first lm CKPT given)")
    args = ap.parse_args(argv)
    try:
        metas = {p: read_metadata(p) for p in args.checkpoints + ([args.target] if args.target else [])}
        kinds = {p: meta.get("kind") for p, meta in metas.items()}
        target = args.target or next((p for p in args.checkpoints if kinds[p] == "lm"), None)
        for path in args.checkpoints:
            params, outputs = demo(path, kinds[path], target)
            print(f"{kinds[path]} {path}: {n_params(params):,} parameters")
            for name, y in outputs:
                y = np.asarray(y, np.float64)
                print(f"  {name} {list(y.shape)}: sum {y.sum():+.6e}, mean |x| {np.abs(y).mean():.6e}")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
