"""The model families we read, keyed by the `model_type` of an HF `config.json`, and which stored tensors make
each of our parameters (`Architecture.plan`; `vlm_checkpoint` streams them one tensor at a time).

A family is a config class, an NNX module class and a weight-name module (`TABLE`, `canonical_name`, `IGNORED`,
`expected_paths(cfg)`, `n_layers(cfg, path)`), named by import path so that reading a text LM never imports a
vision tower.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Mapping
from typing import Any

from sage_jax.io import hf


def _attr(spec: str):
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One model family. `name` is stored in our checkpoints; `model_types` are the config.json values it reads."""

    name: str
    title: str
    model_types: tuple[str, ...]
    config_class: str  # "module:Class" with from_hf / from_json / to_json
    module_class: str  # "module:Class", built as Class(cfg, rngs=...)
    weights: str  # module with TABLE, canonical_name, IGNORED, expected_paths, n_layers

    @property
    def is_vlm(self) -> bool:
        return self.name != "lm"

    def config_from_hf(self, d: Mapping[str, Any]):
        return _attr(self.config_class).from_hf(dict(d))

    def config_from_json(self, d: Mapping[str, Any]):
        return _attr(self.config_class).from_json(dict(d))

    def module(self, cfg, rngs):
        return _attr(self.module_class)(cfg, rngs=rngs)

    def text_config(self, cfg):
        return cfg if not self.is_vlm else cfg.text

    def plan(self, cfg, names) -> hf.Plan:
        """Which stored tensors make each of our parameters (checked before any is read)."""
        w = importlib.import_module(self.weights)
        if self.text_config(cfg).tie_embeddings:  # some exporters write a tied head anyway
            names = [n for n in names if w.canonical_name(n) != "lm_head.weight"]
        return hf.plan(w.TABLE, names, canonical=w.canonical_name, ignored=w.IGNORED,
                       n_layers=lambda path: w.n_layers(cfg, path), expected=w.expected_paths(cfg),
                       what=f"a {self.title} model")


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("lm", "Llama / Qwen2 / Mistral", ("llama", "qwen2", "mistral"),
                 "sage_jax.models.config:LMConfig", "sage_jax.models.decoder:Decoder", "sage_jax.io.hf"),
    Architecture("qwen2_5_vl", "Qwen2.5-VL", ("qwen2_5_vl",), "sage_jax.models.qwen25_vl:Qwen25VLConfig",
                 "sage_jax.models.qwen25_vl:Qwen25VL", "sage_jax.io.hf_qwen25_vl"),
    Architecture("llava_onevision", "LLaVA-OneVision", ("llava_onevision",),
                 "sage_jax.models.llava_onevision:LlavaOnevisionConfig",
                 "sage_jax.models.llava_onevision:LlavaOnevision", "sage_jax.io.hf_llava_onevision"),
)
_TEXT_ARCH_PREFIXES = ("Llama", "Qwen2For", "Mistral")


def supported() -> str:
    return ", ".join(a.title for a in ARCHITECTURES)


def named(name: str) -> Architecture:
    for a in ARCHITECTURES:
        if a.name == name:
            return a
    raise ValueError(f"unknown architecture {name!r}; this library reads {supported()}")


def of_hf_config(d: Mapping[str, Any]) -> Architecture:
    """The family of a config.json dict; a one-line ValueError naming it when we do not read it."""
    model_type = d.get("model_type", "")
    for a in ARCHITECTURES:
        if model_type in a.model_types:
            return a
    arch = (d.get("architectures") or [""])[0]
    if not model_type and arch.startswith(_TEXT_ARCH_PREFIXES):
        return ARCHITECTURES[0]
    raise ValueError(f"unsupported architecture {arch or model_type or '(none named)'!r}; this library reads "
                     f"{supported()}")


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    file = os.path.join(os.fspath(path), "config.json")
    try:
        with open(file) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None


def of_hf_dir(path: str | os.PathLike) -> tuple[Architecture, Any]:
    """(family, our config) of an HF directory."""
    d = read_hf_config(path)
    arch = of_hf_config(d)
    return arch, arch.config_from_hf(d)
