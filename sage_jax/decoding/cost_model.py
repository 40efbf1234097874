"""A roofline model of a decoding step's time on TPUs and GPUs, from the flops and bytes it moves.

Each forward of a decoder over `w` new rows per sequence (a plain step: w = 1; a tree's verify: w = nodes + 1; a
draft level: w = its frontier), for `b` sequences that each attend to `context` cached tokens, on `tp` chips
tensor-parallel:

- flops: 2 · b · w · (the layers' weights + the LM head's), plus attention, 4 · b · w · context · N · H per layer;
- bytes: every weight once (the step's rows share the read), the KV cache read (2 · L · K · H · context per
  sequence) and written (the same per new row), and the activations between the fused kernels (about
  `ACTIVATION_VECTORS` vectors of D or F per row and layer);
- a chip's time: max(flops / achievable flops, bytes / achievable bandwidth), each shared by the `tp` chips, plus
  all-reduces of the rows' activations [rows, D], one after attention and one after the MLP in each layer (ring:
  2 (tp - 1) / tp of the bytes over the chip's link, and a latency per hop), plus a fixed overhead per forward.
  Where `tp` does not divide the query and kv heads, attention and its o projection run whole on every chip
  (`serving_lm.serving_layout`) and need no all-reduce; likewise the MLP where `tp` does not divide F.

Where `w` is small the weights' bytes dominate and the time hardly moves with `w`: with bf16 weights the flops
catch up with the bytes at w = (achievable flops) / (achievable bandwidth) rows over the batch, about 400 on a
v6e, 170 on a v5e, 120 on a v5p, 210 on an H100, 145 on an H200 and 26 on the paper's H20. That flat stretch is
where SAGE's large trees pay. A CPU in float32 at a verify's shapes reaches it within a few rows, so there they do
not.

The exact mode (`LMConfig.matmul == "exact"`: a row's bits do not depend on how many rows a forward holds, nor on
the mesh) changes four things, priced with `matmul="exact"`:

- matmuls run through `pallas_kernels.row_tiled_matmul` in fixed tiles of `TPU_ROWS` / `GPU_ROWS` (128) rows,
  each tile streaming the whole weight: the weights are read ceil(b · w / tile) times (once for a verify of up to
  128 rows), and the flops are those of the rows padded to whole tiles (on a GPU an upper bound on HBM traffic:
  the row tiles of one output block are launched side by side and may share it through L2);
- attention runs through the fixed-order kernel (`pallas_kernels.exact_attention`), which reads each sequence's KV
  cache once per tile of `QUERY_TILE` queries (ceil(w / QUERY_TILE) times) and computes every tile whole; in a
  speculative verify (`verify=True`) up to two `SLOT_BLOCK`-slot blocks per query are mixed (committed cache and
  the query's path) and computed for that query alone with the tile's fixed-shape dots, 2 blocks x 2 dots x
  2 · (QUERY_TILE · G) · SLOT_BLOCK · H flops per query, layer and kv head (G = N / K); a plain step or a draft
  level has none;
- tensor-parallel, it never sums across chips: every matmul is column-parallel on all-gathered activations, so
  each layer all-gathers attention's output [rows, N · H] and the o projection's [rows, D] (where the heads are
  cut), the MLP's activation [rows, F] and the down projection's [rows, D] (where F is cut). A ring all-gather
  moves (tp - 1) / tp of the gathered bytes over each chip's link in tp - 1 hops, half an all-reduce's;
- everything elementwise (norms, RoPE, the gated activation, residuals) runs in fixed row tiles too: a few vectors
  per row either way, left out here as in the fast mode.

Both modes count a chip's share of weights, cache and attention as 1 / tp of the whole, the replicated attention of
a model whose heads `tp` does not divide included: both lay it out alike, so what differs between them is what the
exact mode changes.

`Chip`s come from `configs/sage/paper_targets.py` (published peak bf16 flops, HBM bandwidth, interconnect; TPU or
GPU by name, `paper_targets.platform`);
`measure_host()` gives one for this machine, and `predicted_profile` turns either into the `budget.CostProfile` that
`--budget auto` starts from on an accelerator until its own measurements replace it. `Arch` counts a model's shapes:
`Arch.of(cfg)` for an `LMConfig`, `Arch.eagle(cfg, ...)` for an EAGLE-style head over it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import numpy as np

from sage_jax.decoding.budget import CostProfile
from sage_jax.io import paper_targets
from sage_jax.models.config import MATMULS, LMConfig

# Activations written and read between fused kernels, per row and layer, in vectors of D (or of F for the MLP's):
# the residual and norm (2), q, k, v and attention's output (4), the MLP's gate, up and their product (3 of F).
ACTIVATION_VECTORS_D, ACTIVATION_VECTORS_F = 6, 3
# Fractions of the published peaks a well-fused step reaches: HBM streaming, and matmul throughput at the shapes of a
# decoding step (tall, narrow activations against wide weights).
BANDWIDTH_EFFICIENCY, FLOPS_EFFICIENCY = 0.85, 0.6
#: Blocks of `SLOT_BLOCK` slots per query that the exact attention computes for that query alone in a verify.
MIXED_BLOCKS = 2


@functools.cache
def exact_tiles(kind: str) -> tuple[int, int, int]:
    """The exact mode's fixed tiles on a chip of `kind` ("tpu", "gpu", "cpu"): (matmul rows per tile, queries per
    attention tile, cache slots per attention block), as `pallas_kernels` runs them."""
    # Here: importing Pallas costs every command line 0.4 s.
    from pallas_kernels.exact_attention.blocks import QUERY_TILE, SLOT_BLOCK
    from pallas_kernels.row_tiled_matmul import CPU_ROWS, GPU_ROWS, TPU_ROWS

    rows = {"tpu": TPU_ROWS, "gpu": GPU_ROWS, "cpu": CPU_ROWS}
    if kind not in rows:
        raise ValueError(f"chip kind must be one of {', '.join(rows)}, got {kind!r}")
    return rows[kind], QUERY_TILE[kind], SLOT_BLOCK


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator (or this host, `measure_host`): peak dense bf16 FLOP/s, HBM bytes/s, the interconnect's
    bytes/s per chip for collectives (ICI or NVLink, one direction), latency per collective hop, overhead per
    forward (the launch of one compiled step), HBM GiB; `kind`: "tpu", "gpu" or "cpu" (the exact mode's tiles)."""

    name: str
    flops: float
    bandwidth: float
    link: float
    hbm_gib: float
    kind: str
    hop_latency_s: float = 2e-6
    overhead_s: float = 50e-6
    efficiency: tuple[float, float] = (FLOPS_EFFICIENCY, BANDWIDTH_EFFICIENCY)

    @classmethod
    def from_spec(cls, name: str, spec: paper_targets.ChipSpec) -> Chip:
        """From a chip's published figures (TFLOP/s, GB/s, Gbit/s of interconnect)."""
        return cls(name=name, flops=spec.bf16_tflops * 1e12, bandwidth=spec.hbm_gbps * 1e9,
                   link=spec.link_gbits * 1e9 / 8, hbm_gib=spec.hbm_gib, kind=paper_targets.platform(name))


