"""The paper's pairs lowered for TPU slices from any host: `jax.export(..., platforms=["tpu"])` of the speculative
prefill and decode loop of a 72B vision-language target with its 7B draft, on abstract weights placed on an abstract
mesh by the inference rules. Nothing is allocated, so a CPU finds here the sharding and shape errors a TPU would.

    python -m sage_jax.lowering [--preset qwen2.5-vl-72b+7b ...] [--mesh 2x8 ...] [--layers N] [--matmul exact]
    python -m sage_jax.lowering --memory-table
    python -m sage_jax.lowering --project v6e [--tp 8] [--context 8192]

prints, per (preset, mesh), the bytes each chip holds as the exported programs take them: the serving weights of
target and draft, and their KV caches, next to the chip's HBM. Both programs are exported with the same shardings
for the loop state, so the prefill's output is the decode loop's input as it stands.

`--layers N` exports N real-sized layers of each model (every layer is placed alike) and scales the per-layer bytes
to the full depth, a quick look at a big mesh; the default, `--layers 0`, exports the whole models (about 15 s a
pair and mesh on a 2-core CPU).

`--memory-table` prints instead every preset's memory per chip from the models' exact parameter shapes under the
inference rules (`sage_jax.io.paper_targets.table`: bf16 weights, KV caches for batch 1 x 8192 tokens per model),
nothing exported; the exact mode (`LMConfig.matmul == "exact"`) holds the same bytes per chip.

`--project CHIP` prints the cost model's projection for the paper's pairs on CHIP (`sage_jax.decoding.cost_model`):
tokens/s of plain decoding, of SAGE's full trees at the paper's τ, and of the budget `--budget auto` would choose
there from the shipped head's acceptance record, beside the paper's own figures on H20 GPUs; then the same pairs
in the exact mode (`LMConfig.matmul == "exact"`: speculative output equal to plain decoding bit for bit), AR and
SAGE beside the fast mode's, with the exact mode's tax on each.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from configs import cli, sharding
from sage_jax.decoding import speculative as spec
from sage_jax.decoding import visual_pruning
from sage_jax.decoding.drafters import DraftSpec, build_drafter
from sage_jax.decoding.policies import TreePolicy
from sage_jax.io import paper_targets
from sage_jax.models import serving_lm

#: Meshes the integration tests lower the pairs for: (data, model). A v5p-32 / v6e-16 (4x4 chips) and a v5p-128 /
#: v6e-64 (8x8): replicas of an 8-way tensor-parallel pair (the 72B targets' 8 kv heads cut one per chip).
MESHES = {"4x4": (2, 8), "8x8": (8, 8)}


@dataclasses.dataclass(frozen=True)
class Shape:
    """What one request looks like: the batch (one row per data replica by default), the prompt bucket with its
    visual tokens, the draft's pruned prompt bucket, the new tokens."""

    batch: int = 0  # 0: one row per data replica
    prompt_len: int = 8192
    draft_prompt_len: int = 2048
    max_new_tokens: int = 256


def mesh(data: int, model: int) -> AbstractMesh:
    """An abstract (data, fsdp, model) mesh of data x model chips."""
    return AbstractMesh((data, 1, model), sharding.MESH_AXES)


def abstract_lm(model: paper_targets.Model, m: AbstractMesh, layers: int = 0, dtype: str = "bfloat16"):
    """The language model of a preset's model in serving form, as abstract arrays placed on `m` the way
    `Decoder.serving` places a model loaded onto it (`lm.serving_layout`); its VLM config. `layers`: that many
    real-sized layers (0: all)."""
    from flax import nnx

    from sage_jax.models.decoder import Decoder

    _, cfg = model.build_config(dtype)
    text = cfg.text if not layers else cfg.text.replace(n_layers=layers)
    _, state = nnx.split(nnx.eval_shape(lambda: Decoder(text, rngs=nnx.Rngs(0))))
    with sharding.use(m, "inference"):
        placed = nnx.to_pure_dict(sharding.state_shardings(state, m))
    canonical = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             nnx.to_pure_dict(state), placed)
    groups, shardings = serving_lm.serving_layout(text, canonical)
    serving = jax.eval_shape(lambda p: serving_lm.serving_params(text, p, groups), canonical)
    return cfg, jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), serving, shardings)


