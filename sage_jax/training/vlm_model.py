"""The pieces of the home-trained VLM around its weights: config, tokenizer, image processor, fast pixel path.

- **Config**: LLaVA-OneVision with SmolLM2-135M-Instruct as its language model, one 28x28 tile of 4x4 patches: a
  28x28 image gives the base tile's 16 tokens and the 4x4 grid with a newline per row (20), 36 visual tokens; a
  video frame its 4x4 map pooled to 2x2 (4 tokens), and one newline closes the video (a model trained with a
  video stage has `video_token_id`; one without takes images only).
- **Tokenizer**: SmolLM2's, with its unused special tokens 16 (`<empty_output>`) and 15 (`<jupyter_script>`)
  renamed `<image>` and `<video>`, so every id and the vocabulary size stay the target's (the shipped EAGLE head
  and any text draft still fit); the chat template is SmolLM2's, extended to content lists (`{"type": "image"}`
  writes `<image>\\n`, `{"type": "video"}` `<video>\\n` before the text).
- **Image processor**: transformers' `LlavaOnevisionImageProcessorPil` at 28x28 with the single pinpoint
  (28, 28); `pixels` is the same computation for images already 28x28 (asserted against the processor in
  `tests/sage_jax/training/test_vlm_stages.py`), used by training.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from sage_jax.io import loader
from sage_jax.models import anyres, serving_lm
from sage_jax.models.config import LMConfig
from sage_jax.models.llava_inputs import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, Plan, expand_placeholders
from sage_jax.models.llava_onevision import LlavaOnevisionConfig
from sage_jax.models.siglip import SiglipConfig
from sage_jax.training import vlm_data
from sage_jax.training.vlm_recipe import VLMRecipe

IMAGE_TOKEN_ID = 16
IMAGE_TOKEN = "<image>"
VIDEO_TOKEN_ID = 15
VIDEO_TOKEN = "<video>"
TILE = 28
_RENAMED = {IMAGE_TOKEN_ID: ("<empty_output>", IMAGE_TOKEN), VIDEO_TOKEN_ID: ("<jupyter_script>", VIDEO_TOKEN)}
_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + _SYSTEM + "<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}{% if c['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif c['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def config(text: LMConfig, vision: SiglipConfig, video: bool = False) -> LlavaOnevisionConfig:
    """The VLM's config; `video`: whether it takes videos (it was trained on clips)."""
    if vision.image_size != TILE:
        raise ValueError(f"the home-trained VLM takes {TILE}-pixel tiles, got image_size {vision.image_size}")
    return LlavaOnevisionConfig(text=text, vision=vision, image_token_id=IMAGE_TOKEN_ID,
                                video_token_id=VIDEO_TOKEN_ID if video else None,
                                vision_feature_layer=-1, vision_feature_select_strategy="full",
                                image_grid_pinpoints=((TILE, TILE),), projector_act="gelu", projector_bias=True)


