"""Reading images and video frames from files, with one-line errors for what a user can get wrong.

Video containers (mp4, webm) need a decoder library that this project does not depend on; a video is given as an
animated GIF / WebP / APNG, a directory of frame images (sorted by name), or a `.npy` array [F, H, W, 3] uint8.
"""

from __future__ import annotations

import os

import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".ppm")


def load_image(path: str | os.PathLike):
    """An RGB `PIL.Image`, fully decoded (a truncated file fails here, not inside a processor)."""
    from PIL import Image, UnidentifiedImageError

    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder, not an image file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such image file: {path}")
    try:
        with Image.open(path) as im:
            im.load()
            return im.convert("RGB")
    except UnidentifiedImageError:
        raise ValueError(f"{path} is not an image file this library can read") from None
    except Image.DecompressionBombError:  # PIL's guard against a small file that decodes to gigabytes
        raise ValueError(f"{path} is too large an image (over {Image.MAX_IMAGE_PIXELS:,} pixels)") from None
    except (OSError, SyntaxError) as e:  # PIL reports truncated or corrupt data as OSError / SyntaxError
        raise ValueError(f"{path} is not a readable image ({e})") from None


def load_frames(path: str | os.PathLike) -> np.ndarray:
    """Video frames uint8 [F, H, W, 3] from an animated image, a directory of frame images or a .npy array."""
    from PIL import Image, ImageSequence, UnidentifiedImageError

    path = os.fspath(path)
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.lower().endswith(IMAGE_SUFFIXES))
        if not files:
            raise ValueError(f"{path} holds no frame images ({', '.join(IMAGE_SUFFIXES)})")
        frames = [np.asarray(load_image(os.path.join(path, f))) for f in files]
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"no such video file or frame directory: {path}")
    elif path.endswith(".npy"):
        try:  # mapped, not read: the header's shape and dtype are checked before anything is allocated
            frames = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:  # a bad header, or a header that claims more data than the file holds
            raise ValueError(f"{path} is not a readable .npy array ({e})") from None
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise ValueError(f"{path} holds {frames.dtype} {frames.shape}; frames must be uint8 [F, H, W, 3]")
        if not frames.size:
            raise ValueError(f"{path} holds no frames ({frames.shape})")
        return np.array(frames)
    else:
        try:
            with Image.open(path) as im:
                frames = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(im)]
        except UnidentifiedImageError:
            raise ValueError(f"{path} is not a video this library can read (an animated GIF / WebP / PNG, a "
                             f"directory of frames or a .npy array; mp4 needs decoding to frames first)") from None
        except (OSError, SyntaxError) as e:
            raise ValueError(f"{path} is not a readable video ({e})") from None
    if not frames:
        raise ValueError(f"{path} holds no frames")
    if len({f.shape for f in frames}) != 1:
        raise ValueError(f"the frames of {path} differ in size")
    return np.stack(frames)