def _placed(m: AbstractMesh, names: tuple, shape: tuple, dtype) -> jax.ShapeDtypeStruct:
    spec_ = sharding.logical_to_spec(names, sharding.INFERENCE_RULES, shape=shape, mesh=m)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(m, spec_))


def _state_shardings(state, target: serving_lm.LM, draft: serving_lm.LM, m: AbstractMesh):
    """Shardings of the loop state: each model's cache as it is born (`KVCache.zeros`), rows of every per-row array
    over the batch axes, the rest replicated."""

    def one(path, leaf):
        keys = [getattr(k, "name", getattr(k, "key", None)) for k in path]
        if "t_cache" in keys or "d_cache" in keys:
            cut = (target if "t_cache" in keys else draft).groups[0] > 1
            names = ("batch", "cache_seq", "kv_heads" if cut else None, "head_dim")
        elif leaf.ndim and keys[0] != "key":
            names = ("batch",) + (None,) * (leaf.ndim - 1)
        else:
            names = (None,) * leaf.ndim
        if leaf.ndim and keys[0] in _STEP_ARRAYS:  # traces and rank counts: indexed by step or rank, not by row
            names = (None,) * leaf.ndim
        return NamedSharding(m, sharding.logical_to_spec(names, sharding.INFERENCE_RULES, shape=leaf.shape, mesh=m))

    return jax.tree_util.tree_map_with_path(one, state)


_STEP_ARRAYS = {"accepted_depth", "alpha_trace", "depth_trace", "nodes_trace", "width_trace", "tau_trace"}


@dataclasses.dataclass
class Lowered:
    """A pair's exported programs on one mesh, and what each chip holds in them."""

    preset: str
    mesh: tuple[int, int]
    prefill: jax.export.Exported
    decode: jax.export.Exported
    bytes_per_chip: dict[str, float]  # weights / kv of target and draft, full depth


def lower(preset: paper_targets.TpuPreset, data: int, model: int, *, layers: int = 0, shape: Shape = Shape(),
          policy: TreePolicy | None = None, matmul: str = "auto") -> Lowered:
    """Exports `preset`'s speculative prefill and decode loop for a data x model TPU mesh (module docstring), its
    models multiplying the `matmul` way (`LMConfig.matmul`; "exact": the shape-invariant mode, laid out and run as
    `serving_lm.exact_layout` and `_exact_block` say, with its Mosaic kernels)."""
    if preset.draft is None:
        raise ValueError(f"preset {preset.name} has no draft")
    m = mesh(data, model)
    cfg_t, lm_t = abstract_lm(preset.target, m, layers)
    cfg_d, lm_d = abstract_lm(preset.draft, m, layers)
    lm_t, lm_d = lm_t.with_matmul(matmul), lm_d.with_matmul(matmul)
    b = shape.batch or data
    policy = policy or TreePolicy.sage()
    run = spec.SpecConfig(policy=policy, prompt_len=shape.prompt_len, max_new_tokens=shape.max_new_tokens,
                          eos_ids=tuple(cfg_t.text.eos_token_ids), pad_id=cfg_t.text.pad_token_id,
                          draft_prompt_len=shape.draft_prompt_len)
    t, dt = shape.prompt_len, jnp.dtype(cfg_t.text.dtype)
    row = lambda dtype, *rest: _placed(m, ("batch",) + (None,) * len(rest), (b, *rest), dtype)  # noqa: E731
    mrope = bool(cfg_t.text.rope.mrope_section)
    media = visual_pruning.Media(
        embeddings=_placed(m, ("batch", "seq", "embed"), (b, t, cfg_t.text.d_model), dt),
        positions=row(jnp.int32, t, 3) if mrope else row(jnp.int32, t), delta=row(jnp.int32),
        kind=row(jnp.int32, t), keep=row(jnp.int32, 2),
        draft_embeddings=_placed(m, ("batch", "seq", "embed"), (b, t, cfg_d.text.d_model), dt))
    key = jax.ShapeDtypeStruct(jax.eval_shape(lambda: jax.random.key(0)).shape, jax.random.key(0).dtype,
                               sharding=NamedSharding(m, PartitionSpec()))
    args = (row(jnp.int32, t), row(jnp.int32), row(jnp.float32), row(jnp.int32), key, row(jnp.float32),
            row(jnp.int32), row(jnp.int32), media)
    draft_spec = DraftSpec(kind="model")

    def prefill(lm_t, lm_d, *a):
        with sharding.use(m, "inference"):
            return spec.spec_prefill(run, lm_t, build_drafter(draft_spec, lm_t, lm_d), *a)

    def decode(lm_t, lm_d, state, temperature):
        with sharding.use(m, "inference"):
            return spec.spec_decode(run, lm_t, build_drafter(draft_spec, lm_t, lm_d), state, temperature)

    state = jax.eval_shape(prefill, lm_t, lm_d, *args)
    placed = _state_shardings(state, lm_t, lm_d, m)
    exp_prefill = jax.export.export(jax.jit(prefill, out_shardings=placed), platforms=["tpu"])(lm_t, lm_d, *args)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, placed)
    exp_decode = jax.export.export(jax.jit(decode, out_shardings=placed, donate_argnums=2), platforms=["tpu"])(
        lm_t, lm_d, state, args[2])
    return Lowered(preset.name, (data, model), exp_prefill, exp_decode,
                   _bytes(exp_decode, preset, layers))


