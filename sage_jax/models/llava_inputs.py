"""Host-side inputs of LLaVA-OneVision: checking what a processor returns, and doing the processor's two jobs that
need torchvision in transformers (expanding the `<image>` / `<video>` placeholders, preparing video frames).

`prepare` turns `model(**inputs)` keywords into a `Batch`: the static `Plan` (every image's `anyres.ImageLayout`,
the number of videos) that keys one compilation, and the arrays the jitted function reads. `cfg` is always the
model's `llava_onevision.LlavaOnevisionConfig` (this module sits below the model, which imports it).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from sage_jax.models import anyres
from sage_jax.models.causal_lm import token_batch

# Keywords a processor returns that the model reads elsewhere or does not need.
_IGNORED = ("token_type_ids", "image_sizes_videos")
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything shape-deciding about a batch's visual inputs (a static jit argument)."""

    images: tuple[anyres.ImageLayout, ...] = ()
    videos: int = 0


@dataclasses.dataclass(frozen=True)
class Batch:
    plan: Plan
    tokens: np.ndarray  # [B, T] int32
    valid: np.ndarray  # [B, T] bool
    positions: np.ndarray  # [B, T] int32
    tiles: np.ndarray | None = None  # [M, C, S, S] float32: the tiles the images use, in order
    frames: np.ndarray | None = None  # [Nv * F, C, S, S] float32
    image_slots: np.ndarray | None = None  # flat indices into B*T of the <image> tokens, row-major
    video_slots: np.ndarray | None = None

    def arrays(self) -> tuple:
        return self.tokens, self.tiles, self.frames, self.image_slots, self.video_slots


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _give(n: int, word: str) -> str:
    return f"the {_plural(n, word)} give" + ("s" if n == 1 else "")


