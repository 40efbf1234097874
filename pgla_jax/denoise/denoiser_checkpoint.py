"""Denoiser checkpoints in the project's format (`configs/checkpoint.py`): the U-Net / DnCNN weights as a plain
nested dict with string keys, and the `DenoiserConfig` in metadata.json, so `load` rebuilds model and codec."""

from __future__ import annotations

import importlib.resources
import os
from typing import Any

import jax
from flax import nnx

from configs import checkpoint
from pgla_jax import codec as codec_lib
from pgla_jax.config import DenoiserConfig
from pgla_jax.models import split_victim

KIND = "pgla-denoiser"
#: The shipped checkpoint (paper setting: DLG LeNet 28×28, Fashion-MNIST surrogate), used by default.
SHIPPED = "lenet28"


#: Every shipped denoiser folder: the MNIST LeNet's U-Net (+ DnCNN + prior), the colour LeNet's prior (+ refiner).
SHIPPED_ALL = ("lenet28", "patches32")


def shipped_path(name: str = SHIPPED) -> str:
    """pgla_jax/assets/<name>/denoiser (its DnCNN baseline and Gaussian prior beside it in …/dncnn, …/prior), or
    …/prior for a folder that ships the prior alone."""
    root = importlib.resources.files("pgla_jax") / "assets" / name
    return os.fspath(root / ("denoiser" if (root / "denoiser").is_dir() else "prior"))


def shipped_for(victim) -> str | None:
    """The shipped checkpoint made for `victim` (a `VictimConfig`), or None when none is."""
    for name in SHIPPED_ALL:
        path = shipped_path(name)
        if config_from_json(checkpoint.read_metadata(path)["config"]).gradients.victim == victim:
            return path
    return None


def str_keys(tree):
    """nnx pure dicts key list entries by int; our checkpoint format wants string keys."""
    if isinstance(tree, dict):
        return {str(k): str_keys(v) for k, v in tree.items()}
    return tree


def to_pure(module_or_state) -> dict[str, Any]:
    st = module_or_state if isinstance(module_or_state, nnx.State) else nnx.state(module_or_state, nnx.Param)
    return str_keys(nnx.to_pure_dict(st))


def load_pure(module: nnx.Module, tree: dict[str, Any]) -> None:
    """Writes a string-keyed pure dict into `module`'s parameters (in place)."""
    st = nnx.state(module, nnx.Param)
    flat_target = dict(nnx.to_flat_state(st))
    for path in flat_target:
        node = tree
        for k in path:
            node = node[str(k)]
        flat_target[path].set_value(jax.numpy.asarray(node))
    nnx.update(module, st)


def config_from_json(d: dict[str, Any]) -> DenoiserConfig:
    """The `DenoiserConfig` stored in a checkpoint's metadata.json (JSON lists back to tuples, every key checked)."""
    return DenoiserConfig.from_config(d)


def make_codec(cfg: DenoiserConfig) -> codec_lib.GradientCodec:
    _, params = split_victim(cfg.gradients.victim)
    return codec_lib.make_codec(params, cfg.layout, cfg.unet.multiple, cfg.side)


def save(path: str, params: dict[str, Any], cfg: DenoiserConfig, *, kind: str = KIND, provenance=None,
         overwrite: bool = False) -> str:
    return checkpoint.save(path, params, config=cfg, kind=kind, provenance=provenance, overwrite=overwrite)


def load(path: str, kind: str = KIND) -> tuple[dict[str, Any], DenoiserConfig, dict[str, Any]]:
    """(params tree, config, metadata); `CheckpointError` (one line) when `path` is not a denoiser checkpoint."""
    meta = checkpoint.read_metadata(path)
    if meta.get("kind") != kind:
        raise checkpoint.CheckpointError(f"{path} is a {meta.get('kind')!r} checkpoint, not a {kind!r} one")
    return checkpoint.restore(path), config_from_json(meta["config"]), meta
