"""Host side of multimodal decoding: a batch of prompts with images and videos -> the token ids `Engine` buckets
and the `visual_pruning.Media` arrays of one left-padded batch.

Each prompt is embedded on its own (its vision tower call compiles once per image geometry, as in transformers),
padded to the batch's prompt bucket so that the tower's splice compiles once per bucket; the decoding loops then
see only arrays of the bucket's shape, whatever the number and sizes of the images.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from sage_jax.decoding import visual_pruning as vp

_TEXT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


@dataclasses.dataclass
class VisionPrompts:
    """Prompts ready for a vision-language target.

    Attributes: items: the processor outputs of each prompt (keyword arrays, batch 1); ids: their token ids;
    kinds: `visual_pruning` TEXT / IMAGE / VIDEO per token; n_visual: [B, 2] image and video tokens per prompt.
    """

    items: list[dict[str, Any]]
    ids: list[list[int]]
    kinds: list[np.ndarray]

    @property
    def n_visual(self) -> np.ndarray:
        return np.asarray([[(k == vp.IMAGE).sum(), (k == vp.VIDEO).sum()] for k in self.kinds], np.int64)


def _ids_of(item: dict) -> list[int]:
    ids = np.asarray(item["input_ids"])
    if ids.ndim == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"a prompt's processor outputs must hold one prompt, got input_ids {list(ids.shape)}")
        ids = ids[0]
    mask = item.get("attention_mask")
    if mask is not None:
        ids = ids[np.asarray(mask).reshape(-1).astype(bool)]
    return [int(t) for t in ids]


def prepare(vlm, prompts: Sequence, images: Sequence | None, videos: Sequence | None) -> VisionPrompts:
    """`prompts`: strings (a user message, chat-templated with `images[i]` / `videos[i]`), processor-output dicts
    (`VisionLM.inputs`) or token ids; `images` / `videos`: one sequence per prompt (or None). The same prompt
    object given several times is prepared once."""
    n = len(prompts)
    images = [()] * n if images is None else list(images)
    videos = [()] * n if videos is None else list(videos)
    if len(images) != n or len(videos) != n:
        raise ValueError(f"images and videos need one list per prompt: {n} prompts, {len(images)} image lists, "
                         f"{len(videos)} video lists")
    memo: dict[tuple, dict] = {}
    items = []
    for p, im, vi in zip(prompts, images, videos, strict=True):
        key = (p if isinstance(p, str) else id(p), id(im), id(vi))
        if key not in memo:
            if isinstance(p, dict):
                if len(im) or len(vi):
                    raise ValueError("a prompt given as processor outputs already holds its images; pass none")
                memo[key] = p
            elif isinstance(p, str):
                memo[key] = vlm.inputs(p, images=im, videos=vi)
            else:
                if len(im) or len(vi):
                    raise ValueError("a prompt given as token ids cannot take images; give its text instead")
                memo[key] = {"input_ids": np.asarray([[int(t) for t in p]], np.int64)}
        items.append(memo[key])
    ids = [_ids_of(x) for x in items]
    if any(not i for i in ids):
        raise ValueError("every prompt needs at least one token")
    cfg = vlm.config
    video_id = getattr(cfg, "video_token_id", None)
    kinds = [vp.kinds_of(np.asarray(i), cfg.image_token_id, -1 if video_id is None else video_id) for i in ids]
    return VisionPrompts(items=items, ids=ids, kinds=kinds)


def draft_lengths(prompts: VisionPrompts, ratios: tuple[float, float]) -> tuple[np.ndarray, list[int]]:
    """Per prompt, the image and video tokens the draft keeps ([B, 2]) and the draft's prompt length."""
    keep = np.asarray([vp.keep_counts(int(i), int(v), ratios) for i, v in prompts.n_visual], np.int32)
    lens = [len(ids) - int(n.sum()) + int(k.sum()) for ids, n, k in zip(prompts.ids, prompts.n_visual, keep)]
    return keep, lens