def prepare(cfg, input_ids, attention_mask, pixel_values, image_sizes, pixel_values_videos,
            kw: dict[str, Any]) -> Batch:
    batch_num_images = kw.pop("batch_num_images", None)
    for name in _IGNORED:
        kw.pop(name, None)
    if kw:
        raise ValueError(f"unexpected keyword argument(s) for LLaVA-OneVision: {', '.join(sorted(kw))}")
    tokens, valid = token_batch(input_ids, attention_mask, cfg.text.vocab_size)
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
    flat = tokens.reshape(-1)
    image_slots = np.flatnonzero(flat == cfg.image_token_id).astype(np.int32)
    video_slots = np.flatnonzero(flat == cfg.video_token_id).astype(np.int32)

    layouts, tiles = _images(cfg, pixel_values, image_sizes, batch_num_images)
    n_feat = sum(lay.num_features(cfg.base_tokens) for lay in layouts)
    if len(image_slots) != n_feat:
        raise ValueError(f"the prompt has {len(image_slots)} <image> tokens but {_give(len(layouts), 'image')} "
                         f"{n_feat} features")
    n_videos, frames = _videos(cfg, pixel_values_videos)
    n_vfeat = n_videos and n_videos * anyres.video_features(len(frames) // n_videos, cfg.vision.grid)
    if len(video_slots) != n_vfeat:
        raise ValueError(f"the prompt has {len(video_slots)} <video> tokens but {_give(n_videos, 'video')} "
                         f"{n_vfeat} features")
    return Batch(plan=Plan(images=layouts, videos=n_videos), tokens=tokens.astype(np.int32), valid=valid,
                 positions=positions, tiles=tiles, frames=frames,
                 image_slots=image_slots if layouts else None, video_slots=video_slots if n_videos else None)


def _check_tile(cfg, shape: tuple[int, ...], what: str) -> None:
    s, c = cfg.vision.image_size, cfg.vision.num_channels
    if tuple(shape) != (c, s, s):
        raise ValueError(f"{what} has tiles of shape {list(shape)}, the vision tower takes [{c}, {s}, {s}]")


def _images(cfg, pixel_values, image_sizes, batch_num_images):
    if pixel_values is None:
        if image_sizes is not None:
            raise ValueError("image_sizes given without pixel_values")
        return (), None
    if image_sizes is None:
        raise ValueError("pixel_values given without image_sizes")
    pv = np.asarray(pixel_values, np.float32)
    sizes = np.asarray(image_sizes).reshape(-1, 2) if np.size(image_sizes) else np.zeros((0, 2), int)
    layouts = anyres.image_layouts(sizes, cfg.image_grid_pinpoints, cfg.vision.image_size, cfg.vision.grid,
                                   cfg.vision_aspect_ratio,
                                   None if batch_num_images is None else np.asarray(batch_num_images).reshape(-1))
    if cfg.vision_feature_select_strategy == "default" and any(lay.rows for lay in layouts):
        raise ValueError("anyres tiles need vision_feature_select_strategy 'full' (SigLIP has no CLS token): the "
                         "number of patches is not consistent with the image size")
    need = [lay.tiles for lay in layouts]
    if pv.ndim == 5:
        if pv.shape[0] != len(sizes):
            raise ValueError(f"pixel_values has {pv.shape[0]} images, image_sizes {len(sizes)}")
        short = [i for i, n in enumerate(need) if pv.shape[1] < n]
        if short:
            i = short[0]
            raise ValueError(f"pixel_values has {pv.shape[1]} tiles per image, image {i} of size "
                             f"{tuple(int(x) for x in sizes[i])} needs {need[i]}")
        _check_tile(cfg, pv.shape[2:], "pixel_values")
        tiles = np.concatenate([pv[i, :n] for i, n in enumerate(need)])
    elif pv.ndim == 4:
        if pv.shape[0] != sum(need):
            raise ValueError(f"pixel_values has {pv.shape[0]} tiles, image_sizes need {sum(need)}")
        _check_tile(cfg, pv.shape[1:], "pixel_values")
        tiles = pv
    else:
        raise ValueError(f"pixel_values must be [images, tiles, C, H, W] or [tiles, C, H, W], got {list(pv.shape)}")
    return layouts, tiles


def _videos(cfg, pixel_values_videos):
    if pixel_values_videos is None:
        return 0, None
    pv = np.asarray(pixel_values_videos, np.float32)
    if pv.ndim != 5 or pv.shape[1] == 0:
        raise ValueError(f"pixel_values_videos must be [videos, frames, C, H, W], got {list(pv.shape)}")
    _check_tile(cfg, pv.shape[2:], "pixel_values_videos")
    if cfg.vision_feature_select_strategy == "default":  # transformers fails here too (its 2x pooling `view`)
        raise ValueError("videos need vision_feature_select_strategy 'full': pooling needs every patch of a frame")
    return pv.shape[0], pv.reshape(-1, *pv.shape[2:])


# --------------------------------------------------------------------------------------------- processor helpers


def expand_placeholders(cfg, prompts: Sequence, image_sizes=None, video_frames=None,
                        batch_num_images: Sequence[int] | None = None, image_token: str = "<image>",
                        video_token: str = "<video>") -> list:
    """What the processor does to the text: each image placeholder (the `image_token` string in a str prompt, the
    id `cfg.image_token_id` in a list of ids) repeated into its image's feature count, images taken in order over
    the batch; each video placeholder into its video's count (`video_frames`: frames per video, or one int for
    all). Returns the prompts in the form given."""
    sizes = np.zeros((0, 2), int) if image_sizes is None else np.asarray(image_sizes).reshape(-1, 2)
    layouts = anyres.image_layouts(sizes, cfg.image_grid_pinpoints, cfg.vision.image_size, cfg.vision.grid,
                                   cfg.vision_aspect_ratio, batch_num_images)
    image_counts = [lay.num_features(cfg.base_tokens) for lay in layouts]
    if isinstance(video_frames, int):  # every video has that many frames
        video_counts, videos = None, itertools.repeat(anyres.video_features(video_frames, cfg.vision.grid))
    else:
        video_counts = [anyres.video_features(f, cfg.vision.grid) for f in video_frames or ()]
        videos = iter(video_counts)
    images = iter(image_counts)

    def take(it, what, given):
        try:
            return next(it)
        except StopIteration:
            raise ValueError(f"the prompts have more {what} placeholders than the {_plural(len(given), what)} "
                             f"given") from None

    out = []
    for p in prompts:
        if isinstance(p, str):
            pieces = []
            for i, chunk in enumerate(p.split(image_token)):
                if i:
                    pieces.append(image_token * take(images, "image", image_counts))
                vparts = chunk.split(video_token)
                pieces.append(vparts[0] + "".join(video_token * take(videos, "video", video_counts) + rest
                                                  for rest in vparts[1:]))
            out.append("".join(pieces))
        else:
            ids = []
            for x in p:
                x = int(x)
                n = (take(images, "image", image_counts) if x == cfg.image_token_id
                     else take(videos, "video", video_counts) if x == cfg.video_token_id else 1)
                ids += [x] * n
            out.append(ids)
    if next(images, None) is not None or (video_counts is not None and next(videos, None) is not None):
        raise ValueError(f"the prompts have fewer placeholders than the {len(image_counts)} images and "
                         f"{len(video_counts or ())} videos given")
    return out


def video_inputs(frames: np.ndarray, image_processor=None, *, size: tuple[int, int] | None = None,
                 image_mean: Sequence[float] | None = None, image_std: Sequence[float] | None = None,
                 rescale_factor: float | None = None) -> np.ndarray:
    """uint8 frames [F, H, W, 3] -> pixel_values_videos [1, F, 3, h, w] float32: each frame resized to the
    processor's `size` (bicubic, no anyres tiling), rescaled and normalized, as `LlavaOnevisionVideoProcessor` does
    (with PIL's bicubic resize, the image processor's base-tile path, rather than torchvision's). Settings come from
    `image_processor` (any object with `size`, `image_mean`, `image_std`, `rescale_factor`) or the keywords
    (defaults: 384 x 384, OpenAI CLIP mean/std, 1/255)."""
    from PIL import Image

    def setting(name, given, default):
        if given is not None:
            return given
        value = getattr(image_processor, name, None)
        return default if value is None else value

    sz = setting("size", size, (384, 384))
    if not isinstance(sz, tuple | list):
        sz = (sz["height"], sz["width"]) if isinstance(sz, dict) else (sz.height, sz.width)
    mean = np.asarray(setting("image_mean", image_mean, OPENAI_CLIP_MEAN), np.float32)
    std = np.asarray(setting("image_std", image_std, OPENAI_CLIP_STD), np.float32)
    scale = setting("rescale_factor", rescale_factor, 1 / 255)
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    h, w = int(sz[0]), int(sz[1])
    out = []
    for f in frames:
        img = Image.fromarray(f).resize((w, h), resample=Image.Resampling.BICUBIC)
        x = (np.asarray(img).astype(np.float64) * scale).astype(np.float32)  # as transformers' `rescale`
        out.append(((x - mean) / std).transpose(2, 0, 1))
    return np.stack(out)[None].astype(np.float32)
