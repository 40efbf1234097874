"""The serving form of a decoder LM: per-layer, projection-fused weights and pure functions over them.

The canonical parameters (`Decoder`, the checkpoint layout) stack every layer on a leading axis for `scan`.
Serving reads each weight once per forward, and on XLA:CPU a scan over stacked weights copies every layer's
slice before its matmuls (measured: 74 ms vs 24 ms per SmolLM2 decode step). So inference converts once to a
tuple of per-layer dicts with q|k|v and gate|up fused into single matmuls, and unrolls the layers.

Inside a layer the activations run feature-major ([D, B·T]) against weights stored [out, in]. For the few tokens
of a decode or verify step XLA:CPU's matmul is far faster that way round: 30 SmolLM2-sized layers over 4 / 8
tokens took 26 / 30 ms against 40 / 46 ms token-major (1 token: 16.5 vs 17.3 ms, on a 2-core AMD EPYC).
Transposing the activations at the layer's edges keeps the gain; transposing around each matmul does not (XLA
folds it back), nor does weights [in, out] contracted on their first axis (a copy per matmul). Other backends
choose their own layouts, so the orientation should cost them nothing (not measured on an accelerator).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from configs.sharding import gather, map_shards, shard
from cpu_kernels import skinny_matmul
from sage_jax.models import layers
from sage_jax.models.config import LMConfig
from sage_jax.models.kv_cache import KVCache, NewKV, write_rows
from sage_jax.models.visibility import Visibility

# Every op of a model forward or head runs under this name scope, so a profile can tell the model's work from the
# decoding loop's own (benchmarks/sage/step_profile.py).
MODEL_SCOPE = "model"


#: Row groups of a serving layer's fused matrices: (qkv, gate|up). A `tp`-way tensor-parallel model lays each
#: fused matrix out as `tp` groups, group j holding shard j's rows of every part ([q_j | k_j | v_j], [gate_j | up_j]),
#: so that cutting the fused rows `tp` ways gives every device whole heads and matching gate / up rows, and the
#: layer runs with no communication but its two all-reduces. (1, 1): the plain layout, [q | k | v], [gate | up].
Groups = tuple[int, int]


def _cat(parts, g, xp=jnp):
    """[..., X_i] each -> [..., sum X_i], group-major: [p0_0 | p1_0 | .. | p0_1 | p1_1 | ..]."""
    lead = parts[0].shape[:-1]
    return xp.concatenate([x.reshape(*lead, g, -1) for x in parts], -1).reshape(*lead, -1)


def fuse_layer(cfg: LMConfig, p: dict, groups: Groups = (1, 1), xp=jnp) -> dict:
    """One layer's canonical params (wq [D,N,H], ...) -> fused 2-D matrices (wqkv [D, (N+2K)H], ...), their columns
    in `groups` (see `Groups`). An entry whose canonical arrays `p` lacks is left out, so a loader can fuse a layer
    part by part (`serving_part`; `xp=numpy` on the host)."""
    d = cfg.d_model
    ga, gm = groups
    has = lambda *keys: all(k in p for k in keys)  # noqa: E731
    out = {k: p[k] for k in ("attn_norm", "mlp_norm") if k in p}
    if has("wq", "wk", "wv"):
        out["wqkv"] = _cat([p["wq"].reshape(d, -1), p["wk"].reshape(d, -1), p["wv"].reshape(d, -1)], ga, xp)
    if has("wo"):
        out["wo"] = p["wo"].reshape(-1, d)
    if has("w_gate", "w_up"):
        out["w_gate_up"] = _cat([p["w_gate"], p["w_up"]], gm, xp)
    if has("w_down"):
        out["w_down"] = p["w_down"]
    if cfg.qkv_bias and has("bq", "bk", "bv"):
        out["bqkv"] = _cat([p["bq"].reshape(-1), p["bk"].reshape(-1), p["bv"].reshape(-1)], ga, xp)
    return out


def _split(x: Float[Array, "..."], sizes: tuple[int, ...], g: int, names: tuple[str | None, ...], axis: int
           ) -> list[Float[Array, "..."]]:
    """The parts of a fused activation whose `axis` lies in `g` row groups (`fuse_layer`), each part in its own
    order: `sizes` are the parts' whole lengths. `names`: the logical axes of the grouped view (its group axis cut
    as the fused rows are, so the partitioner slices every device's own group instead of reshuffling them).
    With g = 1 these are plain slices."""
    axis = axis % x.ndim
    shape = x.shape
    x = x.reshape(*shape[:axis], g, -1, *shape[axis + 1:])
    if g > 1:
        x = shard(x, names)
    ends = np.cumsum([0, *(n // g for n in sizes)])
    return [jax.lax.slice_in_dim(x, int(lo), int(hi), axis=axis + 1).reshape(*shape[:axis], -1, *shape[axis + 1:])
            for lo, hi in zip(ends[:-1], ends[1:], strict=True)]


#: The parts of a serving layer, each with the canonical arrays it is made from (`serving_part`).
SERVING_PARTS: dict[str, tuple[str, ...]] = {
    "norms": ("attn_norm", "mlp_norm"), "qkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"), "o": ("wo",),
    "gate_up": ("w_gate", "w_up"), "down": ("w_down",)}


def serving_part(cfg: LMConfig, part: str, p: dict, groups: Groups = (1, 1), xp=jnp) -> dict:
    """The entries of `serving_layer(fuse_layer(cfg, layer, groups))` that `part` (`SERVING_PARTS`) makes, from only
    the canonical arrays it is made of (`p`): a layer built piece by piece, as a loader does to hold little beside
    what it has built (`sage_jax.io.lm_checkpoint.load_serving`, on the host: `xp=numpy`)."""
    return serving_layer(fuse_layer(cfg, {k: p[k] for k in SERVING_PARTS[part]}, groups, xp))


#: A fused layer's [in, out] matrices and the names of their [out, in] serving forms (`serving_layer`).
_SERVING_NAMES = {"wqkv": "qkv", "wo": "o", "w_gate_up": "gate_up", "w_down": "down"}


def serving_layer(p: dict) -> dict:
    """A fused layer (`fuse_layer`'s [in, out] matrices, also the EAGLE head's parameter layout) -> the [out, in]
    matrices `block` multiplies feature-major activations with: qkv [(N+2K)H, D], o [D, NH], gate_up [2F, D],
    down [D, F]; norms and bias as they are. A layer already in serving form is returned as it is."""
    if not any(k in p for k in _SERVING_NAMES):
        return p
    return {_SERVING_NAMES.get(k, k): v.T if k in _SERVING_NAMES else v for k, v in p.items()}


def prepare_matmul(cfg: LMConfig) -> None:
    """Builds (once per machine) and loads the skinny CPU kernel now, where `cfg.matmul == "auto"` runs on CPU.
    Call it eagerly where a serving model is set up (`Decoder.serving`, `Engine`): `project` and `head` take the
    kernel only once it is ready, and never build it inside a trace. Idempotent."""
    if cfg.matmul == "auto" and jax.default_backend() == "cpu":
        skinny_matmul.prepare()


def project(cfg: LMConfig, w: Float[Array, "E D"], x: Float[Array, "D M"]) -> Float[Array, "E M"]:
    """A serving weight [out, in] times feature-major activations: the skinny CPU kernel for the few float32
    columns of a decode or verify step (`cfg.matmul == "auto"`; `skinny_matmul.kernel_usable`: once
    `prepare_matmul` has loaded it), else XLA's dot."""
    if cfg.matmul == "exact":  # the shape-invariant mode: fixed row tiles, float32 accumulation
        return _exact_matmul(x.T, w).astype(x.dtype).T
    if cfg.matmul == "auto" and skinny_matmul.kernel_usable(w, x):
        return skinny_matmul.skinny_matmul(w, x, impl="kernel")
    return jnp.einsum("ED,DM->EM", w, x)