_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "i1": 1, "i8": 1, "ui8": 1, "i32": 4, "ui32": 4, "i64": 8,
                "ui64": 8}


def per_chip_inputs(exported: jax.export.Exported) -> dict[str, int]:
    """{input's path: bytes one chip holds of it}, read off the exported StableHLO: each argument of `main` with
    its shape, element type and Shardy sharding (the mesh axes cutting each dimension)."""
    text = exported.mlir_module()
    sizes = {k: int(v) for k, v in re.findall(r'"(\w+)"=(\d+)', re.search(r"sdy\.mesh @mesh = <\[(.*?)\]>", text)[1])}
    main = re.search(r"func\.func public @main\((.*?)\) ->", text, re.S)[1]
    out = {}
    for arg in re.split(r"%arg\d+: ", main)[1:]:
        *shape, elem = re.match(r"tensor<([^>]*)>", arg)[1].split("x")
        placed = re.search(r"#sdy\.sharding<@mesh, \[(.*?)\]>", arg)
        dims, name = placed[1] if placed else "", re.search(r'loc\("([^"]+)"\)', arg)[1]
        cuts = [math.prod(sizes[a] for a in re.findall(r'"(\w+)"', d)) for d in re.findall(r"\{([^}]*)\}", dims)]
        cuts += [1] * (len(shape) - len(cuts))
        out[name] = math.prod(math.ceil(int(n) / c) for n, c in zip(shape, cuts, strict=True)) * _DTYPE_BYTES[elem]
    return out


def _bytes(exp: jax.export.Exported, preset: paper_targets.TpuPreset, layers: int) -> dict[str, float]:
    """Per-chip bytes of the decode program's inputs, by part, scaled from `layers` exported layers to the models'
    full depth (layers and caches are per-layer alike)."""
    full = {"target": preset.target.build_config()[1].text.n_layers,
            "draft": preset.draft.build_config()[1].text.n_layers}
    out = {"target_weights": 0.0, "draft_weights": 0.0, "target_kv": 0.0, "draft_kv": 0.0}
    for name, n in per_chip_inputs(exp).items():
        who = "target" if name.startswith(("lm_t.", "state.t_cache")) else "draft"
        scale = full[who] / layers if layers else 1
        if name.startswith(("lm_t.", "lm_d.")):
            out[f"{who}_weights"] += n * (scale if ".layers[" in name else 1)
        elif name.startswith(("state.t_cache", "state.d_cache")):
            out[f"{who}_kv"] += n * scale
    return out


