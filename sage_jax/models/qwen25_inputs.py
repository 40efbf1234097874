"""Host-side (numpy) inputs of Qwen2.5-VL: M-RoPE position ids, placeholder expansion, video patchification.

transformers' combined `Qwen2_5_VLProcessor` and its video processor need torchvision; these stand in for the
parts of them a caller needs: `expand_placeholders` repeats each image / video pad token to its feature count,
`video_inputs` turns frames into `pixel_values_videos` exactly as the reference video processor lays them out, and
`rope_index` is the reference `get_rope_index`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def rope_index(cfg, input_ids, attention_mask=None, image_grid_thw=None, video_grid_thw=None,
               second_per_grid_ts=None) -> tuple[np.ndarray, np.ndarray]:
    """(positions int32 [B, T, 3], deltas int32 [B]): the reference `get_rope_index` (`cfg` a `Qwen25VLConfig`).

    Each run of image (video) pad tokens among a row's kept tokens takes the next image (video) grid, rows in
    order. Text counts up from the position after the previous run; a run's positions are (start + frame time,
    start + row, start + column), the frame time of a video scaled by tokens_per_second * second_per_grid_ts
    (truncated, in float32 as the reference's), and the next text starts at start + max(h, w) / merge. Padding
    slots get 0. A row continues after its prompt at the 1-D position (kept tokens so far) + deltas[b].
    """
    ids = np.asarray(input_ids)
    ids = ids[None] if ids.ndim == 1 else ids
    keep = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).reshape(ids.shape) > 0
    kinds = (ids == cfg.image_token_id).astype(np.int64) + 2 * (ids == cfg.video_token_id)
    grids = {1: iter(np.asarray(image_grid_thw if image_grid_thw is not None else np.zeros((0, 3))).reshape(-1, 3)),
             2: iter(np.asarray(video_grid_thw if video_grid_thw is not None else np.zeros((0, 3))).reshape(-1, 3))}
    n_videos = 0 if video_grid_thw is None else np.asarray(video_grid_thw).reshape(-1, 3).shape[0]
    seconds = iter(np.ones(n_videos) if second_per_grid_ts is None else np.asarray(second_per_grid_ts).reshape(-1))
    m = cfg.vision.spatial_merge_size
    positions = np.zeros((*ids.shape, 3), np.int64)
    deltas = np.zeros(ids.shape[0], np.int64)
    for b in range(ids.shape[0]):
        kind = kinds[b][keep[b]]
        if kind.size == 0:
            continue
        bounds = [0, *(np.flatnonzero(np.diff(kind)) + 1).tolist(), kind.size]
        cur, chunks = 0, []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            k = int(kind[start])
            if k == 0:
                chunks.append(np.broadcast_to(np.arange(end - start) + cur, (3, end - start)))
                cur += end - start
                continue
            what = "image" if k == 1 else "video"
            grid = next(grids[k], None)
            if grid is None:
                raise ValueError(f"row {b} has more {what} placeholder runs than {what}s were given")
            t, h, w = (int(v) for v in grid)
            if t * (h // m) * (w // m) != end - start:
                raise ValueError(f"row {b}: a {what} placeholder run has {end - start} tokens but its {what} "
                                 f"(grid {t}x{h}x{w}) makes {t * (h // m) * (w // m)} features")
            interval = np.float32(cfg.tokens_per_second) * np.float32(next(seconds) if k == 2 else 1.0)
            tt = (np.arange(t, dtype=np.float32) * interval).astype(np.int64)
            grid_pos = np.stack(np.meshgrid(tt, np.arange(h // m), np.arange(w // m), indexing="ij")).reshape(3, -1)
            chunks.append(grid_pos + cur)
            cur += max(h, w) // m
        llm = np.concatenate(chunks, axis=1)  # [3, kept tokens]
        positions[b, keep[b]] = llm.T
        deltas[b] = llm.max() + 1 - kind.size
    return positions.astype(np.int32), deltas.astype(np.int32)


def expand_placeholders(inputs, image_grid_thw=None, video_grid_thw=None, *, merge_size: int = 2,
                        image_token: str | int = "<|image_pad|>", video_token: str | int = "<|video_pad|>"):
    """Repeats the k-th image (video) placeholder to grid_k.prod() / merge_size² copies, as the processor does.

    `inputs`: a string, a list of strings, or token ids (one sequence or a list of them; then `image_token` /
    `video_token` are ids). Placeholders take the grids in order across the batch. Returns the same structure
    (token ids as lists)."""
    single = isinstance(inputs, str) or (len(inputs) > 0 and np.ndim(inputs[0]) == 0)
    rows = [inputs] if single else list(inputs)
    counts = {}
    for token, grid in ((image_token, image_grid_thw), (video_token, video_grid_thw)):
        g = np.zeros((0, 3), np.int64) if grid is None else np.asarray(grid).reshape(-1, 3)
        counts[token] = iter((g.prod(-1) // merge_size**2).tolist())

    def n_copies(token):
        n = next(counts[token], None)
        if n is None:
            raise ValueError(f"more {token!r} placeholders than grids were given")
        return n

    out = []
    for row in rows:
        if isinstance(row, str):
            for token in (image_token, video_token):
                parts = row.split(token)
                row = parts[0] + "".join(token * n_copies(token) + p for p in parts[1:])
            out.append(row)
        else:
            out.append([t for tok in np.asarray(row).tolist()
                        for t in ([tok] * n_copies(tok) if tok in (image_token, video_token) else [tok])])
    for token, left in counts.items():
        if next(left, None) is not None:
            raise ValueError(f"fewer {token!r} placeholders than grids were given")
    return out[0] if single else out


def pad_batch(rows: Sequence[Sequence[int]], pad_id: int, side: str = "left") -> tuple[np.ndarray, np.ndarray]:
    """Ragged token ids -> (input_ids int64 [B, T], attention_mask int64 [B, T]), padded on `side`."""
    t = max(len(r) for r in rows)
    ids = np.full((len(rows), t), pad_id, np.int64)
    mask = np.zeros((len(rows), t), np.int64)
    for b, r in enumerate(rows):
        sl = slice(t - len(r), t) if side == "left" else slice(0, len(r))
        ids[b, sl], mask[b, sl] = r, 1
    return ids, mask


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280) -> tuple[int, int]:
    """The processor's target size: both sides multiples of `factor`, area within [min_pixels, max_pixels],
    aspect ratio kept as far as that allows."""
    if (ratio := max(height, width) / min(height, width)) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _settings(image_processor: Any, kw: dict) -> dict:
    s = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 1280, patch_size=14, temporal_patch_size=2, merge_size=2,
             image_mean=CLIP_MEAN, image_std=CLIP_STD, rescale_factor=1 / 255, resample=3)  # 3: PIL bicubic
    if image_processor is not None:
        size = image_processor.size
        get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
        s.update(min_pixels=get("shortest_edge") or s["min_pixels"], max_pixels=get("longest_edge") or s["max_pixels"])
        s.update({k: getattr(image_processor, k) for k in s if k not in ("min_pixels", "max_pixels")
                  and getattr(image_processor, k, None) is not None})
    unknown = set(kw) - set(s) - {"fps"}
    if unknown:
        raise ValueError(f"unknown video setting(s): {', '.join(sorted(unknown))}")
    return {**s, **kw}


def video_inputs(frames, image_processor: Any = None, *, fps: float = 2.0, **settings) -> dict[str, np.ndarray]:
    """One video's frames (uint8 [F, H, W, 3] or a list of [H, W, 3]) -> {pixel_values_videos [P, C*Tp*p*p],
    video_grid_thw int64 [1, 3], second_per_grid_ts float32 [1]}, as the reference video processor makes them.

    Every frame is resized (PIL bicubic) to `smart_resize` of the first frame's size under the image processor's
    min/max pixels (or `settings`: min_pixels, max_pixels, patch_size, temporal_patch_size, merge_size,
    image_mean, image_std), rescaled and normalised; the frame count is padded to a multiple of the temporal patch
    by repeating the last frame; `fps` (of the sampled frames) gives second_per_grid_ts = Tp / fps. Several
    videos: concatenate the rows and the grids of one call each."""
    from PIL import Image

    s = _settings(image_processor, settings)
    frames = [np.asarray(f) for f in frames]
    if not frames or any(f.ndim != 3 or f.shape[-1] != 3 or f.dtype != np.uint8 for f in frames):
        raise ValueError("frames must be uint8 RGB arrays [H, W, 3] (or one array [F, H, W, 3])")
    p, m, tp = s["patch_size"], s["merge_size"], s["temporal_patch_size"]
    h, w = smart_resize(*frames[0].shape[:2], factor=p * m, min_pixels=s["min_pixels"], max_pixels=s["max_pixels"])
    mean, std = np.asarray(s["image_mean"], np.float32), np.asarray(s["image_std"], np.float32)
    out = []
    for f in frames:
        x = np.asarray(Image.fromarray(f).resize((w, h), resample=s["resample"]))
        x = (x.astype(np.float64) * s["rescale_factor"]).astype(np.float32)  # as transformers rescales
        out.append(((x - mean[None, None]) / std[None, None]).transpose(2, 0, 1))  # [C, H, W]
    video = np.stack(out)
    if pad := -len(frames) % tp:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    gt, gh, gw, c = video.shape[0] // tp, h // p, w // p, video.shape[1]
    patches = video.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return {"pixel_values_videos": patches.reshape(gt * gh * gw, c * tp * p * p),
            "video_grid_thw": np.array([[gt, gh, gw]], np.int64),
            "second_per_grid_ts": np.array([tp / fps], np.float32)}


def _visual(cfg, name: str, pixels, grid_name: str, grid) -> tuple[np.ndarray | None, np.ndarray]:
    if (pixels is None) != (grid is None):
        raise ValueError(f"{name} and {grid_name} must be given together")
    if pixels is None:
        return None, np.zeros((0, 3), np.int64)
    px, g = np.asarray(pixels, np.float32), np.asarray(grid).astype(np.int64)
    m = cfg.vision.spatial_merge_size
    if g.ndim != 2 or g.shape[1] != 3 or (g <= 0).any() or (g[:, 1:] % m).any():
        raise ValueError(f"{grid_name} must be [n, 3] positive (t, h, w) with h, w multiples of {m}, got {g.tolist()}")
    if px.ndim != 2 or px.shape[1] != cfg.vision.patch_dim:
        raise ValueError(f"{name} must be [patches, {cfg.vision.patch_dim}], got {list(px.shape)}")
    if px.shape[0] != g.prod(-1).sum():
        raise ValueError(f"{name} has {px.shape[0]} rows but {grid_name} {g.tolist()} makes {g.prod(-1).sum()} patches")
    return px, g


def prepare(cfg, input_ids, attention_mask, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
            second_per_grid_ts, unexpected: dict) -> dict[str, Any]:
    """Checks a `Qwen25VL` call's inputs (one-line ValueErrors) and computes its host arrays: ids int32 [B, T],
    valid bool [B, T], pixels (image rows then video rows, or None) with the tower's `layout`, src int32 [B, T]
    (which feature each placeholder takes, -1 for text), and `rope_index`'s positions and deltas."""
    from sage_jax.models import qwen25_vision
    from sage_jax.models.causal_lm import token_batch

    unexpected = {k: v for k, v in unexpected.items() if k not in ("token_type_ids", "mm_token_type_ids")}
    if unexpected:
        raise ValueError(f"unexpected keyword argument(s) for Qwen2.5-VL: {', '.join(sorted(unexpected))}")
    ids, valid = token_batch(input_ids, attention_mask, cfg.text.vocab_size)
    img_px, img_g = _visual(cfg, "pixel_values", pixel_values, "image_grid_thw", image_grid_thw)
    vid_px, vid_g = _visual(cfg, "pixel_values_videos", pixel_values_videos, "video_grid_thw", video_grid_thw)
    u = cfg.vision.spatial_merge_size**2
    flat = ids.reshape(-1)
    src = np.full(flat.shape, -1, np.int64)
    offset = 0
    for what, token, g in (("image", cfg.image_token_id, img_g), ("video", cfg.video_token_id, vid_g)):
        at = np.flatnonzero(flat == token)
        n_feats = int(g.prod(-1).sum()) // u
        if at.size != n_feats:
            is_tok = ids == token
            runs = int((is_tok[:, 1:] & ~is_tok[:, :-1]).sum() + is_tok[:, 0].sum())
            raise ValueError(f"the prompt has {runs} {what} placeholder run(s) of {at.size} token(s) in all, but "
                             f"{len(g)} {what}(s) were given, making {n_feats} features (expand_placeholders "
                             f"repeats each placeholder to its feature count)")
        src[at] = offset + np.arange(at.size)
        offset += at.size
    if second_per_grid_ts is not None and np.asarray(second_per_grid_ts).size != len(vid_g):
        raise ValueError(f"second_per_grid_ts has {np.asarray(second_per_grid_ts).size} entries for {len(vid_g)} "
                         f"video(s)")
    positions, deltas = rope_index(cfg, ids, valid, img_g if len(img_g) else None, vid_g if len(vid_g) else None,
                                   second_per_grid_ts)
    grids = np.concatenate([img_g, vid_g])
    pixels = [p for p in (img_px, vid_px) if p is not None]
    return {"ids": ids.astype(np.int32), "valid": valid, "src": src.reshape(ids.shape).astype(np.int32),
            "pixels": np.concatenate(pixels) if pixels else None,
            "lay": qwen25_vision.layout(cfg.vision, grids) if pixels else None,
            "positions": positions, "deltas": deltas}