def block(cfg: LMConfig, p: dict, x: Float[Array, "B T D"], positions: Int[Array, "B T"] | Int[Array, "B T 3"],
          k_cache: Float[Array, "B S K H"] | None, v_cache: Float[Array, "B S K H"] | None,
          write_pos: Int[Array, " B"] | None, mask: Bool[Array, "B T S"] | Visibility,
          mask_new: Bool[Array, "B T T"] | None = None, *, write: bool = True, groups: Groups = (1, 1)):
    """One pre-norm transformer layer on a `serving_layer` (feature-major inside, see the module docstring).
    Without a cache, queries attend among themselves. With `mask_new` (`split_mask`) the cache is only read, the
    queries see its slots under `mask` and the new tokens under `mask_new`, and the new keys/values [B, T, K, H]
    come back in the cache's place (`LM.forward(write=False)`). A `Visibility` mask (`cfg.attention == "pallas"`,
    `resolve_mask`) runs the tree-attention kernel instead; `write=False` then reads the cache the same way.
    `groups`: the layout of the fused matrices (`Groups`). `cfg.matmul == "exact"`: `_exact_block`."""
    if cfg.matmul == "exact":
        return _exact_block(cfg, p, x, positions, k_cache, v_cache, write_pos, mask, write, groups)
    dt = jnp.dtype(cfg.dtype)
    b, t, d = x.shape
    n, kh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    inv_freq, rope_scale = layers.rope_inv_freq(cfg.rope, hd)
    # [D, M], M = B·T. D stays unnamed: with "embed" first it would claim the fsdp axis that "batch" claims for
    # token-major activations (`logical_to_spec`: first claim wins).
    xm = shard(x.reshape(b * t, d).T, (None, "batch"))
    h = layers.rms_norm(xm, p["attn_norm"], cfg.norm_eps, axis=0)
    qkv = project(cfg, p["qkv"].astype(dt), h)
    if cfg.qkv_bias:
        qkv = qkv + p["bqkv"].astype(dt)[:, None]
    parts = _split(qkv.T.reshape(b, t, -1), (n * hd, kh * hd, kh * hd), groups[0], ("batch", "seq", "heads", None), -1)
    q, k, v = (x.reshape(b, t, -1, hd) for x in parts)
    sections = cfg.rope.mrope_section  # used only by [B, T, 3] (multimodal) positions
    # Heads are cut only when the fused rows are (`serving_layout`): GQA groups then never straddle devices.
    hq, hk = ("heads", "kv_heads") if groups[0] > 1 else (None, None)
    q = shard(layers.apply_rope(q, positions, inv_freq, rope_scale, sections), ("batch", "seq", hq, "head_dim"))
    k = shard(layers.apply_rope(k, positions, inv_freq, rope_scale, sections), ("batch", "seq", hk, "head_dim"))
    if isinstance(mask, Visibility):
        o, k_out, v_out = _kernel_attention(q, k, v, k_cache, v_cache, write_pos, mask, write)
        return _mlp(cfg, p, xm, o, b, t, groups[1]), k_out, v_out
    if k_cache is not None and mask_new is not None:
        o = layers.attention_with_new(q, k_cache.astype(dt), v_cache.astype(dt), mask, k, v, mask_new)
        return _mlp(cfg, p, xm, o, b, t, groups[1]), k, v
    if k_cache is not None:
        k_cache = write_rows(k_cache, k.astype(k_cache.dtype), write_pos)
        v_cache = write_rows(v_cache, v.astype(v_cache.dtype), write_pos)
        k_all, v_all = k_cache.astype(dt), v_cache.astype(dt)
    else:
        k_all, v_all = k, v
    o = layers.attention(q, k_all, v_all, mask)
    return _mlp(cfg, p, xm, o, b, t, groups[1]), k_cache, v_cache