def towers_bytes(preset: paper_targets.TpuPreset, tp: int) -> float:
    """Per-chip bytes of both models' vision towers (and projectors) under the inference rules: they run in a
    program of their own (`VisionLM.embed`), so they are not inputs of the exported loop."""
    return sum(math.prod(s) * b / n for m in (preset.target, preset.draft)
               for name, s, b, n in paper_targets.param_shards(m, tp) if not name.startswith("lm/"))


def report(rows: list[Lowered]) -> str:
    """A markdown table: per-chip GiB of weights and KV caches from the exported shardings, next to HBM."""
    head = ["| preset | chips (data x model) | target LM | draft LM | KV caches | towers | total | HBM (v6e / v5p) |",
            "|---|---|---|---|---|---|---|---|"]
    g = 2**30
    for r in rows:
        b = r.bytes_per_chip
        towers = towers_bytes(paper_targets.presets()[r.preset], r.mesh[1])
        total = sum(b.values()) + towers
        head.append(f"| {r.preset} | {r.mesh[0]} x {r.mesh[1]} | {b['target_weights'] / g:.1f} | "
                    f"{b['draft_weights'] / g:.1f} | {(b['target_kv'] + b['draft_kv']) / g:.2f} | {towers / g:.1f} | "
                    f"{total / g:.1f} | {paper_targets.hbm_gib('v6e'):.0f} / {paper_targets.hbm_gib('v5p'):.0f} |")
    return "\n".join(head)


#: Under `--memory-table`: what the exact mode holds.
EXACT_BYTES = ("The exact mode (LMConfig.matmul == \"exact\") holds the same bytes per chip: its o and down "
               "projections are cut on their outputs instead of their inputs, into shards of the same sizes.")


def _project(chip_name: str, tp: int, context: int) -> int:
    """`--project CHIP`: the cost model's table for the paper's pairs (one row per target / draft pair)."""
    from sage_jax.decoding import budget as budget_lib
    from sage_jax.decoding import cost_model
    from sage_jax.decoding.policies import TreePolicy
    from sage_jax.io import lm_checkpoint, loader

    if tp < 1:
        raise cli.BadInput(f"--tp must be >= 1, got {tp}")
    if context < 1:
        raise cli.BadInput(f"--context must be >= 1, got {context}")
    chip = cost_model.published()[chip_name]
    pol = TreePolicy.sage()
    draft = loader.default_draft()
    prior = (lm_checkpoint.read_acceptance(draft) if draft else {}).get("policies", {}).get(pol.name)
    stats = budget_lib.AcceptanceStats.from_json(prior) if prior and (prior["n_max"], prior["d_cap"]) == (
        pol.n_max, pol.d_cap) else None
    seen, rows, exact = set(), [], []
    for preset in paper_targets.presets().values():
        pair = (preset.target, preset.draft)
        if preset.draft is None or pair in seen:
            continue
        seen.add(pair)
        rows.append(cost_model.project(preset, chip, tp=tp, context=context, policy=pol, acceptance=stats))
        exact.append(cost_model.project(preset, chip, tp=tp, context=context, policy=pol, acceptance=stats,
                                        matmul="exact"))
    print(f"Predicted by the roofline model (sage_jax.decoding.cost_model) for {tp} x {chip_name} "
          f"({chip.flops / 1e12:.0f} bf16 TFLOP/s, {chip.bandwidth / 1e9:.0f} GB/s HBM per chip), bf16, batch 1, "
          f"{context} tokens attended; the paper's τ counts accepted draft tokens (a step commits τ + 1); our "
          f"acceptance: the shipped SmolLM2 head's per-rank record{'' if stats else ' (not in this checkout)'}\n")
    print(cost_model.projection_table(rows))
    print(f"\nThe exact mode (LMConfig.matmul == \"exact\": speculative output equal to plain decoding bit for bit) on "
          f"the same chips: matmuls in {chip.kind.upper()} row tiles of {cost_model.exact_tiles(chip.kind)[0]}, each "
          f"reading every weight; attention in tiles of {cost_model.exact_tiles(chip.kind)[1]} queries, each reading "
          f"the KV cache; all-gathers instead of all-reduces. Tax: 1 - exact / fast tokens/s\n")
    print(cost_model.exact_mode_table(rows, exact))
    return 0


