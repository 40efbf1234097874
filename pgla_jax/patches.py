"""Colour patches cut from scikit-image's bundled photos (CC0 / public domain): the CIFAR-shaped private images of
the colour victim, and the attacker's own surrogate patches of other photos."""

from __future__ import annotations

import numpy as np

from configs.datasets import ImageSet

#: scikit-image's bundled colour photos (CC0 / public domain) used for CIFAR-shaped patches.
SKIMAGE_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry")


def _downsampled(im: np.ndarray) -> np.ndarray:
    # 4× box-downsampled, so that a 32×32 patch holds structure rather than flat texture.
    im = np.asarray(im, np.float32)[..., :3] / 255.0
    h, w = (im.shape[0] // 4) * 4, (im.shape[1] // 4) * 4
    return im[:h, :w].reshape(h // 4, 4, w // 4, 4, 3).mean(axis=(1, 3))


def _patches(photos, labels, size: int, rng) -> np.ndarray:
    out = np.empty((len(labels), size, size, 3), np.float32)
    for i, lab in enumerate(labels):
        p = photos[lab % len(photos)]
        r, c = rng.integers(0, p.shape[0] - size + 1), rng.integers(0, p.shape[1] - size + 1)
        out[i] = p[r : r + size, c : c + size]
    return out


def skimage_patches(n: int = 256, size: int = 32, seed: int = 0) -> ImageSet:
    """Colour `size`×`size` patches cut from scikit-image's photos (`SKIMAGE_PHOTOS`), 4× box-downsampled first.
    The label is the photo index (there are no semantic classes)."""
    import skimage.data

    rng = np.random.default_rng(seed)
    photos = [_downsampled(getattr(skimage.data, name)()) for name in SKIMAGE_PHOTOS]
    labels = rng.integers(0, len(photos), n).astype(np.int32)
    return ImageSet(_patches(photos, labels, size, rng), labels, len(photos), "skimage_patches")


def surrogate_patches(n: int = 4096, size: int = 32, seed: int = 0, num_classes: int = 10) -> ImageSet:
    """The attacker's own colour data for the colour victim's denoiser: patches like `skimage_patches`, but of
    other photos (scikit-image's retina and stereo pair, scikit-learn's two sample images), so none of the private
    photos is seen. Labels are uniform over `num_classes` (the victim's), so every label's gradients are covered."""
    import skimage.data
    from sklearn.datasets import load_sample_images

    left, right, _ = skimage.data.stereo_motorcycle()
    photos = [_downsampled(im) for im in (skimage.data.retina(), left, right, *load_sample_images().images)]
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, n).astype(np.int32)
    which = rng.integers(0, len(photos), n)
    return ImageSet(_patches(photos, which, size, rng), labels, num_classes, "surrogate_patches")