def _exact_matmul(x: Float[Array, "M D"], w: Float[Array, "E D"] | Float[Array, "D E"], w_layout: str = "ED"
                  ) -> Float[Array, "M E"]:
    """The exact mode's matmul, float32: `pallas_kernels.row_tiled_matmul` (fixed row tiles and reduction blocks;
    Mosaic on TPU, Triton on GPU, the jnp reference in 8-row tiles elsewhere)."""
    from pallas_kernels.row_tiled_matmul import row_tiled_matmul  # here: importing Pallas costs every CLI 0.4 s

    return row_tiled_matmul(x, w, w_layout=w_layout)


def _exact_names(groups: Groups) -> tuple[str | None, str | None]:
    """The logical names a tensor-parallel exact layer's arrays are cut by, given its `Groups` (`_exact_block`): the
    heads (and, laid out by `exact_layout`, the o projection's output rows) as the fused qkv rows are, the MLP's
    columns (and the down projection's output rows) as the fused gate|up rows are; None where nothing is cut."""
    return ("heads" if groups[0] > 1 else None), ("mlp" if groups[1] > 1 else None)


def _exact_block(cfg: LMConfig, p: dict, x: Float[Array, "B T D"], positions: Int[Array, "B T"] | Int[Array, "B T 3"],
                 k_cache: Float[Array, "B S K H"] | None, v_cache: Float[Array, "B S K H"] | None,
                 write_pos: Int[Array, " B"] | None, mask: Bool[Array, "B T S"] | Visibility, write: bool,
                 groups: Groups):
    """`block` in the shape-invariant mode: a row's output has the same bits whatever the number of rows and
    whatever the mesh, and a tree's node computes as the same token decoded alone would.

    Matmuls through `_exact_matmul` (float32 accumulation), everything else row-wise in fixed tiles
    (`layers.tiled_rows`: norms, bias, RoPE, the gated activation, residuals). Attention over a cache under a
    `Visibility` (every forward of the decoding loops) runs the fixed-order kernel
    (`pallas_kernels.exact_attention`: fixed query tiles, 128-slot blocks folded in order; Mosaic on TPU, Triton on
    GPU, its jnp reference elsewhere). Reading the cache only (`write=False`: a speculative verify), each query sees
    its visible window keys laid over the slots they will hold once its path is committed, in order from `start` (a
    tree node's ancestors by depth), so that it attends exactly as it will when decoded alone after that path: same
    keys in the same slots, the rest weighing exactly 0. Under a dense mask (a prefill that measures attention, a
    forward without a cache) attention runs one query at a time (`layers.attention_row`).

    Tensor-parallel (`groups`, on a mesh: `map_shards`), each device computes its own heads and its own MLP
    columns, as in the fast mode, but no value is ever a sum of the devices' partial sums: the attention's output
    and the MLP's activation are gathered whole (`sharding.gather`), and the o and down projections, laid out cut on
    their output rows (`exact_layout`), give each device whole dot products over the full input; their outputs are
    gathered too. Every element is then computed on one device by the same tiles as on one device alone."""
    overlay = k_cache is not None and not write
    if overlay and (not isinstance(mask, Visibility) or mask.window.shape[-1] != x.shape[1]):
        raise ValueError("the exact mode reads a cache unwritten under a Visibility whose window is the T new tokens")
    dt = jnp.dtype(cfg.dtype)
    ha, hm = _exact_names(groups)
    keys = [k for k in ("attn_norm", "qkv", "bqkv", "o", "mlp_norm", "gate_up", "down") if k in p]
    weight_names = {"attn_norm": (None,), "qkv": (ha, None), "bqkv": (ha,), "o": (ha, None), "mlp_norm": (None,),
                    "gate_up": (hm, None), "down": (hm, None)}
    args = [x, positions] + [p[k].astype(jnp.float32 if k in ("attn_norm", "mlp_norm", "bqkv") else dt) for k in keys]
    names = [("batch", None, None), ("batch",) + (None,) * (positions.ndim - 1)] + [weight_names[k] for k in keys]
    cached = k_cache is not None
    if cached:
        cache_names = ("batch", None, ha, None)
        args += [k_cache, v_cache]
        names += [cache_names, cache_names]
        if not overlay:
            args.append(write_pos)
            names.append(("batch",))
    visibility = isinstance(mask, Visibility)
    if visibility:
        args += [mask.pad, mask.start, mask.window]
        names += [("batch",), ("batch",), ("batch", None, None)]
    else:
        args.append(mask)
        names.append(("batch", None, None))

    def local(x, positions, *rest):
        w = dict(zip(keys, rest[:len(keys)], strict=True))
        rest = rest[len(keys):]
        k_cache = v_cache = write_pos = None
        if cached:
            k_cache, v_cache, *rest = rest
            if not overlay:
                write_pos, *rest = rest
        m = Visibility(pad=rest[0], start=rest[1], window=rest[2]) if visibility else rest[0]
        return _exact_layer(cfg, w, x, positions, k_cache, v_cache, write_pos, m, overlay, ha, hm)

    if not cached:
        return map_shards(lambda *a: local(*a)[0], names, ("batch", None, None), *args), None, None
    kv_names = ("batch", None, ha, None)
    return map_shards(local, names, (("batch", None, None), kv_names, kv_names), *args)