def published() -> dict[str, Chip]:
    """The chips of `configs/sage/paper_targets.py` by name ("v5e", "v6e", "v5p", "h100", "h200", ...)."""
    return {name: Chip.from_spec(name, spec) for name, spec in paper_targets.chips().items()}


@dataclasses.dataclass(frozen=True)
class Arch:
    """A model's shapes for the cost model: its `LMConfig` (D, L, N, K, H, F), the LM head's rows (V, or a draft
    vocabulary), the parameters outside the layers that every row multiplies by (an EAGLE head's input projection),
    bytes per weight and per cached value."""

    lm: LMConfig
    head_rows: int
    extra_params: int = 0
    weight_bytes: int = 2
    cache_bytes: int = 2

    @classmethod
    def of(cls, cfg: LMConfig, dtype: str | None = None) -> Arch:
        """An `LMConfig`'s shapes, its weights and cache in `dtype` (default: the config's)."""
        return cls(cfg, cfg.vocab_size, weight_bytes=_bytes(dtype or cfg.param_dtype),
                   cache_bytes=_bytes(dtype or cfg.dtype))

    @classmethod
    def eagle(cls, cfg: LMConfig, head_rows: int | None = None, taps: int = 0, dtype: str | None = None) -> Arch:
        """An EAGLE-style head over the target `cfg`: one decoder layer of the target's shape, its input
        projection (2D -> D, with `taps` tapped layers (taps + 1)D -> D), and an LM head of `head_rows` rows
        (default: the target's vocabulary)."""
        return dataclasses.replace(cls.of(cfg, dtype), lm=cfg.replace(n_layers=1),
                                   head_rows=head_rows or cfg.vocab_size,
                                   extra_params=(max(taps, 1) + 1) * cfg.d_model * cfg.d_model)

    @property
    def layer_params(self) -> int:
        c = self.lm
        return c.d_model * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads) + 3 * c.d_model * c.mlp_dim

    @property
    def params(self) -> int:
        """Parameters every row multiplies by: the layers, the LM head and any input projection (the embedding
        table is only gathered from)."""
        return self.lm.n_layers * self.layer_params + self.head_rows * self.lm.d_model + self.extra_params


