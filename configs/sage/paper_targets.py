"""The paper's model pairs and their inference sharding on TPU slices.

SAGE evaluates Qwen2.5-VL-72B and LLaVA-OneVision-72B targets with 7B drafts of the same family. Serving shards
both tensor-parallel over the mesh's `model` axis with no FSDP (`configs.sharding.INFERENCE_RULES`): every weight
is read every step, so gathering it per layer would cost more than it saves. A dimension the `model` axis does
not divide (the 7B's 28 query heads on 8 chips) stays replicated; `memory_per_chip` counts exactly that.

`python -m configs.sage.paper_targets` prints the table the README's TPU section shows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

#: HBM per chip, GiB (Cloud TPU documentation).
HBM_GIB = {"v4": 32.0, "v5e": 16.0, "v5p": 95.0, "v6e": 32.0}


@dataclasses.dataclass(frozen=True)
class Model:
    """A model of a preset: our architecture name and its config factory."""

    architecture: str
    config: Callable[[], Any]

    def build_config(self, dtype: str = "bfloat16"):
        from sage_jax.io import architectures, vlm_checkpoint

        arch = architectures.named(self.architecture)
        return arch, vlm_checkpoint.with_dtype(arch, self.config(), dtype)


@dataclasses.dataclass(frozen=True)
class TpuPreset:
    """A target (and its draft) served together on one TPU slice, tensor-parallel `tp` ways."""

    name: str
    target: Model
    draft: Model | None
    slice: str  # e.g. "v6e-8": generation and chip count
    tp: int

    @property
    def generation(self) -> str:
        return self.slice.split("-")[0]

    @property
    def chips(self) -> int:
        return int(self.slice.split("-")[1])


def _qwen(size: str) -> Model:
    from sage_jax.models.qwen25_vl import Qwen25VLConfig

    return Model("qwen2_5_vl", getattr(Qwen25VLConfig, f"qwen25_vl_{size}"))


def _llava(size: str) -> Model:
    from sage_jax.models.llava_onevision import LlavaOnevisionConfig

    return Model("llava_onevision", getattr(LlavaOnevisionConfig, f"llava_ov_{size}"))


def presets() -> dict[str, TpuPreset]:
    return {p.name: p for p in (
        TpuPreset("qwen2.5-vl-72b+7b", _qwen("72b"), _qwen("7b"), "v6e-8", 8),
        TpuPreset("llava-ov-72b+7b", _llava("72b"), _llava("7b"), "v6e-8", 8),
        TpuPreset("qwen2.5-vl-72b+7b-v5p", _qwen("72b"), _qwen("7b"), "v5p-8", 4),
        TpuPreset("qwen2.5-vl-7b", _qwen("7b"), None, "v5e-4", 4),
        TpuPreset("llava-ov-7b", _llava("7b"), None, "v5e-4", 4),
    )}


def _abstract_mesh(tp: int):
    from jax.sharding import AbstractMesh

    from configs.sharding import MESH_AXES

    return AbstractMesh((1, 1, tp), MESH_AXES)


def _param_shards(model: Model, tp: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(path, shape, bytes per element, shards) of every parameter under the inference rules on a tp-way mesh."""
    import jax
    from flax import nnx

    from configs import sharding
    from sage_jax.io import vlm_checkpoint

    arch, cfg = model.build_config()
    _, state = vlm_checkpoint.abstract(arch, cfg)
    mesh = _abstract_mesh(tp)
    out = []
    for path, var in jax.tree_util.tree_flatten_with_path(
            state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        value = var.get_value() if hasattr(var, "get_value") else var
        axes = var.get_metadata().get("axes") if hasattr(var, "get_metadata") else None
        spec = sharding.logical_to_spec(axes, sharding.INFERENCE_RULES, shape=value.shape, mesh=mesh) if axes \
            else ()
        shards = math.prod(mesh.shape[a] for entry in spec if entry is not None
                           for a in ((entry,) if isinstance(entry, str) else entry))
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        out.append((name, tuple(value.shape), value.dtype.itemsize, shards))
    return out


def memory_per_chip(preset: TpuPreset, *, batch: int = 1, context: int = 8192) -> dict[str, float]:
    """GiB per chip: weights of target and draft, their KV caches for `batch` sequences of `context` tokens."""
    out = {"params_b": 0.0, "weights_gib": 0.0, "kv_gib": 0.0}
    for model in (preset.target, preset.draft):
        if model is None:
            continue
        params = _param_shards(model, preset.tp)
        out["params_b"] += sum(math.prod(s) for _, s, _, _ in params) / 1e9
        out["weights_gib"] += sum(math.prod(s) * b / n for _, s, b, n in params) / 2**30
        _, cfg = model.build_config()
        t = cfg.text
        kv_shards = preset.tp if t.n_kv_heads % preset.tp == 0 else 1
        out["kv_gib"] += 2 * t.n_layers * batch * context * t.n_kv_heads * t.head_dim * 2 / kv_shards / 2**30
    out["total_gib"] = out["weights_gib"] + out["kv_gib"]
    out["hbm_gib"] = HBM_GIB[preset.generation]
    return out


def table(batch: int = 1, context: int = 8192) -> str:
    rows = ["| preset | slice | TP | params (B) | weights / chip (GiB) | KV / chip (GiB) | total / HBM (GiB) |",
            "|---|---|---|---|---|---|---|"]
    for p in presets().values():
        m = memory_per_chip(p, batch=batch, context=context)
        rows.append(f"| {p.name} | {p.slice} | {p.tp} | {m['params_b']:.2f} | {m['weights_gib']:.1f} | "
                    f"{m['kv_gib']:.2f} | {m['total_gib']:.1f} / {m['hbm_gib']:.0f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(f"bf16 weights; KV cache for batch 1 x 8192 tokens per model\n\n{table()}")
