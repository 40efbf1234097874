"""Tiny random vision-language models with a real tokenizer and image processor, for tests and the bench's
`--vlm --quick` smoke run: Qwen2.5-VL or LLaVA-OneVision of a few layers, built in memory (no download).

    vlm = tiny_vlm("qwen2_5_vl", seed=0, directory=tmp)            # VisionLM; its processor config goes to tmp
    draft = tiny_vlm("qwen2_5_vl", seed=1, directory=tmp2, like=vlm, noise=0.1)   # a perturbed copy: a draft
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from sage_jax.models.config import LMConfig

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
           "<|vision_end|>", "<image>", "<video>"]  # ids 0..8: the tiny configs' special ids
VOCAB = 320
_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}IMAGE{% elif c['type'] == 'video' %}"
    "VIDEO{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_MARKS = {"qwen2_5_vl": ("<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"),
          "llava_onevision": ("<image>", "<video>")}


def vlm_tokenizer(arch: str):
    """A byte-level BPE tokenizer of VOCAB ids whose special tokens are the tiny configs' ids, with a chat
    template writing the family's image / video placeholders."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Describe the picture in one sentence.", "What is shown here? A cat on a mat.",
              "How many frames does the video have?"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=SPECIAL,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                  pad_token="<|endoftext|>")
    image, video = _MARKS[arch]
    hf_tok.chat_template = _TEMPLATE.replace("IMAGE", image).replace("VIDEO", video)
    return hf_tok


def _vlm_processor(arch: str, directory: str, max_pixels: int) -> None:
    import transformers

    if arch == "qwen2_5_vl":
        ip = transformers.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=max_pixels, patch_size=14,
                                                   merge_size=2, temporal_patch_size=2)
    else:
        ip = transformers.LlavaOnevisionImageProcessorPil(
            size={"height": 28, "width": 28}, image_grid_pinpoints=[[28, 28], [28, 56], [56, 28], [56, 56]],
            do_pad=True)
    ip.save_pretrained(directory)


def _vlm_config(arch: str, d_model: int, n_layers: int, video: bool, max_position: int, head_dim: int = 16):
    from sage_jax.models.config import RopeConfig
    from sage_jax.models.llava_onevision import LlavaOnevisionConfig
    from sage_jax.models.qwen25_vl import Qwen25VLConfig

    text = dict(vocab_size=VOCAB, d_model=d_model, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=head_dim,
                mlp_dim=2 * d_model, qkv_bias=True, tie_embeddings=False, eos_token_ids=(2,), pad_token_id=0,
                max_position=max_position)
    if arch == "qwen2_5_vl":
        base = Qwen25VLConfig.tiny()
        return base.replace(text=LMConfig(**text, rope=RopeConfig(
            theta=1e6, mrope_section=tuple(x * head_dim // 16 for x in (2, 3, 3)))),
                            vision=dataclasses.replace(base.vision, out_hidden_size=d_model))
    return LlavaOnevisionConfig.tiny(text=LMConfig(**text, rope=RopeConfig(theta=1e6)), image_token_id=7,
                                     video_token_id=8 if video else None)


def tiny_vlm(arch: str, seed: int, directory, *, scale: float = 4.0, d_model: int = 64, n_layers: int = 2,
             video: bool = True, like=None, noise: float = 0.0, max_position: int = 1024,
             max_pixels: int = 112 * 112, head_dim: int = 16):
    """A tiny random VLM with a real tokenizer and image processor (written to `directory`): Qwen2.5-VL or
    LLaVA-OneVision. LM weights scaled by `scale` (peaked distributions). With `like` (another VisionLM of the
    same width), a draft made from it: its first `n_layers` language-model layers, its tower and head, each weight
    times (1 + noise * N(0, 1)), so that it agrees with `like` often but not always. `max_pixels`: the Qwen
    processor's image size cap (112² gives at most 16 visual tokens an image); `head_dim`: the language model's
    (64 for the Pallas tree-attention kernels)."""
    from sage_jax.io.vision_lm import VisionLM
    from sage_jax.models.llava_onevision import LlavaOnevision
    from sage_jax.models.qwen25_vl import Qwen25VL

    if like is not None:
        d_model = like.config.text.d_model
    cfg = _vlm_config(arch, d_model, n_layers, video, max_position, head_dim)
    module = (Qwen25VL if arch == "qwen2_5_vl" else LlavaOnevision)(cfg, rngs=nnx.Rngs(seed))
    params = nnx.state(module, nnx.Param)
    if like is not None:
        src = nnx.state(like.module, nnx.Param)
        leaves, tree = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(seed), len(leaves))
        picked = [x[: y.shape[0]] if x.shape != y.shape else x for x, y in zip(jax.tree.leaves(src), leaves,
                                                                               strict=True)]
        nnx.update(module, jax.tree.unflatten(tree, [x * (1 + noise * jax.random.normal(k, x.shape))
                                                     for x, k in zip(picked, keys, strict=True)]))
    else:
        params["lm"] = jax.tree.map(lambda x: x * scale if x.ndim > 1 else x, params["lm"])
        nnx.update(module, params)
    directory = str(directory)
    _vlm_processor(arch, directory, max_pixels)
    return VisionLM(module, vlm_tokenizer(arch), processor_dir=directory, source=f"tiny {arch}")