def media(vlm, draft_vlm, prompts: VisionPrompts, width: int, pad_id: int, keep: np.ndarray) -> vp.Media:
    """The `Media` of the batch, left-padded to `width` slots: the target's embeddings (and a draft VLM's own)."""
    memo: dict[int, tuple] = {}
    rows = []
    for item, ids in zip(prompts.items, prompts.ids, strict=True):
        if id(item) not in memo:
            padded = {k: v for k, v in item.items() if k not in _TEXT_KEYS}
            n = len(ids)
            padded["input_ids"] = np.full((1, width), pad_id, np.int64)
            padded["input_ids"][0, width - n:] = ids
            padded["attention_mask"] = (np.arange(width) >= width - n)[None].astype(np.int64)
            emb, pos, delta = vlm.embed(**padded)
            emb_d = None
            if draft_vlm is not None:
                try:
                    emb_d = draft_vlm.embed(**padded)[0]
                except ValueError as e:
                    raise ValueError(f"the draft VLM cannot take the target's visual inputs: {e}") from None
            memo[id(item)] = (emb, pos, delta, emb_d)
        rows.append(memo[id(item)])
    kind = np.zeros((len(rows), width), np.int32)
    for i, k in enumerate(prompts.kinds):
        kind[i, width - len(k):] = k
    cat = lambda j: jnp.concatenate([r[j] for r in rows], 0)  # noqa: E731
    return vp.Media(embeddings=cat(0), positions=cat(1).astype(jnp.int32),
                    delta=jnp.asarray(np.concatenate([np.asarray(r[2]).reshape(-1) for r in rows]), jnp.int32),
                    kind=jnp.asarray(kind), keep=jnp.asarray(keep, jnp.int32),
                    draft_embeddings=cat(3) if draft_vlm is not None else None)


def ratios(r: float | tuple[float, float]) -> tuple[float, float]:
    """A pruning ratio (both kinds) or (image, video) ratios, checked."""
    pair = (float(r), float(r)) if isinstance(r, int | float) else tuple(float(x) for x in r)
    if len(pair) != 2 or not all(0.0 <= x <= 1.0 for x in pair):
        raise ValueError(f"a pruning ratio must lie in [0, 1] (one value, or image and video), got {r}")
    return pair


# Fields a draft VLM's vision inputs must share with its target's, per architecture: the draft's tower then takes
# the target's pixel arrays and makes as many visual tokens.
_GEOMETRY = {
    "qwen2_5_vl": lambda c: (c.image_token_id, c.video_token_id, c.vision.patch_size, c.vision.temporal_patch_size,
                             c.vision.spatial_merge_size),
    "llava_onevision": lambda c: (c.image_token_id, c.video_token_id, c.vision.image_size, c.vision.patch_size,
                                  c.image_grid_pinpoints, c.vision_aspect_ratio, c.vision_feature_select_strategy),
}


def check_pair(target, draft) -> None:
    """ValueError unless a vision-language target's (`VisionLM` or None) draft can read its prompts (and a text
    target's draft is not a VLM)."""
    from sage_jax.io.vision_lm import VisionLM
    from sage_jax.models.causal_lm import CausalLM
    from sage_jax.models.decoder import Decoder

    if target is None:
        if isinstance(draft, VisionLM):
            raise ValueError("a vision-language draft needs a vision-language target")
        return
    if isinstance(draft, CausalLM | Decoder):
        raise ValueError("a vision-language target needs a draft that reads its images: a smaller VLM of its "
                         "family, an EAGLE-style head or a self-draft (not a text LM)")
    if isinstance(draft, VisionLM):
        if draft.architecture != target.architecture:
            raise ValueError(f"the draft VLM is {draft.architecture}, the target {target.architecture}: a VLM draft "
                             f"must be of the target's family")
        geo = _GEOMETRY[target.architecture]
        if geo(draft.config) != geo(target.config):
            raise ValueError("the draft VLM's vision inputs differ from the target's (patch size, merge size, "
                             "placeholder tokens or tiling): its tower cannot read the target's images")
