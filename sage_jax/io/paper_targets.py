"""The paper's model pairs on TPU slices (`configs/sage/paper_targets.py` holds the data): their models' configs,
each parameter's shards under the inference rules, and the memory each chip holds.

Serving shards target and draft tensor-parallel over the mesh's `model` axis with no FSDP
(`configs.sharding.INFERENCE_RULES`): every weight is read every step, so gathering it per layer would cost more
than it saves. A dimension the `model` axis does not divide (the 7B's 28 query heads on 8 chips) stays replicated;
`memory_per_chip` counts exactly that. ``python -m sage_jax.lowering --memory-table`` prints `table()`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Literal

from configs import sharding
from configs.schema import Schema

Family = Literal["qwen2_5_vl", "llava_onevision"]


@dataclasses.dataclass(frozen=True)
class Model:
    """A model of a preset: its family (our architecture name) and size ("72b", "7b")."""

    family: Family
    size: str

    def build_config(self, dtype: str = "bfloat16"):
        """(architecture, config in `dtype`) of the published model."""
        from sage_jax.io import architectures, vlm_checkpoint

        arch = architectures.named(self.family)
        if self.family == "qwen2_5_vl":
            from sage_jax.models.qwen25_vl import Qwen25VLConfig

            factory = getattr(Qwen25VLConfig, f"qwen25_vl_{self.size}", None)
        else:
            from sage_jax.models.llava_onevision import LlavaOnevisionConfig

            factory = getattr(LlavaOnevisionConfig, f"llava_ov_{self.size}", None)
        if factory is None:
            raise ValueError(f"no {self.family} model of size {self.size!r}")
        return arch, vlm_checkpoint.with_dtype(arch, factory(), dtype)


@dataclasses.dataclass(frozen=True)
class Reported:
    """What the paper reports for a pair: the benchmark, SAGE's τ (the bonus token not counted) and tokens/s, and
    plain decoding's tokens/s."""

    benchmark: str
    tau: float
    tok_s: float
    ar_tok_s: float

    @property
    def speedup(self) -> float:
        return self.tok_s / self.ar_tok_s


@dataclasses.dataclass(frozen=True)
class TpuPreset:
    """A target (and its draft) served together on one TPU slice, tensor-parallel `tp` ways, in `dtype`."""

    name: str
    target: Model
    draft: Model | None
    slice: str  # e.g. "v6e-8": generation and chip count
    tp: int
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    reported: Reported | None = None

    @property
    def generation(self) -> str:
        return self.slice.split("-")[0]

    @property
    def chips(self) -> int:
        return int(self.slice.split("-")[1])

    @property
    def models(self) -> tuple[Model, ...]:
        return (self.target,) if self.draft is None else (self.target, self.draft)


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """An accelerator's published figures: HBM GiB, peak dense bf16 TFLOP/s, HBM GB/s, interconnect Gbit/s per chip
    (`sage_jax.decoding.cost_model.Chip` reads them)."""

    hbm_gib: float
    bf16_tflops: float
    hbm_gbps: float
    link_gbits: float


@dataclasses.dataclass(frozen=True)
class PaperTargets(Schema):
    """The data of `configs/sage/paper_targets.py`: the chips (TPU generations and GPUs) and the presets."""

    KIND = "paper_targets"

    chips: dict[str, ChipSpec]
    presets: tuple[TpuPreset, ...]

    def __post_init__(self):
        for p in self.presets:
            if p.generation not in self.chips:
                raise ValueError(f"preset {p.name}: no chip figures for TPU generation {p.generation!r}")


@functools.cache
def load() -> PaperTargets:
    """The presets of `configs/sage/paper_targets.py`, validated."""
    from configs.sage import paper_targets

    return PaperTargets.from_config(paper_targets.get_config())


def presets() -> dict[str, TpuPreset]:
    return {p.name: p for p in load().presets}


def hbm_gib(generation: str) -> float:
    """HBM per chip of a TPU generation (or GPU), GiB."""
    return load().chips[generation].hbm_gib


def chips() -> dict[str, ChipSpec]:
    """Every chip's published figures, by name ("v6e", "h100", ...)."""
    return dict(load().chips)


def platform(chip: str) -> Literal["tpu", "gpu"]:
    """Whether the chip named `chip` in `chips()` is a TPU or a GPU: the table names TPU generations as Cloud TPU
    does (v4, v5e, v5p, v6e) and GPUs as NVIDIA does (h100, h200, h20)."""
    if chip not in load().chips:
        raise ValueError(f"no published figures for chip {chip!r}; known: {', '.join(sorted(load().chips))}")
    return "tpu" if re.fullmatch(r"v\d+[a-z]*", chip) else "gpu"


def abstract_mesh(tp: int):
    """The (data, fsdp, model) abstract mesh of a `tp`-way tensor-parallel preset: (1, 1, tp)."""
    from jax.sharding import AbstractMesh

    return AbstractMesh((1, 1, tp), sharding.MESH_AXES)


def param_shards(model: Model, tp: int, dtype: str = "bfloat16") -> list[tuple[str, tuple[int, ...], int, int]]:
    """(path, shape, bytes per element, shards) of every parameter of `model` under the inference rules on a
    `tp`-way mesh."""
    import jax
    from flax import nnx

    from sage_jax.io import vlm_checkpoint

    arch, cfg = model.build_config(dtype)
    _, state = vlm_checkpoint.abstract(arch, cfg)
    mesh = abstract_mesh(tp)
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
    for model in preset.models:
        params = param_shards(model, preset.tp, preset.dtype)
        out["params_b"] += sum(math.prod(s) for _, s, _, _ in params) / 1e9
        out["weights_gib"] += sum(math.prod(s) * b / n for _, s, b, n in params) / 2**30
        _, cfg = model.build_config(preset.dtype)
        t = cfg.text
        kv_shards = preset.tp if t.n_kv_heads % preset.tp == 0 else 1
        elem = 2 if preset.dtype == "bfloat16" else 4
        out["kv_gib"] += 2 * t.n_layers * batch * context * t.n_kv_heads * t.head_dim * elem / kv_shards / 2**30
    out["total_gib"] = out["weights_gib"] + out["kv_gib"]
    out["hbm_gib"] = hbm_gib(preset.generation)
    return out


def table(batch: int = 1, context: int = 8192) -> str:
    """A markdown table of every preset's memory per chip (`memory_per_chip`)."""
    rows = ["| preset | slice | TP | params (B) | weights / chip (GiB) | KV / chip (GiB) | total / HBM (GiB) |",
            "|---|---|---|---|---|---|---|"]
    for p in presets().values():
        m = memory_per_chip(p, batch=batch, context=context)
        rows.append(f"| {p.name} | {p.slice} | {p.tp} | {m['params_b']:.2f} | {m['weights_gib']:.1f} | "
                    f"{m['kv_gib']:.2f} | {m['total_gib']:.1f} / {m['hbm_gib']:.0f} |")
    return "\n".join(rows)