def tokenizer(text_tokenizer):
    """SmolLM2's tokenizer with ids 16 / 15 renamed `<image>` / `<video>` and the multimodal chat template (module
    docstring)."""
    import transformers
    from tokenizers import Tokenizer

    for i, (old, _) in _RENAMED.items():
        if text_tokenizer.convert_ids_to_tokens(i) != old:
            raise ValueError(f"expected SmolLM2's tokenizer (id {i} = {old})")
    spec = json.loads(text_tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for t in spec["added_tokens"]:
        if t["id"] in _RENAMED:
            old, new = _RENAMED[t["id"]]
            t["content"] = new
            vocab[new] = vocab.pop(old)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                               eos_token="<|im_end|>", pad_token="<|im_end|>",
                                               bos_token="<|im_start|>", unk_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write_processor(directory: str | os.PathLike) -> str:
    """Writes the image processor's `preprocessor_config.json` to `directory`; returns the directory."""
    import transformers

    ip = transformers.LlavaOnevisionImageProcessorPil(size={"height": TILE, "width": TILE},
                                                      image_grid_pinpoints=[[TILE, TILE]], do_pad=True)
    os.makedirs(directory, exist_ok=True)
    ip.save_pretrained(os.fspath(directory))
    return os.fspath(directory)


def pixels(images: np.ndarray) -> np.ndarray:
    """[N, 28, 28, 3] uint8 -> the processor's pixel_values [N, 2, 3, 28, 28] (base tile, the one grid tile)."""
    if images.shape[1:] != (TILE, TILE, 3) or images.dtype != np.uint8:
        raise ValueError(f"expected [N, {TILE}, {TILE}, 3] uint8 images, got {images.shape} {images.dtype}")
    x = (images.astype(np.float32) / 255.0 - np.float32(OPENAI_CLIP_MEAN)) / np.float32(OPENAI_CLIP_STD)
    x = x.transpose(0, 3, 1, 2)
    return np.stack([x, x], axis=1)


def plan(cfg: LlavaOnevisionConfig, n: int, videos: int = 0) -> Plan:
    """The static `Plan` of `n` 28x28 images and `videos` clips (one compilation per batch make-up)."""
    lay = anyres.image_layouts(np.full((n, 2), TILE), cfg.image_grid_pinpoints, cfg.vision.image_size,
                               cfg.vision.grid, cfg.vision_aspect_ratio, None)
    return Plan(images=tuple(lay), videos=videos)


def media_inputs(cfg: LlavaOnevisionConfig, tokens: np.ndarray, media: np.ndarray) -> tuple:
    """On the host: (plan, tiles, frames, image_slots, video_slots) for `llava_onevision.generate_tokens` of rows
    that each hold one image (`media` [N, 28, 28, 3]) or one clip ([N, F, 28, 28, 3])."""
    flat = tokens.reshape(-1)
    if media.ndim == 5:
        frames = pixels(media.reshape(-1, *media.shape[2:]))[:, 0]
        slots = np.flatnonzero(flat == cfg.video_token_id).astype(np.int32)
        return plan(cfg, 0, len(media)), None, frames, None, slots
    tiles = pixels(media).reshape(-1, 3, TILE, TILE)
    return plan(cfg, len(media)), tiles, None, np.flatnonzero(flat == cfg.image_token_id).astype(np.int32), None


def visual_inputs(cfg: LlavaOnevisionConfig, tokens, tiles, frames=None) -> tuple:
    """Inside a jitted step: (plan, tiles, frames, image_slots, video_slots) for `llava_onevision.embed_inputs` of
    rows of images (`tiles` [2 * Ni, 3, 28, 28], two a row) and rows of clips (`frames` [Nv, F, 3, 28, 28], or
    None), every count static from the shapes."""
    import jax.numpy as jnp

    flat = tokens.reshape(-1)
    n_img = tiles.shape[0] // 2
    image_slots = jnp.nonzero(flat == cfg.image_token_id, size=n_img * n_visual(cfg))[0].astype(jnp.int32)
    if frames is None:
        return plan(cfg, n_img), tiles, None, image_slots, None
    n_vid, f = frames.shape[:2]
    size = n_vid * anyres.video_features(f, cfg.vision.grid)
    video_slots = jnp.nonzero(flat == cfg.video_token_id, size=size)[0].astype(jnp.int32)
    return plan(cfg, n_img, n_vid), tiles, frames.reshape(-1, *frames.shape[2:]), image_slots, video_slots


def n_visual(cfg: LlavaOnevisionConfig) -> int:
    """Visual tokens of one image."""
    return plan(cfg, 1).images[0].num_features(cfg.base_tokens)


class Prompts:
    """Token ids of image prompts, one tokenization per question (the visual part is the same for every image)."""

    def __init__(self, cfg: LlavaOnevisionConfig, tokenizer):
        self.cfg, self.tok, self._ids = cfg, tokenizer, {}

    @property
    def n_visual(self) -> int:
        return n_visual(self.cfg)

    def prompt(self, question: str) -> list[int]:
        if question not in self._ids:
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
            text = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            text = expand_placeholders(self.cfg, [text], [[TILE] * 2])[0]
            self._ids[question] = self.tok(text)["input_ids"]
        return self._ids[question]

    def video_prompt(self, question: str, frames: int) -> list[int]:
        key = (question, frames)
        if key not in self._ids:
            msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
            text = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            text = expand_placeholders(self.cfg, [text], None, [frames])[0]
            self._ids[key] = self.tok(text)["input_ids"]
        return self._ids[key]

    def answer(self, text: str) -> list[int]:
        return self.tok(text)["input_ids"] + [self.tok.convert_tokens_to_ids("<|im_end|>")]


@dataclasses.dataclass
class Parts:
    """What both stages read: the frozen language model, the VLM config, tokenizer and processor directory."""

    cfg: LlavaOnevisionConfig
    lm_params: dict  # canonical (the checkpoint layout)
    lm_serving: serving_lm.LM
    tokenizer: object
    data: dict[str, vlm_data.Images]


def load_parts(c, *, sources: dict[str, vlm_data.Images] | None = None) -> Parts:
    text_cfg, decoder, text_tok = loader.load_lm(loader.default_target())
    data = sources if sources is not None else {
        "fashion": vlm_data.fashion("train"), "digits": vlm_data.digits(),
        "photos": vlm_data.photos(c.photo_crops, seed=c.seed)}
    return Parts(cfg=config(text_cfg, c.vision, video=c.video is not None), lm_params=decoder.params(),
                 lm_serving=decoder.serving(), tokenizer=tokenizer(text_tok), data=data)


def draw(c: VLMRecipe, data: dict[str, vlm_data.Images], rng: np.random.Generator, n: int):
    """n (source, row) pairs drawn by the recipe's mix (sources missing from `data` left out)."""
    names = [s for s in vlm_data.SOURCES if s in data and len(data[s])]
    w = np.asarray([c.mix[vlm_data.SOURCES.index(s)] for s in names], np.float64)
    picks = rng.choice(len(names), size=n, p=w / w.sum())
    return [(names[k], int(rng.integers(len(data[names[k]])))) for k in picks]