def _exact_layer(cfg: LMConfig, w: dict, x: Float[Array, "B T D"], positions, k_cache, v_cache, write_pos, mask,
                 overlay: bool, ha: str | None, hm: str | None):
    """`_exact_block` on one device's shards: its heads (`ha`: their logical name where the heads are cut) and
    its MLP columns (`hm`), with `x` whole on every device."""
    dt = jnp.dtype(cfg.dtype)
    b, t, d = x.shape
    n, kh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    kh = w["qkv"].shape[0] // (hd * (n // kh + 2))  # this device's kv heads (all of them unless cut)
    n = kh * (cfg.n_heads // cfg.n_kv_heads)
    f = w["gate_up"].shape[0] // 2  # this device's MLP columns
    inv_freq, rope_scale = layers.rope_inv_freq(cfg.rope, hd)
    tiled = layers.tiled_rows

    def qkv_tile(yt, pt):  # [R, E] float32, positions [R] or [R, 3]
        r = yt.shape[0]
        if "bqkv" in w:
            yt = yt + w["bqkv"][None]
        q, k, v = jnp.split(yt.astype(dt), np.cumsum([n * hd, kh * hd]), axis=-1)
        rope = lambda z, heads: layers.apply_rope(  # noqa: E731
            z.reshape(1, r, heads, hd), pt[None], inv_freq, rope_scale, cfg.rope.mrope_section)[0]
        return rope(q, n), rope(k, kh), v.reshape(r, kh, hd)

    rows = x.reshape(b * t, d)
    h = tiled(lambda xt: layers.rms_norm(xt, w["attn_norm"], cfg.norm_eps), rows)
    q, k, v = tiled(qkv_tile, _exact_matmul(h, w["qkv"]), positions.reshape(b * t, *positions.shape[2:]))
    k, v = k.reshape(b, t, kh, hd), v.reshape(b, t, kh, hd)
    keys, vals = k_cache, v_cache
    if k_cache is not None and not overlay:
        keys = write_rows(k_cache, k.astype(k_cache.dtype), write_pos)
        vals = write_rows(v_cache, v.astype(v_cache.dtype), write_pos)
    if k_cache is not None and isinstance(mask, Visibility):  # what the decoding loops run: the fixed-order kernel
        from pallas_kernels.exact_attention import exact_attention  # here: importing Pallas costs every CLI 0.4 s

        new = (k.astype(dt), v.astype(dt)) if overlay else ()  # the window's keys, laid over their path's slots
        o = exact_attention(q.reshape(b, t, n, hd), keys.astype(dt), vals.astype(dt), mask.pad, mask.start,
                            mask.window, *new).reshape(b * t, -1)
    else:  # a dense mask (a prefill that measures attention, a forward without a cache): one query at a time
        keys, vals = (k, v) if k_cache is None else (keys, vals)
        dense = _dense(mask, keys.shape[1])
        o = jax.lax.map(lambda i: layers.attention_row(q[i], keys[i // t].astype(dt), vals[i // t].astype(dt),
                                                       dense[i // t, i % t]), jnp.arange(b * t)).reshape(b * t, -1)
    if ha:  # every head's output on every device, in head order (shard j holds heads [j n, (j + 1) n))
        o = gather(o, ha, -1)
    y = _exact_matmul(o, w["o"])
    if ha:  # this device's output rows of the o projection -> all of them
        y = gather(y, ha, -1)

    def mlp_in(xt, yt):  # the attention's residual, and the MLP's normed input
        xt = xt + yt.astype(dt)
        return xt, layers.rms_norm(xt, w["mlp_norm"], cfg.norm_eps)

    rows, h = tiled(mlp_in, rows, y)
    act = tiled(lambda gu: jax.nn.silu(gu[:, :f].astype(dt)) * gu[:, f:].astype(dt), _exact_matmul(h, w["gate_up"]))
    if hm:
        act = gather(act, hm, -1)
    y = _exact_matmul(act, w["down"])
    if hm:
        y = gather(y, hm, -1)
    out = tiled(lambda xt, yt: xt + yt.astype(dt), rows, y).reshape(b, t, d)
    if overlay:
        return out, k, v
    return out, keys, vals


def _kernel_attention(q: Float[Array, "B T N H"], k: Float[Array, "B T K H"], v: Float[Array, "B T K H"],
                      k_cache: Float[Array, "B S K H"], v_cache: Float[Array, "B S K H"],
                      write_pos: Int[Array, " B"], vis: Visibility, write: bool):
    """`block`'s attention through `pallas_kernels.tree_attention`: (output, and the cache written, or with
    `write=False` the new keys/values). The kernel sees the prefix [pad, start) of the cache and U new keys: the
    window [start, start + U) read back from the cache just written (a draft tree level's queries see the levels
    before it there), or, reading the cache only, the T fresh keys themselves, which must then be the window."""
    if k_cache is None:
        raise ValueError("a Visibility mask needs a KV cache")
    dt = q.dtype
    if write:
        k_cache = write_rows(k_cache, k.astype(k_cache.dtype), write_pos)
        v_cache = write_rows(v_cache, v.astype(v_cache.dtype), write_pos)
        u = vis.window.shape[-1]
        window = lambda c: jax.vmap(  # noqa: E731
            lambda c_, s_: jax.lax.dynamic_slice_in_dim(c_, s_, u, axis=0))(c, vis.start)
        k_new, v_new = window(k_cache), window(v_cache)
    else:
        if vis.window.shape[-1] != k.shape[1]:
            raise ValueError(f"reading the cache only, the window must be the {k.shape[1]} new tokens, "
                             f"got {vis.window.shape[-1]} slots")
        k_new, v_new = k, v
    from pallas_kernels.tree_attention import tree_attention  # here: importing Pallas costs every CLI 0.4 s

    def kernel(*a):  # chosen when lowering, so a CPU host exporting for TPU (`jax.export`) gets the Mosaic kernel
        return jax.lax.platform_dependent(
            *a, tpu=functools.partial(tree_attention, impl="tpu"),
            cuda=functools.partial(tree_attention, impl="gpu"), rocm=functools.partial(tree_attention, impl="gpu"),
            default=functools.partial(tree_attention, impl="tpu", interpret=True))  # no Mosaic / Triton on CPU

    # Per device under a mesh: rows over the batch axes, kv heads cut exactly as the query heads (so every shard
    # holds whole GQA groups), hence both named "heads".
    heads, rows = ("batch", None, "heads", None), ("batch",)
    o = map_shards(kernel, (heads, heads, heads, rows, rows, heads, heads, ("batch", None, None)), heads,
                   q, k_cache.astype(dt), v_cache.astype(dt), vis.start, vis.pad, k_new.astype(dt),
                   v_new.astype(dt), vis.window)
    return (o, k_cache, v_cache) if write else (o, k, v)


def resolve_mask(cfg: LMConfig, mask: Bool[Array, "B T S"] | Visibility, capacity: int
                 ) -> Bool[Array, "B T S"] | Visibility:
    """What `block` reads: a `Visibility` stays one for the kernel (`cfg.attention == "pallas"`) and for the exact
    mode (`cfg.matmul == "exact"`), else it becomes the dense [B, T, S] mask of the XLA path; a dense mask passes
    through."""
    if isinstance(mask, Visibility) and cfg.attention != "pallas" and cfg.matmul != "exact":
        return mask.dense(capacity)
    return mask


def split_mask(mask: Bool[Array, "B T S"], write_pos: Int[Array, " B"]
               ) -> tuple[Bool[Array, "B T S"], Bool[Array, "B T T"]]:
    """A cache mask for T tokens written at `write_pos[b] + [0, T)`, split for reading the cache unwritten: the
    cache part with those T slots hidden (they hold stale entries), and the new tokens' part (slot write_pos + j
    would hold token j, so token j gets that slot's visibility)."""
    b, t, s = mask.shape
    slots = write_pos[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
    mask_new = jnp.take_along_axis(mask, jnp.broadcast_to(slots[:, None, :], (b, t, t)), axis=2, mode="clip")
    s_idx = jnp.arange(s, dtype=jnp.int32)[None, None, :]
    stale = (s_idx >= write_pos[:, None, None]) & (s_idx < write_pos[:, None, None] + t)
    return mask & ~stale, mask_new


def _mlp(cfg: LMConfig, p: dict, xm: Float[Array, "D M"], o: Float[Array, "B T N H"], b: int, t: int,
         groups: int = 1) -> Float[Array, "B T D"]:
    """The rest of `block` after attention: output projection, residual, and the gated MLP."""
    dt = jnp.dtype(cfg.dtype)
    o = o.reshape(b * t, -1).T
    xm = shard(xm + project(cfg, p["o"].astype(dt), o), (None, "batch"))
    h = layers.rms_norm(xm, p["mlp_norm"], cfg.norm_eps, axis=0)
    gu = project(cfg, p["gate_up"].astype(dt), h)
    gate, up = _split(gu, (cfg.mlp_dim, cfg.mlp_dim), groups, ("mlp", None, "batch"), 0)
    act = shard(jax.nn.silu(gate) * up, ("mlp", "batch"))
    xm = xm + project(cfg, p["down"].astype(dt), act)
    return shard(xm.T.reshape(b, t, -1), ("batch", "seq", "embed"))


def probe_attention(cfg: LMConfig, p: dict, x: Float[Array, "B Q D"],
                    positions: Int[Array, "B Q"] | Int[Array, "B Q 3"], k_all: Float[Array, "B S K H"],
                    mask: Bool[Array, "B Q S"], weight: Float[Array, "B Q"], groups: Groups = (1, 1)
                    ) -> Float[Array, "B S"]:
    """How much Q probe queries (layer inputs `x`) attend to each key slot in one layer: the softmax weights
    averaged over the query heads and over the queries by `weight` (rows of `weight` sum to 1). The query
    projection is recomputed for the Q probes only, so `block` stays as it is."""
    dt = jnp.dtype(cfg.dtype)
    b, q_len, d = x.shape
    n, kh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    inv_freq, rope_scale = layers.rope_inv_freq(cfg.rope, hd)
    h = layers.rms_norm(x, p["attn_norm"], cfg.norm_eps)
    sizes = (n * hd, kh * hd, kh * hd)
    q = jnp.einsum("ED,BQD->BQE", _split(p["qkv"], sizes, groups[0], ("heads", None, None), 0)[0].astype(dt), h)
    if cfg.qkv_bias:
        q = q + _split(p["bqkv"], sizes, groups[0], ("heads", None), 0)[0].astype(dt)[None, None]
    q = layers.apply_rope(q.reshape(b, q_len, n, hd), positions, inv_freq, rope_scale, cfg.rope.mrope_section)
    qg = q.reshape(b, q_len, kh, n // kh, hd)
    s = jnp.einsum("BQKGH,BSKH->BKGQS", qg, k_all.astype(dt), preferred_element_type=jnp.float32) * (hd**-0.5)
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], s, layers.MASK_VALUE), axis=-1)
    return jnp.einsum("BKGQS,BQ->BS", probs, weight.astype(jnp.float32)) / n


@flax.struct.dataclass
class Probe:
    """Which prompt slots `LM.forward` measures attention from (`probe_attention`): rows [B, Q] and their weights
    [B, Q] (summing to 1 per row)."""

    rows: Int[Array, "B Q"]
    weight: Float[Array, "B Q"]


def embed_tokens(cfg: LMConfig, embed: Float[Array, "V D"], tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
    return shard(jnp.take(embed, tokens, axis=0).astype(jnp.dtype(cfg.dtype)), ("batch", "seq", "embed"))


@jax.named_scope(MODEL_SCOPE)
def head(cfg: LMConfig, embed, final_norm, lm_head, hidden: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
    """Final norm + LM head; float32 logits."""
    if cfg.matmul == "exact":  # the shape-invariant mode (`_exact_block`); on a mesh each device its vocabulary rows
        w, layout = (embed, "ED") if lm_head is None else (lm_head, "DE")

        def local(hidden, final_norm, w):
            b, t, d = hidden.shape
            h = layers.tiled_rows(lambda ht: layers.rms_norm(ht, final_norm, cfg.norm_eps), hidden.reshape(b * t, d))
            return _exact_matmul(h, w.astype(h.dtype), layout).reshape(b, t, -1)

        w_names = ("vocab", None) if layout == "ED" else (None, "vocab")
        return map_shards(local, (("batch", None, None), (None,), w_names), ("batch", None, "vocab"),
                          hidden, final_norm, w)
    h = layers.rms_norm(hidden, final_norm, cfg.norm_eps)
    b, t, d = h.shape
    if lm_head is None and cfg.matmul == "auto" and skinny_matmul.kernel_usable(embed, h.reshape(b * t, d), True):
        logits = skinny_matmul.skinny_matmul(embed, h.reshape(b * t, d), x_tokens_major=True, y_tokens_major=True,
                                             impl="kernel").reshape(b, t, -1)
    elif lm_head is None:  # tied: contract with the embedding's D axis directly (no transposed copy)
        logits = jnp.einsum("BTD,VD->BTV", h, embed.astype(h.dtype), preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("BTD,DV->BTV", h, lm_head.astype(h.dtype), preferred_element_type=jnp.float32)
    return shard(logits, ("batch", "seq", "vocab"))


@flax.struct.dataclass
class LM:
    """A decoder in serving form (a pytree; `cfg` is static).

    Attributes: embed [V, D]; final_norm [D]; lm_head [D, V] or None (tied); layers: per-layer
    `serving_layer` dicts; groups: their fused matrices' row groups (`Groups`; `serving_params`).
    """

    embed: Float[Array, "V D"]
    final_norm: Float[Array, " D"]
    lm_head: Float[Array, "D V"] | None
    layers: tuple[dict, ...]
    cfg: LMConfig = flax.struct.field(pytree_node=False)
    groups: Groups = flax.struct.field(pytree_node=False, default=(1, 1))  # the fused matrices' layout (`Groups`)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def serving(self) -> LM:
        """Itself: an `LM` stands wherever a model is asked for its serving form (`Decoder.serving`, `Engine`)."""
        return self

    def truncated(self, n: int) -> LM:
        """The first `n` layers with this model's final norm and head (the self-draft)."""
        if not 1 <= n <= self.n_layers:
            raise ValueError(f"cannot keep {n} of {self.n_layers} layers")
        return self.replace(layers=self.layers[:n])

    def with_attention(self, attention: str) -> LM:
        """This model with its cache-reading forwards attending the `LMConfig.attention` way ("xla" / "pallas")."""
        return self if attention == self.cfg.attention else self.replace(cfg=self.cfg.replace(attention=attention))

    def with_matmul(self, matmul: str) -> LM:
        """This model with its layers multiplying the `LMConfig.matmul` way ("auto" / "xla" / "exact"). A
        tensor-parallel model going into or out of "exact" has its o and down projections placed anew
        (`exact_layout`)."""
        if matmul == self.cfg.matmul:
            return self
        lm = self.replace(cfg=self.cfg.replace(matmul=matmul))
        if (matmul == "exact") != (self.cfg.matmul == "exact"):
            lm = exact_layout(lm, exact=matmul == "exact")
        return lm

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        c = self.cfg
        return KVCache.zeros(self.n_layers, batch, capacity, c.n_kv_heads, c.head_dim, jnp.dtype(c.dtype),
                             cut_heads=self.groups[0] > 1)

    @jax.named_scope(MODEL_SCOPE)
    def forward(self, tokens: Int[Array, "B T"] | None, positions: Int[Array, "B T"] | Int[Array, "B T 3"],
                mask: Bool[Array, "B T S"] | Visibility,
                cache: KVCache | None = None, write_pos: Int[Array, " B"] | None = None, *,
                embeddings: Float[Array, "B T D"] | None = None, write: bool = True, probe: Probe | None = None,
                taps: tuple[int, ...] = ()) -> tuple:
        """Last-layer hidden states (before the final norm) and the cache with the new keys/values written at
        `write_pos[b] + [0, T)`; queries see the cache slots `mask` allows: a dense [B, T, S] mask, or a
        `Visibility` (what the decoding loops pass: the Pallas kernel reads it under `cfg.attention == "pallas"`).

        `write=False` leaves the cache untouched and returns the new keys/values instead (`NewKV`), for the
        caller to commit only the rows it keeps (`KVCache.commit`); queries see the same either way. A speculative
        verify runs its forward inside a `lax.switch` over widths: a cache written there leaves the switch in a
        fresh buffer that XLA:CPU copies back into the loop state, the whole cache per layer and step.

        With a `probe` (a cache, `write=True`), a third value comes back: [B, S] how much the probe rows attend
        to each cache slot, averaged over layers, heads and probes (draft-side visual-token pruning ranks the
        visual tokens by it, `decoding/visual_pruning.py`).

        With `taps` (layer indices), one more value comes last: the INPUTS of those layers concatenated,
        [B, T, len(taps)·D] (HF's `hidden_states[i]` for i in taps; what an EAGLE-3-style head fuses)."""
        if any(not 0 <= i < self.n_layers for i in taps):
            raise ValueError(f"taps {taps} outside the model's {self.n_layers} layers")
        x = embed_tokens(self.cfg, self.embed, tokens) if embeddings is None else embeddings
        tapped = []
        if cache is None:
            if isinstance(mask, Visibility):
                raise ValueError("a Visibility mask ranges over a KV cache; give the cache")
            for i, p in enumerate(self.layers):
                if i in taps:
                    tapped.append(x)
                x, _, _ = block(self.cfg, p, x, positions, None, None, None, mask, groups=self.groups)
            return (x, None, _concat(tapped, taps)) if taps else (x, None)
        if cache.n_layers != self.n_layers:
            raise ValueError(f"cache has {cache.n_layers} layers, the model {self.n_layers}")
        # Once for all layers.
        # A probe reads the dense mask of its rows; the layers read it too, but in the exact mode, whose fixed-order
        # kernel takes the `Visibility` (a prefill would otherwise attend one query at a time).
        dense = _dense(mask, cache.capacity) if probe is not None else None
        exact_kernel = self.cfg.matmul == "exact" and isinstance(mask, Visibility)
        mask = resolve_mask(self.cfg, mask, cache.capacity) if probe is None or exact_kernel else dense
        mask_new = None
        if not write and not isinstance(mask, Visibility) and self.cfg.matmul != "exact":
            mask, mask_new = split_mask(mask, write_pos)
        ks, vs = [], []
        score = None
        if probe is not None:
            take = lambda a: jnp.take_along_axis(  # noqa: E731
                a, probe.rows.reshape(probe.rows.shape + (1,) * (a.ndim - 2)), axis=1)
            p_pos, p_mask = take(positions), take(dense)
            score = jnp.zeros(dense.shape[::2], jnp.float32)
        for i, (p, k_l, v_l) in enumerate(zip(self.layers, cache.k, cache.v, strict=True)):  # unrolled
            x_in = x
            if i in taps:
                tapped.append(x)
            x, k_l, v_l = block(self.cfg, p, x, positions, k_l, v_l, write_pos, mask, mask_new, write=write,
                                groups=self.groups)
            if probe is not None:
                score = score + probe_attention(self.cfg, p, take(x_in), p_pos, k_l, p_mask, probe.weight, self.groups)
            ks.append(k_l)
            vs.append(v_l)
        extra = (_concat(tapped, taps),) if taps else ()
        if not write:
            return (x, NewKV(k=jnp.stack(ks), v=jnp.stack(vs))) + extra
        if probe is not None:
            return (x, KVCache(k=tuple(ks), v=tuple(vs)), score / self.n_layers) + extra
        return (x, KVCache(k=tuple(ks), v=tuple(vs))) + extra

    def head(self, hidden: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        return head(self.cfg, self.embed, self.final_norm, self.lm_head, hidden)


def _dense(mask: Bool[Array, "B T S"] | Visibility, capacity: int) -> Bool[Array, "B T S"]:
    return mask.dense(capacity) if isinstance(mask, Visibility) else mask


def _concat(tapped: list, taps: tuple[int, ...]) -> Float[Array, "B T Z"]:
    """The tapped layer inputs in the order `taps` names them (they were collected in layer order)."""
    by_layer = dict(zip(sorted(taps), tapped, strict=True))
    return jnp.concatenate([by_layer[i] for i in taps], axis=-1)


def serving_params(cfg: LMConfig, params: dict, groups: Groups = (1, 1)) -> LM:
    """Canonical (stacked) params -> `LM`, fused in `groups` (`serving_layout` gives a sharded model's). Run it once,
    under `jax.jit` or eagerly."""
    blocks = params["blocks"]
    per_layer = tuple(serving_layer(fuse_layer(cfg, {k: v[i] for k, v in blocks.items()}, groups))
                      for i in range(cfg.n_layers))
    return LM(embed=params["embed"], final_norm=params["final_norm"], lm_head=params.get("lm_head"),
              layers=per_layer, cfg=cfg, groups=groups)


def exact_layout(lm: LM, exact: bool = True) -> LM:
    """`lm` with the o and down projections of a tensor-parallel model cut on their output rows (`exact`), or back
    on their inputs as `serving_layout` lays them. The exact mode's layout (`_exact_block`): a projection cut on its
    input makes each device a partial sum of every output, which the fast mode adds across devices (an all-reduce
    whose order is the collective's); cut on its output rows, each device computes whole dot products over the
    gathered input, and no value depends on the mesh. The same bytes on every device either way. Arrays on a mesh
    are moved (`jax.device_put`), abstract ones (`jax.ShapeDtypeStruct`, for lowering) given the new sharding; a
    model on one device, or with its attention and MLP whole on every device, is returned as it is.
    ValueError when the output rows (d_model) do not divide among the devices that cut the inputs."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if lm.groups == (1, 1):
        return lm

    def move(x):
        s = getattr(x, "sharding", None)
        if not isinstance(s, NamedSharding) or x.ndim != 2:
            return x
        spec = tuple(s.spec) + (None,) * (2 - len(s.spec))
        cut = spec[1] if exact else spec[0]
        if cut is None or spec[0 if exact else 1] is not None:  # whole, or already laid out so
            return x
        ways = int(np.prod([s.mesh.shape[a] for a in ((cut,) if isinstance(cut, str) else cut)]))
        if exact and x.shape[0] % ways:
            raise ValueError(f"the exact mode cuts the o and down projections' {x.shape[0]} output rows {ways} ways: "
                             f"d_model must be a multiple of the tensor-parallel degree")
        where = NamedSharding(s.mesh, P(cut, None) if exact else P(None, cut))
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)
        return jax.device_put(x, where)

    layers_ = tuple({k: move(v) if k in ("o", "down") else v for k, v in p.items()} for p in lm.layers)
    return lm.replace(layers=layers_)


def serving_layout(cfg: LMConfig, params: dict) -> tuple[Groups, LM | None]:
    """The serving form's layout for canonical `params` placed on a mesh (`NamedSharding`s; abstract arrays too):
    the fused matrices' `Groups`, and an `LM` of `NamedSharding`s (the `out_shardings` of `serving_params`) that
    cuts them as the canonical arrays are cut. The fused qkv rows are split only when the query and the kv heads
    are split alike (else they stay whole on every device: GQA groups must not straddle devices), gate|up only when
    the MLP is; the output projection is cut as the qkv rows are, so that attention is either wholly
    tensor-parallel or wholly replicated. Unplaced `params`: ((1, 1), None)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    b = params["blocks"]
    if not isinstance(getattr(b["wq"], "sharding", None), NamedSharding):
        return (1, 1), None
    mesh = b["wq"].sharding.mesh

    def entry(x, dim):  # the mesh axes that cut dimension `dim` of x
        spec = tuple(x.sharding.spec) + (None,) * x.ndim
        return spec[dim]

    def size(e) -> int:
        return int(np.prod([mesh.shape[a] for a in ((e,) if isinstance(e, str) else e)])) if e is not None else 1

    heads, kv, mlp = entry(b["wq"], 2), entry(b["wk"], 2), entry(b["w_gate"], 2)  # [L, D, N|K|F, ...]
    qkv = heads if heads == kv else None
    groups = (size(qkv), size(mlp))
    ns = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    layer = {"attn_norm": ns(), "mlp_norm": ns(), "qkv": ns(qkv, None), "o": ns(None, qkv),
             "gate_up": ns(mlp, None), "down": ns(None, entry(b["w_down"], 1))}
    if cfg.qkv_bias:
        layer["bqkv"] = ns(qkv)
    lm_head = params.get("lm_head")
    return groups, LM(embed=params["embed"].sharding, final_norm=ns(),
                      lm_head=None if lm_head is None else lm_head.sharding, layers=(layer,) * cfg.n_layers,
                      cfg=cfg, groups=groups)
