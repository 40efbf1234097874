"""A loaded vision-language model as users call it: `model(**processor_outputs) -> logits`, as with transformers.

`sage_jax.load(path)` returns one for a Qwen2.5-VL or LLaVA-OneVision directory or checkpoint. It holds the NNX
module (canonical parameters: `{"lm": <Decoder layout>, "vision": ...}`), the tokenizer, and the image processor
(transformers' PIL backend, built from the directory's `preprocessor_config.json` on first use).

transformers' combined processors need torchvision (for their video half), so `inputs` does their work with the
project's own code: chat template, image processor, video frames, placeholder expansion.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from jaxtyping import Array, Float, Int


class VisionLM:
    """A vision-language model with its tokenizer and image processor.

    Attributes:
      module: the NNX model (`Qwen25VL` or `LlavaOnevision`).  config: its config.  tokenizer: a transformers fast
      tokenizer or None.  processor_dir: where `preprocessor_config.json` lives, or None.  source: where it was
      loaded from.  serving: the language model's serving form when it was built while restoring
        (`sage_jax.io.vlm_checkpoint.load_serving`: the module's language-model layers are then empty, and every
        call runs them through this), else None (built from the module on first use).
    """

    def __init__(self, module, tokenizer=None, *, processor_dir: str | None = None, source: str | None = None,
                 serving=None):
        self.module = module
        self.tokenizer = tokenizer
        self.processor_dir = processor_dir
        self.source = source
        self._image_processor = None
        self._serving = serving

    @property
    def config(self):
        return self.module.cfg

    @property
    def architecture(self) -> str:
        from sage_jax.models.llava_onevision import LlavaOnevision

        return "llava_onevision" if isinstance(self.module, LlavaOnevision) else "qwen2_5_vl"

    @property
    def image_processor(self):
        """The transformers image processor of this model (its PIL backend), or None without its config."""
        if self._image_processor is None and self.processor_dir is not None:
            self._image_processor = _image_processor(self.processor_dir)
        return self._image_processor

    @property
    def supports_video(self) -> bool:
        """Whether the model takes videos (a config without a video placeholder token is image-only)."""
        return getattr(self.config, "video_token_id", None) is not None

    def serving(self):
        """The language model's serving form (`sage_jax.models.serving_lm.LM`, built once): what `Engine` decodes with,
        fed the embeddings `embed` returns."""
        if self._serving is None:
            self._serving = self.module.lm.serving()
        return self._serving

    def with_serving(self, serving) -> VisionLM:
        """This model with `serving` as its language model's serving form (the same model, e.g. multiplying the
        exact mode's way with its projections placed for it: `Engine`); the original keeps its own."""
        out = VisionLM(self.module, self.tokenizer, processor_dir=self.processor_dir, source=self.source,
                       serving=serving)
        out._image_processor = self._image_processor
        return out

    def embed(self, **inputs: Any) -> tuple[Float[Array, "B T D"], Int[Array, "B T ..."], np.ndarray]:
        """The language model's inputs for processor outputs: embeddings with the visual features spliced in,
        positions ([B, T, 3] M-RoPE for Qwen2.5-VL, [B, T] for LLaVA-OneVision) and the position delta [B] of the
        steps after the prompt (step k sits at position (kept prompt tokens + k) + delta)."""
        out = self.module.embed(**inputs)
        if len(out) == 3:
            return out[0], out[1], np.asarray(out[2], np.int32)
        return out[0], out[1], np.zeros((out[0].shape[0],), np.int32)

    def __call__(self, **inputs: Any) -> Float[Array, "B T V"]:
        """Float32 logits [B, T, V] from the keyword arrays a processor returns (numpy or jax)."""
        return self.module(**inputs, serving=self._serving)

    def generate(self, max_new_tokens: int = 32, **inputs: Any) -> np.ndarray:
        """Greedy continuation [B, max_new_tokens] of the prompts in `inputs` (plain decoding)."""
        return self.module.generate(**inputs, max_new_tokens=max_new_tokens, serving=self._serving)

    def inputs(self, prompt: str | Sequence[dict], images: Sequence = (), videos: Sequence = ()) -> dict:
        """The processor outputs for one prompt: the keyword arrays `__call__` and `generate` take.

        `prompt`: a user message (chat-templated with one image / video placeholder per item, images first) or a
        list of chat messages in the transformers format; `images`: PIL images or paths; `videos`: frame arrays
        [F, H, W, 3] uint8 or paths (`sage_jax.io.images.load_frames`)."""
        from sage_jax.io import vlm_inputs

        if self.tokenizer is None or self.image_processor is None:
            raise ValueError(f"{self.source or 'this model'} has no tokenizer or preprocessor_config.json; build "
                             f"the inputs with transformers and call the model with them")
        return vlm_inputs.prepare(self, prompt, images, videos)

    def __repr__(self) -> str:
        t = self.config.text
        return (f"VisionLM({self.architecture}, {self.source or 'in memory'}: {t.n_layers} layers, d_model "
                f"{t.d_model}, vocab {t.vocab_size}, {t.param_dtype})")


def _image_processor(directory: str):
    """transformers' image processor for `directory`, without torchvision (the PIL backend) and without torch."""
    import json

    with open(os.path.join(directory, "preprocessor_config.json")) as f:
        cfg = json.load(f)
    name = cfg.get("image_processor_type", "")
    import transformers

    base = name.removesuffix("Fast").removesuffix("Pil")
    cls = getattr(transformers, base + "Pil", None) or getattr(transformers, base, None)
    if cls is None:
        raise ValueError(f"{directory}: unknown image processor {name!r}")
    return cls.from_pretrained(directory)
