"""Hugging Face Qwen2.5-VL checkpoints <-> our `Qwen25VL` parameter tree ({"lm": ..., "vision": ...}), through
`hf.plan` / `hf.assemble` and one table: the LM's `hf.TABLE` under `lm/`, plus the vision tower's entries.

Names on disk (hub files and transformers' `save_pretrained`) are `model.layers.*`, `model.embed_tokens.*`,
`model.norm.*`, `visual.*`, `lm_head.weight`; in memory transformers v5 calls them `model.language_model.*` and
`model.visual.*`. `canonical_name` maps both to the on-disk spelling the table matches.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from sage_jax.io import hf
from sage_jax.io.hf import COPY, T, Transform
from sage_jax.models.qwen25_vl import Qwen25VLConfig

# The Conv3d patch embedding (Dv, C, Tp, p, p) acts on a pixel_values row flattened in that (C, Tp, p, p) order, so
# it is the matrix [C*Tp*p*p, Dv]. Back to torch, `from_params` restores the 5-D shape from the config.
PATCH = Transform(lambda w, h: w.reshape(w.shape[0], -1).T, lambda w, h: w.T)

_V = r"visual\.blocks\.(\d+)\."
VISION_TABLE: tuple[hf.Entry, ...] = (
    (r"visual\.patch_embed\.proj\.weight", "vision/patch_embed", PATCH),
    (_V + r"norm1\.weight", "vision/blocks/norm1", COPY),
    (_V + r"norm2\.weight", "vision/blocks/norm2", COPY),
    (_V + r"attn\.qkv\.weight", "vision/blocks/wqkv", T),
    (_V + r"attn\.qkv\.bias", "vision/blocks/bqkv", COPY),
    (_V + r"attn\.proj\.weight", "vision/blocks/wo", T),
    (_V + r"attn\.proj\.bias", "vision/blocks/bo", COPY),
    (_V + r"mlp\.gate_proj\.weight", "vision/blocks/w_gate", T),
    (_V + r"mlp\.gate_proj\.bias", "vision/blocks/b_gate", COPY),
    (_V + r"mlp\.up_proj\.weight", "vision/blocks/w_up", T),
    (_V + r"mlp\.up_proj\.bias", "vision/blocks/b_up", COPY),
    (_V + r"mlp\.down_proj\.weight", "vision/blocks/w_down", T),
    (_V + r"mlp\.down_proj\.bias", "vision/blocks/b_down", COPY),
    (r"visual\.merger\.ln_q\.weight", "vision/merger/norm", COPY),
    (r"visual\.merger\.mlp\.0\.weight", "vision/merger/w1", T),
    (r"visual\.merger\.mlp\.0\.bias", "vision/merger/b1", COPY),
    (r"visual\.merger\.mlp\.2\.weight", "vision/merger/w2", T),
    (r"visual\.merger\.mlp\.2\.bias", "vision/merger/b2", COPY),
)
#: (regex on the canonical HF name, our path, transform); a regex group is the layer index.
TABLE: tuple[hf.Entry, ...] = tuple((rx, "lm/" + path, tr) for rx, path, tr in hf.TABLE) + VISION_TABLE

#: Non-persistent buffers some files carry.
IGNORED = re.compile(r"(rotary_emb|rotary_pos_emb)\.inv_freq$")

_RENAMES = ((re.compile(r"^model\.language_model\."), "model."), (re.compile(r"^language_model\.model\."), "model."),
            (re.compile(r"^language_model\.lm_head\."), "lm_head."), (re.compile(r"^model\.visual\."), "visual."))


def canonical_name(name: str) -> str:
    """Any known spelling of a Qwen2.5-VL tensor name -> the on-disk one (`model.layers.*`, `visual.*`, ...)."""
    for rx, repl in _RENAMES:
        name = rx.sub(repl, name)
    return name


def is_qwen25_vl(hf_config: Mapping[str, Any]) -> bool:
    arch = (hf_config.get("architectures") or [""])[0]
    return hf_config.get("model_type") == "qwen2_5_vl" or arch.startswith("Qwen2_5_VL")


def n_layers(cfg: Qwen25VLConfig, path: str) -> int:
    return cfg.vision.depth if path.startswith("vision/blocks/") else cfg.text.n_layers


def expected_paths(cfg: Qwen25VLConfig) -> set[str]:
    return {"lm/" + p for p in hf.expected_paths(cfg.text)} | {p for _, p, _ in VISION_TABLE}


def read_params(cfg: Qwen25VLConfig, names: Iterable[str], read: Callable[[str], np.ndarray]) -> dict:
    """Stored tensor names and a reader (`hf.tensor_reader(hf.tensor_index(dir))`) -> our float32 params
    {"lm": ..., "vision": ...}. With tied embeddings a stored `lm_head.weight` is skipped."""
    names = [n for n in names if not (cfg.text.tie_embeddings and canonical_name(n) == "lm_head.weight")]
    p = hf.plan(TABLE, names, canonical=canonical_name, ignored=IGNORED, n_layers=lambda path: n_layers(cfg, path),
                expected=expected_paths(cfg), what="a Qwen2.5-VL model")
    return hf.unflatten({path: hf.assemble(items, read, cfg.text.head_dim) for path, items in p.items()})


def from_params(cfg: Qwen25VLConfig, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Our params -> {canonical HF name: float32 array} (the inverse of `read_params`)."""
    out = {name: w for name, w in hf.from_params(cfg.text, params["lm"]).items()}
    flat = hf.flatten(params["vision"])
    v = cfg.vision
    for rx, path, tr in VISION_TABLE:
        w = np.asarray(flat[path.removeprefix("vision/")], np.float32)
        name = rx.replace("\\.", ".")
        if "(\\d+)" in name:
            for i in range(w.shape[0]):
                out[name.replace("(\\d+)", str(i))] = np.ascontiguousarray(tr.to_hf(w[i], 0))
        else:
            out[name] = np.ascontiguousarray(tr.to_hf(w, 0))
    out["visual.patch_embed.proj.weight"] = out["visual.patch_embed.proj.weight"].reshape(
        v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    return out
