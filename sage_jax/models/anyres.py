"""Host-side shapes of LLaVA-OneVision's "anyres" image features, computed from `image_sizes` alone.

An image becomes a base tile (the whole image resized to one tile) plus a grid of tiles cut from the image resized
into the best-fitting `image_grid_pinpoints` resolution. Its features are the base tile's P tokens, then the grid's
feature map (rows*g x cols*g, g = patches per tile side) with the letterbox padding cropped away ("unpad"),
bilinearly shrunk when it holds more than `anyres_max_N` tiles' worth (by more than 10%), one `image_newline`
appended to every row. Everything here follows transformers' `modeling_llava_onevision.py` line by line, so the
counts match its `pack_image_features` (and its processor's `_get_number_of_features`); the device then runs
static slices and two small matmuls per image (`bilinear_matrix`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np


def select_best_resolution(size_hw: Sequence[int], pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The pinpoint (h, w) keeping the most of the image's pixels, then wasting the fewest (transformers' rule)."""
    oh, ow = (int(s) for s in size_hw)
    best, max_eff, min_waste = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / ow, h / oh)
        eff = min(int(ow * scale) * int(oh * scale), ow * oh)
        waste = w * h - eff
        if eff > max_eff or (eff == max_eff and waste < min_waste):
            best, max_eff, min_waste = (int(h), int(w)), eff, waste
    if best is None:
        raise ValueError(f"no grid pinpoint fits an image of size {tuple(size_hw)}")
    return best


def grid_shape(size_hw: Sequence[int], pinpoints: Sequence[Sequence[int]], tile: int) -> tuple[int, int]:
    """(rows, cols) of tiles of side `tile` for an image of size (h, w)."""
    h, w = select_best_resolution(size_hw, pinpoints)
    return h // tile, w // tile


def num_tiles(size_hw: Sequence[int], pinpoints: Sequence[Sequence[int]], tile: int) -> int:
    """Tiles the processor cuts for one image: the grid (ceil division, as its loop counts) and the base tile."""
    h, w = select_best_resolution(size_hw, pinpoints)
    return len(range(0, h, tile)) * len(range(0, w, tile)) + 1


def max_tiles(aspect: str) -> int:
    """N of "anyres_max_N" (transformers' `strip("anyres_max_")`, which drops those characters at both ends)."""
    return int(aspect.strip("anyres_max_"))  # noqa: B005 (transformers' own parsing, kept exactly)


@dataclasses.dataclass(frozen=True)
class ImageLayout:
    """How one image's tiles become its features (hashable: part of a jit's static arguments).

    tiles: tiles it takes from pixel_values (1 when not patched: base tile only).  rows, cols: the grid (0 if none).
    crop: (top, bottom, left, right) of the rows*g x cols*g feature map kept after unpadding.
    out_hw: the kept map's (h, w) after the anyres_max downscale (the crop's size when none).
    """

    tiles: int
    rows: int = 0
    cols: int = 0
    crop: tuple[int, int, int, int] = (0, 0, 0, 0)
    out_hw: tuple[int, int] = (0, 0)

    @property
    def resized(self) -> bool:
        top, bottom, left, right = self.crop
        return self.out_hw != (bottom - top, right - left)

    def num_features(self, base_tokens: int) -> int:
        """The base tile's tokens, then the (downscaled) map with one newline per row; or base + one newline."""
        if self.rows == 0:
            return base_tokens + 1
        h, w = self.out_hw
        return base_tokens + h * (w + 1)


def unpad_crop(map_hw: tuple[int, int], size_hw: Sequence[int]) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of a feature map of the padded resize of an image of `size_hw` that holds the
    image itself (transformers' `unpad_image`, including its `round(., 7)`)."""
    ch, cw = map_hw
    oh, ow = (int(s) for s in size_hw)
    if ow / oh > cw / ch:
        new_h = int(round(oh * (cw / ow), 7))
        pad = (ch - new_h) // 2
        return pad, ch - pad, 0, cw
    new_w = int(round(ow * (ch / oh), 7))
    pad = (cw - new_w) // 2
    return 0, ch, pad, cw - pad


def image_layout(size_hw: Sequence[int], pinpoints: Sequence[Sequence[int]], image_size: int, grid: int,
                 aspect: str, patched: bool = True) -> ImageLayout:
    """The layout of one image of size (h, w); `patched=False` for images of a multi-image sample (base only)."""
    if not patched:
        return ImageLayout(tiles=1)
    rows, cols = grid_shape(size_hw, pinpoints, image_size)
    tiles = num_tiles(size_hw, pinpoints, image_size)
    if tiles != rows * cols + 1:
        raise ValueError(f"grid pinpoints {tuple(map(tuple, pinpoints))} are not multiples of the tile size "
                         f"{image_size}")
    top, bottom, left, right = unpad_crop((rows * grid, cols * grid), size_hw)
    h, w = bottom - top, right - left
    ratio = math.sqrt(h * w / (max_tiles(aspect) * grid**2))
    out = (int(h // ratio), int(w // ratio)) if ratio > 1.1 else (h, w)
    return ImageLayout(tiles=tiles, rows=rows, cols=cols, crop=(top, bottom, left, right), out_hw=out)


def image_layouts(image_sizes: np.ndarray, pinpoints, image_size: int, grid: int, aspect: str,
                  batch_num_images: Sequence[int] | None = None) -> tuple[ImageLayout, ...]:
    """Every image's layout. As in transformers, images of a sample with several images are not patched, and
    without `batch_num_images` every image is."""
    n = len(image_sizes)
    patched = [True] * n if batch_num_images is None else [k == 1 for k in batch_num_images for _ in range(k)]
    if len(patched) != n:
        raise ValueError(f"batch_num_images {list(batch_num_images)} counts {len(patched)} images, image_sizes has {n}")
    return tuple(image_layout(s, pinpoints, image_size, grid, aspect, p) for s, p in zip(image_sizes, patched,
                                                                                         strict=True))


def pooled_side(grid: int) -> int:
    """Video frames are pooled 2x (bilinear to ceil(g / 2) per side, transformers' `apply_pooling`)."""
    return math.ceil(grid / 2)


def video_features(frames: int, grid: int) -> int:
    """Features of one video: each frame's pooled map, then one newline for the whole video."""
    return frames * pooled_side(grid) ** 2 + 1


def bilinear_matrix(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] weights of torch `F.interpolate(mode="bilinear", align_corners=False, size=...)` along one
    axis: source coordinate (i + 0.5) * n_in / n_out - 0.5 clamped at 0, linear between its two neighbours."""
    # torch computes the coordinate in float32 and truncates it toward zero
    scale = np.float32(n_in / n_out)
    src = np.maximum((np.arange(n_out, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5), 0)
    i0 = src.astype(np.int64)
    i1 = np.minimum(i0 + 1, n_in - 1)
    frac = (src - i0).astype(np.float64)
    w = np.zeros((n_out, n_in), np.float64)
    np.add.at(w, (np.arange(n_out), i0), 1.0 - frac)
    np.add.at(w, (np.arange(n_out), i1), frac)
    return w.astype(np.float32)