def draft_arch(spec, target_cfg, draft) -> Arch:
    """The shapes of a decoding loop's draft (`drafters.DraftSpec` `spec`): a self-draft's first layers of the
    target, an EAGLE-style head (`EagleWeights`: its own vocabulary's rows, its taps), or a separate LM."""
    if spec.kind == "self":
        return Arch.of(target_cfg.replace(n_layers=spec.n_layers))
    if spec.kind == "eagle":
        rows = draft.vocab.size if draft.vocab is not None else draft.cfg.vocab_size
        return Arch.eagle(draft.cfg, rows, taps=len(draft.taps))
    return Arch.of(draft.cfg)


def _bytes(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[str(dtype)]


@dataclasses.dataclass(frozen=True)
class StepCost:
    """One forward's work (totals over the `tp` chips) and its predicted seconds (on each chip, in parallel);
    `collective_bytes`: the arrays all-reduced (fast mode) or all-gathered (exact mode), whole; how many times
    the weights and each sequence's KV cache are read (1 but in the exact mode's tiles)."""

    flops: float
    bytes: float
    collective_bytes: float
    seconds: float
    bound: str  # "memory", "compute" or "collective": the largest term
    weight_reads: int = 1
    kv_reads: int = 1


def forward_cost(arch: Arch, width: int, chip: Chip, *, batch: int = 1, context: int = 1024, tp: int = 1,
                 matmul: str = "xla", verify: bool = False) -> StepCost:
    """Predicted cost of one forward over `width` new rows for each of `batch` sequences (module docstring), with
    the serving layers' `matmul` ("auto" and "xla": XLA's dots and attention; "exact": the shape-invariant mode's
    kernels); `verify`: a speculative verify (the exact attention's mixed blocks)."""
    if matmul not in MATMULS:
        raise ValueError(f"matmul must be one of {', '.join(MATMULS)}, got {matmul!r}")
    c = arch.lm
    rows = batch * width
    weight_reads = kv_reads = 1
    mm_rows, attn_rows, mixed = rows, rows, 0
    if matmul == "exact":
        row_tile, query_tile, slot_block = exact_tiles(chip.kind)
        weight_reads, kv_reads = -(-rows // row_tile), -(-width // query_tile)
        mm_rows, attn_rows = weight_reads * row_tile, batch * kv_reads * query_tile
        if verify:  # per query, layer and kv head: the blocks x (scores, weighted sum) over a tile of G heads each
            mixed = rows * c.n_layers * c.n_kv_heads * MIXED_BLOCKS * 2 * 2 * (
                query_tile * (c.n_heads // c.n_kv_heads)) * slot_block * c.head_dim
    attn = 4 * attn_rows * context * c.n_heads * c.head_dim * c.n_layers + mixed
    flops = 2 * mm_rows * arch.params + attn
    kv_row = 2 * c.n_layers * c.n_kv_heads * c.head_dim * arch.cache_bytes
    acts = rows * c.n_layers * (ACTIVATION_VECTORS_D * c.d_model + ACTIVATION_VECTORS_F * c.mlp_dim) \
        * arch.cache_bytes * 2  # written, then read
    nbytes = (arch.params * arch.weight_bytes * weight_reads + batch * context * kv_row * kv_reads + rows * kv_row
              + acts)
    f_eff, b_eff = chip.efficiency
    t_flops = flops / tp / (chip.flops * f_eff)
    t_bytes = nbytes / tp / (chip.bandwidth * b_eff)
    coll_bytes, t_coll = _collectives(arch, rows, chip, tp, exact=matmul == "exact")
    terms = {"compute": t_flops, "memory": t_bytes, "collective": t_coll}
    seconds = max(t_flops, t_bytes) + t_coll + chip.overhead_s
    return StepCost(flops=float(flops), bytes=float(nbytes), collective_bytes=float(coll_bytes),
                    seconds=float(seconds), bound=max(terms, key=terms.get), weight_reads=weight_reads,
                    kv_reads=kv_reads)


def _collectives(arch: Arch, rows: int, chip: Chip, tp: int, *, exact: bool) -> tuple[float, float]:
    """(bytes of the arrays that cross chips, seconds) of one forward over `rows` rows on `tp` chips: the fast
    mode's all-reduces of [rows, D] (attention's and the MLP's outputs, where they are cut), or the exact mode's
    all-gathers (module docstring)."""
    c = arch.lm
    if tp == 1:
        return 0.0, 0.0
    heads_cut, mlp_cut = c.n_heads % tp == 0 and c.n_kv_heads % tp == 0, c.mlp_dim % tp == 0
    if not exact:  # ring all-reduce: a reduce-scatter and an all-gather, each (tp - 1) hops
        n = heads_cut + mlp_cut
        nbytes = n * c.n_layers * rows * c.d_model * arch.cache_bytes
        return nbytes, 2 * (tp - 1) / tp * nbytes / chip.link + n * c.n_layers * 2 * (tp - 1) * chip.hop_latency_s
    gathered = []  # per layer, the width of each all-gathered [rows, width] array
    if heads_cut:
        gathered += [c.n_heads * c.head_dim, c.d_model]  # attention's output, the o projection's
    if mlp_cut:
        gathered += [c.mlp_dim, c.d_model]  # the MLP's activation, the down projection's output
    nbytes = c.n_layers * rows * sum(gathered) * arch.cache_bytes
    return nbytes, (tp - 1) / tp * nbytes / chip.link + c.n_layers * len(gathered) * (tp - 1) * chip.hop_latency_s


def predicted_profile(target: Arch, draft: Arch | None, chip: Chip, verify_widths, draft_widths, *,
                      context: int = 1024, tp: int = 1, matmul: str = "xla") -> CostProfile:
    """The `CostProfile` (ms per forward at each width) the model predicts for `target` verifying and `draft`
    drafting (None: a self-draft is costed as the target) on `tp` chips, with the serving layers' `matmul`."""
    draft = draft or target
    ms = lambda a, w, verify=False: forward_cost(  # noqa: E731
        a, w, chip, context=context, tp=tp, matmul=matmul, verify=verify).seconds * 1e3
    mode = " exact" if matmul == "exact" else ""
    return CostProfile(device=f"{chip.name}{mode} (model)", verify_widths=list(verify_widths),
                       verify_ms=[ms(target, w, True) for w in verify_widths], draft_widths=list(draft_widths),
                       draft_ms=[ms(draft, w) for w in draft_widths], ar_ms=ms(target, 1))


def chip_for(device_kind: str, chips: dict[str, Chip]) -> Chip | None:
    """The chip of `chips` that jax's `device_kind` names ("TPU v6 lite" -> v6e, "NVIDIA H100 80GB HBM3" -> h100),
    or None (a CPU, or a chip not listed)."""
    kind = device_kind.lower()
    aliases = {"v5 lite": "v5e", "v5litepod": "v5e", "v6 lite": "v6e", "v5p": "v5p", "v5": "v5p", "v4": "v4",
               "h200": "h200", "h100": "h100", "h20": "h20"}
    for needle, name in aliases.items():
        if needle in kind and name in chips:
            return chips[name]
    return None


def device_chip() -> Chip | None:
    """The published chip this process's first device is (`chip_for`), None on a CPU or a chip not listed."""
    import jax

    dev = jax.devices()[0]
    return None if dev.platform == "cpu" else chip_for(dev.device_kind, published())


def measure_host(size_mb: int = 256, rows: int = 64, n: int = 2048, repeats: int = 5) -> Chip:
    """This machine as a `Chip`: its streaming bandwidth (a float32 reduction over `size_mb` MB) and its float32
    matmul throughput at a verify step's shape ([rows, n] @ [n, n]: few rows against a wide weight, which a CPU
    runs far below its peak), both through XLA, the best of `repeats` runs; no interconnect."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((size_mb * 2**20 // 4,), jnp.float32)
    a, w = jnp.ones((rows, n), jnp.float32), jnp.ones((n, n), jnp.float32)
    reduce_, matmul = jax.jit(jnp.sum), jax.jit(lambda a: a @ w)

    def best(fn, arg):
        jax.block_until_ready(fn(arg))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(arg))
            ts.append(time.perf_counter() - t0)
        return min(ts)

    bandwidth = x.nbytes / best(reduce_, x)
    flops = 2 * rows * n * n / best(matmul, a)
    # Measured peaks are what a step reaches at best, so no efficiency discount; the overhead is a CPU step's
    # dispatch and small ops (a few tenths of a millisecond on 2 cores).
    return Chip(name=f"{jax.devices()[0].device_kind} (measured)", flops=flops, bandwidth=bandwidth,
                link=math.inf, hbm_gib=0.0, kind=_platform_kind(jax.devices()[0].platform), overhead_s=0.5e-3,
                efficiency=(1.0, 1.0))


def _platform_kind(platform: str) -> str:
    return {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(platform, "cpu")


def flat_until(arch: Arch, chip: Chip, *, batch: int = 1, context: int = 1024, tp: int = 1, factor: float = 1.25,
               widths=tuple(2**i for i in range(11)), matmul: str = "xla") -> int:
    """The widest of `widths` whose verify costs at most `factor` times a one-row step's: how large a tree
    verifies for about the price of one token."""
    kw = dict(batch=batch, context=context, tp=tp, matmul=matmul)
    one = forward_cost(arch, 1, chip, **kw).seconds
    ok = [w for w in widths if forward_cost(arch, w, chip, verify=True, **kw).seconds <= factor * one]
    return int(max(ok)) if ok else 1


def sage_step_seconds(target: Arch, draft: Arch, chip: Chip, *, nodes: int, depth: int, frontier: int,
                      context: int = 1024, tp: int = 1, batch: int = 1, matmul: str = "xla") -> float:
    """One speculative step: a catch-up draft forward of 2 rows, `depth - 1` draft levels at the frontier's width,
    and the target's verify of the tree's `nodes` + the root, with the serving layers' `matmul`."""
    kw = dict(batch=batch, context=context, tp=tp, matmul=matmul)
    d = lambda w: forward_cost(draft, w, chip, **kw).seconds  # noqa: E731
    v = forward_cost(target, nodes + 1, chip, verify=True, **kw).seconds
    return float(d(2) + max(depth - 1, 0) * d(frontier) + v)


def widths_table(arch: Arch, chip: Chip, widths, **kw) -> np.ndarray:
    """Predicted ms of a forward at each of `widths`."""
    return np.asarray([forward_cost(arch, w, chip, **kw).seconds * 1e3 for w in widths])


@dataclasses.dataclass(frozen=True)
class Projection:
    """A pair's predicted decoding on `tp` chips with the serving layers' `matmul`: plain decoding, SAGE at the
    paper's τ on its full trees (`verify`: the target's verify of such a tree), and SAGE at the budget
    `--budget auto` would choose there from an acceptance record (None without one)."""

    pair: str
    chip: str
    tp: int
    matmul: str
    weights_gib_per_chip: float
    ar_ms: float
    flat_rows: int
    paper_tree: tuple[int, int]
    verify: StepCost
    paper_tok_s: float
    chosen: tuple[int, int] | None
    chosen_tokens_per_step: float | None
    chosen_tok_s: float | None
    reported: paper_targets.Reported | None

    @property
    def ar_tok_s(self) -> float:
        return 1e3 / self.ar_ms


def project(preset: paper_targets.TpuPreset, chip: Chip, *, tp: int, context: int = 8192, policy=None,
            acceptance=None, matmul: str = "xla") -> Projection:
    """`preset`'s target and draft (bf16) on `tp` chips of `chip`, attending to `context` tokens (a video prompt's
    thousands of visual tokens), their serving layers' `matmul` ("exact": the shape-invariant mode): AR's step,
    the widest verify that costs about one step, SAGE's step with the policy's full tree (`policy`, default the
    paper's SAGE) accepting the paper's τ (the exact mode accepts as greedy decoding does), and with `acceptance`
    (an `AcceptanceStats` of that policy's sizes) the budget the chooser takes on the predicted profile."""
    from sage_jax.decoding.policies import TreePolicy

    pol = policy or TreePolicy.sage()
    _, t_cfg = preset.target.build_config(preset.dtype)
    _, d_cfg = preset.draft.build_config(preset.dtype)
    target, draft = Arch.of(t_cfg.text), Arch.of(d_cfg.text)
    kw = dict(context=context, tp=tp, matmul=matmul)
    ar = forward_cost(target, 1, chip, **kw).seconds
    weights = sum(a.params + a.head_rows * a.lm.d_model * (0 if a.lm.tie_embeddings else 1)
                  for a in (target, draft)) * 2 / tp / 2**30
    tree = (pol.n_max, pol.d_cap)
    step = sage_step_seconds(target, draft, chip, nodes=tree[0], depth=tree[1], frontier=pol.frontier, **kw)
    paper_tok_s = (preset.reported.tau + 1) / step if preset.reported else float("nan")
    chosen = per_step = chosen_tok_s = None
    if acceptance is not None:
        chosen, per_step, chosen_tok_s = auto_choice(target, draft, chip, acceptance, policy=pol, **kw)
    return Projection(pair=preset.name, chip=chip.name, tp=tp, matmul=matmul, weights_gib_per_chip=weights,
                      ar_ms=ar * 1e3, flat_rows=flat_until(target, chip, **kw), paper_tree=tree,
                      verify=forward_cost(target, tree[0] + 1, chip, verify=True, **kw), paper_tok_s=paper_tok_s,
                      chosen=chosen, chosen_tokens_per_step=per_step, chosen_tok_s=chosen_tok_s,
                      reported=preset.reported)


def auto_choice(target: Arch, draft: Arch | None, chip: Chip, acceptance, *, policy=None, context: int = 1024,
                tp: int = 1, matmul: str = "xla") -> tuple[tuple[int, int], float, float]:
    """The budget (nodes, depth) `--budget auto` takes for `target` drafted by `draft` (None: a self-draft) on `tp`
    chips of `chip` with the serving layers' `matmul`, from the predicted profile and `acceptance` (an
    `AcceptanceStats` of the policy's sizes), with the tokens per step it expects and the tokens/s that makes."""
    from sage_jax.decoding import budget as budget_lib
    from sage_jax.decoding import widths
    from sage_jax.decoding.policies import TreePolicy

    pol = policy or TreePolicy.sage()
    prof = predicted_profile(target, draft, chip, widths.verify_sizes(pol.tree_size),
                             widths.draft_sizes(pol.frontier), context=context, tp=tp, matmul=matmul)
    ch = budget_lib.BudgetChooser(prof, n_max=pol.n_max, d_cap=pol.d_cap, frontier=pol.frontier,
                                  acceptance=acceptance)
    chosen = ch.best()
    per_step = ch.expected_tau(*chosen) + 1
    return chosen, per_step, per_step / (ch.step_cost(*chosen) / 1e3)


def projection_table(rows: list[Projection]) -> str:
    """Markdown: each pair's predicted tokens/s of AR and of SAGE, beside what the paper measured on H20s."""
    out = ["| pair | chips | weights / chip (GiB) | AR tok/s | verify flat to (rows) | SAGE at the paper's τ "
           "(full tree N, D) | SAGE, `--budget auto` on our acceptance | paper (H20): AR tok/s, SAGE τ, speedup |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ours = "-" if r.chosen is None else (
            f"{r.chosen_tok_s:.1f} tok/s, {r.chosen_tok_s / r.ar_tok_s:.2f}x "
            f"(N {r.chosen[0]}, D {r.chosen[1]}, τ+1 {r.chosen_tokens_per_step:.2f})")
        rep = r.reported
        paper = "-" if rep is None else f"{rep.ar_tok_s:.2f}, τ {rep.tau:.2f}, {rep.speedup:.2f}x ({rep.benchmark})"
        at_tau = "-" if rep is None else (f"{r.paper_tok_s:.1f} tok/s, {r.paper_tok_s / r.ar_tok_s:.2f}x "
                                          f"(N {r.paper_tree[0]}, D {r.paper_tree[1]})")
        out.append(f"| {r.pair} | {r.tp} x {r.chip} | {r.weights_gib_per_chip:.1f} | {r.ar_tok_s:.1f} | "
                   f"{r.flat_rows} | {at_tau} | {ours} | {paper} |")
    return "\n".join(out)


def exact_mode_table(fast: list[Projection], exact: list[Projection]) -> str:
    """Markdown: each pair's predicted tokens/s of AR and of SAGE (the paper's τ, full tree) in the fast mode and in
    the exact mode (`project(..., matmul="exact")` of the same pairs), the exact mode's tax on each (1 - exact /
    fast), and what the exact mode's verify of the full tree costs: how many times it reads the target's weights
    and its KV cache, and its largest term."""
    out = ["| pair | chips | AR tok/s: fast / exact | SAGE tok/s at the paper's τ: fast / exact | exact tax: AR / "
           "SAGE | exact verify of N + 1 rows: weight reads, KV reads, bound | exact, `--budget auto` |",
           "|---|---|---|---|---|---|---|"]
    for f, e in zip(fast, exact, strict=True):
        if (f.pair, f.chip, f.tp, f.matmul, e.matmul) != (e.pair, e.chip, e.tp, "xla", "exact"):
            raise ValueError(f"not a fast and an exact projection of one pair: {f.pair} ({f.matmul}), "
                             f"{e.pair} ({e.matmul})")
        tax = lambda x, y: f"{100 * (1 - y / x):.1f}%"  # noqa: E731
        sage = "-" if f.reported is None else f"{f.paper_tok_s:.1f} / {e.paper_tok_s:.1f}"
        sage_tax = "-" if f.reported is None else tax(f.paper_tok_s, e.paper_tok_s)
        auto = "-" if e.chosen is None else (f"{e.chosen_tok_s:.1f} tok/s, {e.chosen_tok_s / e.ar_tok_s:.2f}x "
                                             f"(N {e.chosen[0]}, D {e.chosen[1]}, τ+1 {e.chosen_tokens_per_step:.2f})")
        v = e.verify
        out.append(f"| {f.pair} | {f.tp} x {f.chip} | {f.ar_tok_s:.1f} / {e.ar_tok_s:.1f} | {sage} | "
                   f"{tax(f.ar_tok_s, e.ar_tok_s)} / {sage_tax} | {v.weight_reads}, {v.kv_reads}, {v.bound} "
                   f"(N {e.paper_tree[0]}) | {auto} |")
    return "\n".join(out)
