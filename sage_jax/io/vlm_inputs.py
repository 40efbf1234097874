"""One prompt with its images and videos -> the keyword arrays a VLM takes (what the transformers processors
would return, built without torchvision): chat template, image processor, video frames, placeholder expansion,
tokenization. `VisionLM.inputs` calls it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

# The placeholder each family's chat template writes for one image / video, and the token the processor repeats.
_QWEN = {"image": "<|vision_start|><|image_pad|><|vision_end|>", "video": "<|vision_start|><|video_pad|><|vision_end|>"}
_LLAVA = {"image": "<image>", "video": "<video>"}


def _messages(prompt: str | Sequence[dict], n_images: int, n_videos: int) -> list[dict]:
    if not isinstance(prompt, str):
        return list(prompt)
    content = [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos + [{"type": "text", "text": prompt}]
    return [{"role": "user", "content": content}]


def _text(tokenizer, messages: list[dict], marks: dict[str, str]) -> str:
    """The chat-templated prompt; without a template, the placeholders then the text of each message."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    parts = []
    for m in messages:
        content = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
        parts += [marks[c["type"]] if c["type"] in marks else c.get("text", "") for c in content]
    return "".join(parts)


def _load_images(images: Sequence) -> list:
    from sage_jax.io.images import load_image

    return [load_image(im) if isinstance(im, str | os.PathLike) else im for im in images]


def _load_videos(videos: Sequence) -> list[np.ndarray]:
    from sage_jax.io.images import load_frames

    return [load_frames(v) if isinstance(v, str | os.PathLike) else np.asarray(v) for v in videos]


def _processed(image_processor, images: list) -> dict[str, np.ndarray]:
    if not images:
        return {}
    try:
        return dict(image_processor(images=images, return_tensors="np"))
    except ValueError as e:  # e.g. an image smaller than a patch, or an extreme aspect ratio
        raise ValueError(f"the image processor cannot take these images: {str(e).splitlines()[0]}") from None


def prepare(model, prompt: str | Sequence[dict], images: Sequence = (), videos: Sequence = ()) -> dict[str, Any]:
    """`model`: a `VisionLM` (config, tokenizer, image_processor). Returns numpy arrays for `model(**inputs)`."""
    if len(videos) and not model.supports_video:
        raise ValueError(f"{model.source or 'this model'} takes images only, not videos")
    images, videos = _load_images(images), _load_videos(videos)
    messages = _messages(prompt, len(images), len(videos))
    cfg, tok, ip = model.config, model.tokenizer, model.image_processor
    out = _processed(ip, images)
    if model.architecture == "qwen2_5_vl":
        from sage_jax.models import qwen25_inputs

        text = _text(tok, messages, _QWEN)
        vids = [qwen25_inputs.video_inputs(v, ip) for v in videos]
        if vids:
            out["pixel_values_videos"] = np.concatenate([v["pixel_values_videos"] for v in vids])
            out["video_grid_thw"] = np.concatenate([v["video_grid_thw"] for v in vids])
            out["second_per_grid_ts"] = np.concatenate([v["second_per_grid_ts"] for v in vids])
        text = qwen25_inputs.expand_placeholders(text, out.get("image_grid_thw"), out.get("video_grid_thw"),
                                                 merge_size=cfg.vision.spatial_merge_size)
    else:
        from sage_jax.models import llava_inputs

        text = _text(tok, messages, _LLAVA)
        if videos:
            if len({v.shape[0] for v in videos}) != 1:
                raise ValueError("the videos of one prompt must have the same number of frames")
            out["pixel_values_videos"] = np.concatenate([llava_inputs.video_inputs(v, ip) for v in videos])
        text = llava_inputs.expand_placeholders(cfg, [text], out.get("image_sizes"),
                                                [len(v) for v in videos])[0]
        out.pop("batch_num_images", None)
    enc = tok([text], return_tensors="np")
    out.update(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
    if model.architecture == "qwen2_5_vl":  # what transformers' Qwen2.5-VL processor adds (its M-RoPE reads it)
        ids = enc["input_ids"]
        out["mm_token_type_ids"] = ((ids == cfg.image_token_id) + 2 * (ids == cfg.video_token_id)).astype(np.int64)
    return out
