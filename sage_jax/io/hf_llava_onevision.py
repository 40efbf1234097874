"""Hugging Face LLaVA-OneVision checkpoints -> our `LlavaOnevision` parameter tree, through `hf.plan` / `hf.assemble`.

Stored names come in two spellings (transformers v5 renames on load and save) and SigLIP with or without its
`vision_model.` prefix; `canonical_name` maps each to one: the LM's `model.*` / `lm_head.weight` (so `hf.TABLE`
applies, our paths prefixed `lm/`), `vision_tower.*`, `multi_modal_projector.*`, `image_newline`.
Vision transforms ignore their second argument (the LM's head dim): the tower's attention weights stay [Dv, Dv].
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from sage_jax.io import hf
from sage_jax.io.hf import COPY, T, Transform
from sage_jax.models.llava_onevision import LlavaOnevisionConfig

# torch Conv2d [Dv, C, p, p] -> [C, p, p, Dv]
PATCH = Transform(lambda w, h: w.transpose(1, 2, 3, 0), lambda w, h: w.transpose(3, 0, 1, 2))

_V = r"vision_tower\.encoder\.layers\.(\d+)\."
_VISION: tuple[hf.Entry, ...] = (
    (r"vision_tower\.embeddings\.patch_embedding\.weight", "vision/patch_embed", PATCH),
    (r"vision_tower\.embeddings\.patch_embedding\.bias", "vision/patch_bias", COPY),
    (r"vision_tower\.embeddings\.position_embedding\.weight", "vision/pos_embed", COPY),
    (_V + r"layer_norm1\.weight", "vision/blocks/ln1_scale", COPY),
    (_V + r"layer_norm1\.bias", "vision/blocks/ln1_bias", COPY),
    (_V + r"layer_norm2\.weight", "vision/blocks/ln2_scale", COPY),
    (_V + r"layer_norm2\.bias", "vision/blocks/ln2_bias", COPY),
    *((_V + rf"self_attn\.{n}_proj\.weight", f"vision/blocks/w{n}", T) for n in "qkv"),
    *((_V + rf"self_attn\.{n}_proj\.bias", f"vision/blocks/b{n}", COPY) for n in "qkv"),
    (_V + r"self_attn\.out_proj\.weight", "vision/blocks/wo", T),
    (_V + r"self_attn\.out_proj\.bias", "vision/blocks/bo", COPY),
    (_V + r"mlp\.fc1\.weight", "vision/blocks/w_fc1", T),
    (_V + r"mlp\.fc1\.bias", "vision/blocks/b_fc1", COPY),
    (_V + r"mlp\.fc2\.weight", "vision/blocks/w_fc2", T),
    (_V + r"mlp\.fc2\.bias", "vision/blocks/b_fc2", COPY),
)

#: (regex on the canonical HF name, our path, transform): the LM's `hf.TABLE` under `lm/`, then the rest.
TABLE: tuple[hf.Entry, ...] = (
    *((rx, "lm/" + path, tr) for rx, path, tr in hf.TABLE),
    *_VISION,
    (r"multi_modal_projector\.linear_1\.weight", "projector/w1", T),
    (r"multi_modal_projector\.linear_1\.bias", "projector/b1", COPY),
    (r"multi_modal_projector\.linear_2\.weight", "projector/w2", T),
    (r"multi_modal_projector\.linear_2\.bias", "projector/b2", COPY),
    (r"image_newline", "image_newline", COPY),
)

#: SigLIP's pooling head and final norm (LLaVA reads hidden states before both), rotary / position-id buffers.
IGNORED = re.compile(r"(^vision_tower\.(head\.|post_layernorm\.)|rotary_emb\.inv_freq$|position_ids$)")

_RENAMES = (
    (re.compile(r"^model\.(vision_tower|multi_modal_projector|image_newline)"), r"\1"),
    (re.compile(r"^vision_tower\.vision_model\."), "vision_tower."),
    (re.compile(r"^(model\.language_model\.|language_model\.model\.)"), "model."),
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
)


def canonical_name(name: str) -> str:
    """Any stored spelling -> the one `TABLE` matches."""
    for rx, repl in _RENAMES:
        name = rx.sub(repl, name)
    return name


def is_llava_onevision(hf_config: dict[str, Any]) -> bool:
    return hf_config.get("model_type") == "llava_onevision" or any(
        a.startswith("LlavaOnevision") for a in hf_config.get("architectures") or ())


def expected_paths(cfg: LlavaOnevisionConfig) -> set[str]:
    vision = {p for rx, p, _ in _VISION}
    projector = {"projector/w1", "projector/w2"} | ({"projector/b1", "projector/b2"} if cfg.projector_bias else set())
    return {"lm/" + p for p in hf.expected_paths(cfg.text)} | vision | projector | {"image_newline"}


def n_layers(cfg: LlavaOnevisionConfig, path: str) -> int:
    return cfg.vision.num_layers if path.startswith("vision/") else cfg.text.n_layers


def stored_names(cfg: LlavaOnevisionConfig, names: Iterable[str]) -> list[str]:
    """The names to plan: a tied LM head, if stored, is the embedding again (not a parameter of ours)."""
    return [n for n in names if not (cfg.text.tie_embeddings and canonical_name(n) == "lm_head.weight")]


def read_params(cfg: LlavaOnevisionConfig, names: Iterable[str], read: Callable[[str], np.ndarray]) -> hf.Params:
    """Stored tensor names + a reader (`hf.tensor_reader(hf.tensor_index(path))`) -> our float32 params tree."""
    items = hf.plan(TABLE, stored_names(cfg, names), canonical=canonical_name, ignored=IGNORED,
                    n_layers=lambda p: n_layers(cfg, p), expected=expected_paths(cfg), what="a LLaVA-OneVision model")
    return hf.unflatten({path: hf.assemble(it, read, cfg.text.head_dim) for path, it in items.items()})