def _main(argv: list[str] | None) -> int:
    p = cli.Parser(prog="python -m sage_jax.lowering", description=__doc__.split("\n\n")[0])
    pairs = [n for n, pr in paper_targets.presets().items() if pr.draft is not None and pr.tp == 8]
    p.add_argument("--preset", action="append", choices=pairs, help=f"default: {', '.join(pairs)}")
    p.add_argument("--mesh", action="append", metavar="DxM", help="data x model chips, e.g. 2x8 (default: "
                   + ", ".join(f"{d}x{m}" for d, m in MESHES.values()) + ")")
    p.add_argument("--layers", type=cli.integer(0, 1000), default=0, metavar="N",
                   help="real-sized layers exported per model, "
                   "their bytes scaled to full depth (default 0: the whole models)")
    p.add_argument("--prompt-len", type=cli.integer(1, cli.MAX_TOKENS), default=Shape.prompt_len, metavar="T")
    p.add_argument("--memory-table", action="store_true",
                   help="print every preset's memory per chip by the inference rules (nothing exported) and exit")
    p.add_argument("--project", metavar="CHIP", choices=sorted(paper_targets.chips()),
                   help="print instead the cost model's tokens/s of AR and SAGE for the paper's pairs on CHIP "
                   "(sage_jax.decoding.cost_model), beside the paper's own figures, then in the exact mode, and exit")
    p.add_argument("--matmul", choices=("auto", "exact"), default="auto",
                   help="export the fast mode (auto, default) or the exact mode: speculative output equal to plain "
                   "decoding bit for bit, its layers laid out with no sum across chips")
    p.add_argument("--tp", type=cli.integer(1, 4096), default=8, metavar="N",
                   help="--project: chips per pair, tensor-parallel "
                   "(default 8)")
    p.add_argument("--context", type=cli.integer(1, cli.MAX_TOKENS), default=8192, metavar="T",
                   help="--project: tokens each step attends to (default 8192: a prompt with a video)")
    args = p.parse_args(argv)
    if args.project:
        return _project(args.project, args.tp, args.context)
    if args.memory_table:
        print(f"bf16 weights; KV cache for batch 1 x 8192 tokens per model\n\n{paper_targets.table()}\n\n{EXACT_BYTES}")
        return 0
    meshes = []
    for text in args.mesh or [f"{d}x{m}" for d, m in MESHES.values()]:
        try:
            d, m = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise cli.BadInput(f"--mesh takes DATAxMODEL chip counts such as 2x8, got {text!r}") from None
        if d < 1 or m < 1:
            raise cli.BadInput(f"--mesh sizes must be >= 1, got {text!r}")
        meshes.append((d, m))
    if args.layers < 0:
        raise cli.BadInput(f"--layers must be >= 0, got {args.layers}")
    if args.prompt_len < 16:
        raise cli.BadInput(f"--prompt-len must be >= 16, got {args.prompt_len}")
    shape = Shape(prompt_len=args.prompt_len, draft_prompt_len=max(16, args.prompt_len // 4))
    rows = []
    for name in args.preset or pairs:
        for d, m in meshes:
            with cli.reported(ValueError):
                rows.append(lower(paper_targets.presets()[name], d, m, layers=args.layers, shape=shape,
                                  matmul=args.matmul))
    print(f"GiB per chip, bf16: the language models' weights and KV caches as the exported decode loop takes them "
          f"(one row per data replica, a {shape.prompt_len}-token prompt, the draft's pruned to "
          f"{shape.draft_prompt_len}, {shape.max_new_tokens} new tokens); the vision towers (their own program) by "
          f"the inference rules\n")
    print(report(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
