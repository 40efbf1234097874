"""The roofline cost model: its counts against XLA's own cost analysis, its prediction against this CPU's measured
step costs, the chips' published figures, and the budget chooser on a modelled accelerator."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.decoding import budget, cost_model, widths
from sage_jax.decoding.policies import TreePolicy
from sage_jax.io import paper_targets
from sage_jax.models.config import LMConfig
from sage_jax.models.visibility import Visibility

CAPACITY = 256


def _verify_program(lm, width: int):
    """The verify forward (+ LM head) of `width` rows after a half-full cache of `CAPACITY` slots, compiled."""
    context = CAPACITY // 2
    length, pad = jnp.full((1,), context, jnp.int32), jnp.zeros((1,), jnp.int32)

    def verify(lm, cache, tokens):
        pos = context + jnp.arange(width, dtype=jnp.int32)[None]
        hidden, _ = lm.forward(tokens, pos, Visibility.chain(length, pad, width), cache, length, write=False)
        return lm.head(hidden)

    cache = lm.init_cache(1, CAPACITY)
    return jax.jit(verify).lower(lm, cache, jnp.ones((1, width), jnp.int32)).compile()


@pytest.mark.parametrize("width", [1, 8, 64])
def test_counts_match_xla_cost_analysis(tiny_lm, width):
    """The model's flops for a verify forward are XLA's own count within 15% (XLA adds the elementwise ops and
    softmax the model leaves out). Its bytes at one row, where the weights and the cache are nearly all of it, are
    XLA's bytes accessed within 25%; each further row XLA:CPU counts at several times the model's activations,
    since it sums every unfused op's operands and materialises attention's scores, which a fused kernel (the
    Pallas tree attention, XLA:TPU's fusions) keeps on chip."""
    cfg = dict(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, mlp_dim=768, vocab_size=2048,
               matmul="xla")
    model = tiny_lm(0, **cfg)
    ca = _verify_program(model.serving(), width).cost_analysis()
    ca = ca[0] if isinstance(ca, list | tuple) else ca
    # XLA's dense path attends over the whole cache capacity, masked: count that many tokens.
    pred = cost_model.forward_cost(cost_model.Arch.of(model.cfg), width, cost_model.published()["v6e"],
                                   context=CAPACITY)
    assert 0.85 < pred.flops / ca["flops"] < 1.15, (pred.flops, ca["flops"])
    if width == 1:
        assert 0.75 < pred.bytes / ca["bytes accessed"] < 1.25, (pred.bytes, ca["bytes accessed"])
    else:
        assert pred.bytes < ca["bytes accessed"]


@pytest.mark.integration  # timed: run on a quiet machine, not beside another test process
def test_predicted_against_measured_step_costs_on_this_cpu(tiny_lm):
    """On this CPU, measured as a `Chip` (`measure_host`), the model predicts a 24M-parameter LM's verify forward at
    widths 1 ... 64 within a factor 3 of the time measured as `--budget auto` measures it, and says which end is
    dearer. A roofline has no per-op dispatch (XLA:CPU runs a step's few hundred small ops one by one, several
    milliseconds at one row here), so on a CPU it reads low at few rows and its curve rises more steeply than the
    measured one: the measured profile, not this model, drives `--budget auto` there."""
    cfg = dict(d_model=512, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, mlp_dim=1536, vocab_size=8192,
               tie_embeddings=True, qkv_bias=False)
    model = tiny_lm(0, **cfg)
    lm = model.serving()
    ws = [2, 8, 32, 64]
    prof = budget.measure_profile(lm, None, budget_self_spec(), CAPACITY, ws, [1], context=CAPACITY // 2, repeats=3)
    host = cost_model.measure_host(size_mb=128, repeats=3)
    arch = cost_model.Arch.of(model.cfg)
    pred = cost_model.widths_table(arch, host, [1] + ws, context=CAPACITY)
    meas = np.asarray([prof.ar_ms] + prof.verify_ms)
    ratio = pred / meas
    assert np.all((ratio > 1 / 3) & (ratio < 3)), dict(zip([1] + ws, zip(pred.round(2), meas.round(2))))
    assert pred[-1] > 2 * pred[0] and meas[-1] > 2 * meas[0]


def budget_self_spec():
    from sage_jax.decoding.drafters import DraftSpec

    return DraftSpec(kind="self", n_layers=1)


def test_published_chips_and_device_kinds():
    chips = cost_model.published()
    assert {"v5e", "v6e", "v5p", "h100", "h200"} <= set(chips)
    v6e = chips["v6e"]
    assert v6e.flops == 918e12 and v6e.bandwidth == 1640e9 and v6e.hbm_gib == paper_targets.hbm_gib("v6e")
    assert cost_model.chip_for("TPU v6 lite", chips) is v6e
    assert cost_model.chip_for("TPU v5 lite", chips) is chips["v5e"]
    assert cost_model.chip_for("TPU v5p", chips) is chips["v5p"]
    assert cost_model.chip_for("NVIDIA H100 80GB HBM3", chips) is chips["h100"]
    assert cost_model.chip_for("NVIDIA H200", chips) is chips["h200"]
    assert cost_model.chip_for("cpu", chips) is None
    assert {n: c.kind for n, c in chips.items()} == {
        "v4": "tpu", "v5e": "tpu", "v5p": "tpu", "v6e": "tpu", "h100": "gpu", "h200": "gpu", "h20": "gpu"}


def _paper_pair():
    preset = paper_targets.presets()["qwen2.5-vl-72b+7b"]
    _, t_cfg = preset.target.build_config()
    _, d_cfg = preset.draft.build_config()
    return cost_model.Arch.of(t_cfg.text), cost_model.Arch.of(d_cfg.text)


def test_a_72b_verify_is_flat_on_a_tpu_and_steep_on_a_cpu_like_chip():
    """Qwen2.5-VL-72B in bf16 on 8 v6e chips: a 64-node verify costs under 1.25 plain steps (weights dominate), and
    the step is memory-bound at one row, compute-bound at 1,024; on a chip with a CPU's flops-to-bandwidth ratio
    (100 GFLOP/s against 20 GB/s) the same verify costs several plain steps."""
    target, _ = _paper_pair()
    v6e = cost_model.published()["v6e"]
    one = cost_model.forward_cost(target, 1, v6e, tp=8, context=8192)
    assert one.bound == "memory"
    assert cost_model.forward_cost(target, 65, v6e, tp=8, context=8192).seconds < 1.25 * one.seconds
    assert cost_model.forward_cost(target, 1024, v6e, tp=8, context=8192).bound == "compute"
    assert cost_model.flat_until(target, v6e, tp=8, context=8192) >= 64
    cpu_like = dataclasses.replace(v6e, flops=100e9, bandwidth=20e9, efficiency=(1.0, 1.0))
    cpu_one = cost_model.forward_cost(target, 1, cpu_like, tp=8, context=8192).seconds
    assert cost_model.forward_cost(target, 65, cpu_like, tp=8, context=8192).seconds > 4 * cpu_one


def test_the_exact_mode_is_never_cheaper_than_the_fast_mode():
    """On every published chip, one chip or eight, each forward of the paper's pair (a plain step, a draft level, a
    verify) and each SAGE step cost at least as much in the exact mode as in the fast mode, and so do the
    projected AR and SAGE steps."""
    target, draft = _paper_pair()
    pol = TreePolicy.sage()
    for chip in cost_model.published().values():
        for tp in (1, 8):
            for arch in (target, draft):
                for width in (1, 2, 16, 17, 65, 128, 129, 1024):
                    for verify in (False, True):
                        kw = dict(tp=tp, context=8192, verify=verify)
                        fast = cost_model.forward_cost(arch, width, chip, **kw)
                        exact = cost_model.forward_cost(arch, width, chip, matmul="exact", **kw)
                        assert exact.seconds >= fast.seconds, (chip.name, tp, width, verify, exact, fast)
                        assert exact.flops >= fast.flops and exact.bytes >= fast.bytes
            kw = dict(nodes=pol.n_max, depth=pol.d_cap, frontier=pol.frontier, tp=tp, context=8192)
            assert (cost_model.sage_step_seconds(target, draft, chip, matmul="exact", **kw)
                    >= cost_model.sage_step_seconds(target, draft, chip, **kw))
        for name in ("qwen2.5-vl-72b+7b", "llava-ov-72b+7b"):
            fast, exact = (cost_model.project(paper_targets.presets()[name], chip, tp=8, matmul=m)
                           for m in ("xla", "exact"))
            assert exact.ar_tok_s <= fast.ar_tok_s and exact.paper_tok_s <= fast.paper_tok_s


def test_an_exact_verify_reads_the_weights_once_per_row_tile():
    """A verify of the 72B target in the exact mode reads every weight once per tile of rows (TPU and GPU: 128)
    and the KV cache once per tile of 16 queries: at 65 rows, the weights once and the cache 5 times; at 129 rows
    the weights twice. The bytes are the fast mode's plus exactly those extra reads."""
    from pallas_kernels.row_tiled_matmul import GPU_ROWS, TPU_ROWS

    assert TPU_ROWS == GPU_ROWS == 128
    target, _ = _paper_pair()
    c = target.lm
    weights = target.params * target.weight_bytes
    kv = 8192 * 2 * c.n_layers * c.n_kv_heads * c.head_dim * target.cache_bytes  # one read of the sequence's cache
    for name, reads in (("v6e", 1), ("h100", 1)):
        chip = cost_model.published()[name]
        fast = cost_model.forward_cost(target, 65, chip, tp=8, context=8192, verify=True)
        exact = cost_model.forward_cost(target, 65, chip, tp=8, context=8192, verify=True, matmul="exact")
        assert (exact.weight_reads, exact.kv_reads) == (reads, 5) and (fast.weight_reads, fast.kv_reads) == (1, 1)
        assert exact.bytes - fast.bytes == pytest.approx((reads - 1) * weights + 4 * kv, rel=1e-12)
    h100 = cost_model.published()["h100"]
    assert cost_model.forward_cost(target, 65, h100, tp=8, matmul="exact").bound == "memory"
    assert cost_model.forward_cost(target, 128, h100, tp=8, matmul="exact").weight_reads == 1
    assert cost_model.forward_cost(target, 129, h100, tp=8, matmul="exact").weight_reads == 2


def _small(**kw) -> cost_model.Arch:
    cfg = dict(vocab_size=1000, d_model=256, n_layers=2, n_heads=8, n_kv_heads=8, head_dim=32, mlp_dim=512)
    return cost_model.Arch.of(LMConfig(**{**cfg, **kw}), "bfloat16")


def test_exact_flops_by_hand():
    """A 3-row verify of 2 sequences on a GPU in the exact mode: the matmuls on 6 rows padded to one 128-row tile,
    attention on each sequence's 3 queries padded to a tile of 16, and per query, layer and kv head 2 mixed blocks
    x 2 dots x 2 x (16 queries x G heads) x 128 slots x H; a draft level (no verify) has no mixed blocks."""
    arch = _small(n_kv_heads=4)  # G = 2
    h100 = cost_model.published()["h100"]
    kw = dict(batch=2, context=300, matmul="exact")
    level = cost_model.forward_cost(arch, 3, h100, **kw)
    verify = cost_model.forward_cost(arch, 3, h100, verify=True, **kw)
    assert level.flops == 2 * 128 * arch.params + 4 * (2 * 16) * 300 * 8 * 32 * 2
    assert verify.flops - level.flops == 6 * 2 * 4 * (2 * 2 * 2 * (16 * 2) * 128 * 32)


def test_collectives_by_hand():
    """One chip: no collective in either mode. Eight: the fast mode all-reduces attention's and the MLP's outputs
    [rows, D] per layer; the exact mode all-gathers attention's output [rows, N H], the o projection's [rows, D],
    the MLP's activation [rows, F] and the down projection's [rows, D], each (tp - 1) / tp of it over the link in
    tp - 1 hops. With heads that 8 does not divide, attention runs whole on every chip: no collective for it in
    either mode."""
    v6e = cost_model.published()["v6e"]
    free = dataclasses.replace(v6e, flops=math.inf, bandwidth=math.inf, overhead_s=0.0)  # time = collectives
    rows, layers, d, f, nh = 2 * 3, 2, 256, 512, 8 * 32
    for arch, fast_arrays, exact_arrays in ((_small(), [d, d], [nh, d, f, d]),
                                            (_small(n_heads=4, n_kv_heads=2), [d], [f, d])):
        for matmul in ("xla", "exact"):
            one = cost_model.forward_cost(arch, 3, free, batch=2, matmul=matmul)
            assert one.collective_bytes == 0 and one.seconds == 0
        fast = cost_model.forward_cost(arch, 3, free, batch=2, tp=8)
        exact = cost_model.forward_cost(arch, 3, free, batch=2, tp=8, matmul="exact")
        assert fast.collective_bytes == layers * rows * sum(fast_arrays) * 2
        assert exact.collective_bytes == layers * rows * sum(exact_arrays) * 2
        assert fast.seconds == pytest.approx(2 * 7 / 8 * fast.collective_bytes / v6e.link
                                             + layers * len(fast_arrays) * 2 * 7 * v6e.hop_latency_s)
        assert exact.seconds == pytest.approx(7 / 8 * exact.collective_bytes / v6e.link
                                              + layers * len(exact_arrays) * 7 * v6e.hop_latency_s)


def _decaying_acceptance(pol: TreePolicy) -> budget.AcceptanceStats:
    """A record of 1,000 full trees of a strong draft, consistent in itself: τ = d for d <= 8 in proportion to d²
    (mean 6.35, about the paper's reported τ), and its priority ranks accepted at c · 0.97^(rank - 1) (a draft
    unsure among many candidates), with c such that the ranks' acceptances add up to that mean."""
    acc = budget.AcceptanceStats(pol.n_max, pol.d_cap)
    d = np.arange(pol.d_cap + 1)
    acc.depth_hist[:] = np.where(d <= 8, 1000 * d**2 / np.sum(d[:9] ** 2), 0.0)
    mean_tau = float(np.sum(np.arange(pol.d_cap + 1) * acc.depth_hist) / 1000)
    decay = 0.97 ** np.arange(pol.n_max)
    acc.offered[1:] = 1000
    acc.accepted[1:] = 1000 * mean_tau * decay / decay.sum()
    acc.steps, acc.levels = 1000, 1000 * (pol.d_cap - 1)
    return acc


def test_chooser_on_a_modelled_accelerator_drafts_large_trees():
    """`--budget auto`'s chooser on the model's profile of the 72B pair on 8 v6e chips (where the verify is flat)
    picks a tree of >= 32 nodes; on the same pair costed as this kind of CPU it picks a small one."""
    target, draft = _paper_pair()
    pol = TreePolicy.sage()
    v_sizes, d_sizes = widths.verify_sizes(pol.tree_size), widths.draft_sizes(pol.frontier)
    v6e = cost_model.published()["v6e"]
    prof = cost_model.predicted_profile(target, draft, v6e, v_sizes, d_sizes, tp=8, context=8192)
    ch = budget.BudgetChooser(prof, n_max=pol.n_max, d_cap=pol.d_cap, frontier=pol.frontier,
                              acceptance=_decaying_acceptance(pol))
    n, _ = ch.choose()
    assert n >= 32 and ch.speedup(n, ch.best()[1]) > 1.5
    cpu_like = dataclasses.replace(v6e, flops=100e9, bandwidth=20e9, efficiency=(1.0, 1.0), overhead_s=0.0)
    prof_cpu = cost_model.predicted_profile(target, draft, cpu_like, v_sizes, d_sizes, tp=8, context=8192)
    ch_cpu = budget.BudgetChooser(prof_cpu, n_max=pol.n_max, d_cap=pol.d_cap, frontier=pol.frontier,
                                  acceptance=_decaying_acceptance(pol))
    assert ch_cpu.best()[0] < 32


def test_projection_table_for_both_paper_pairs():
    """`python -m sage_jax.lowering --project v6e`'s rows: both pairs fit 8 chips, AR runs at tens of tokens/s, SAGE
    at the paper's τ is predicted faster than AR, and the table names the paper's own figures."""
    from sage_jax import lowering

    v6e = cost_model.published()["v6e"]
    pol = TreePolicy.sage()
    rows = [cost_model.project(paper_targets.presets()[n], v6e, tp=8, acceptance=_decaying_acceptance(pol))
            for n in ("qwen2.5-vl-72b+7b", "llava-ov-72b+7b")]
    for r in rows:
        assert r.weights_gib_per_chip < v6e.hbm_gib
        assert 10 < r.ar_tok_s < 200 and r.paper_tok_s > 2 * r.ar_tok_s
        assert r.chosen[0] >= 32 and r.chosen_tok_s > r.ar_tok_s
    table = cost_model.projection_table(rows)
    assert "qwen2.5-vl-72b+7b" in table and "llava-ov-72b+7b" in table and "3.18x" in table and "3.36x" in table
    assert lowering.main(["--project", "v6e"]) == 0


@pytest.mark.integration  # 17-30 s: the default tier sits near its 15-minute limit
def test_engine_starts_from_the_model_on_an_accelerator_then_measures(tiny_lm, tmp_path, monkeypatch):
    """On a chip the model knows, `--budget auto`'s first request runs on the modelled profile (so it drafts the
    full tree where the model says verify is flat) and nothing is timed before it; the profile measured on the
    device replaces it after that request. Every output equals plain decoding."""
    from sage_jax.engine import Engine

    monkeypatch.setattr(cost_model, "device_chip", lambda: cost_model.published()["v6e"])
    measured = []
    real = budget.measure_profile
    monkeypatch.setattr(budget, "measure_profile", lambda *a, **k: measured.append(1) or real(*a, **k))
    eng = Engine(tiny_lm(0, matmul="xla"), tiny_lm(1, matmul="xla"), profile_dir=str(tmp_path))
    prompts = [[5, 6, 7, 8]]
    ar = eng.generate(prompts, policy="ar", max_new_tokens=12)
    ch = eng.chooser("sage", 4, 12)
    assert "v6e (model)" in ch.profile.device and measured == []
    first = eng.generate(prompts, policy="sage", max_new_tokens=12, budget="auto")
    assert first.stats.budget == (TreePolicy.sage().n_max, TreePolicy.sage().d_cap)  # no statistics: full tree
    assert measured == [1] and "(model)" not in ch.profile.device  # measured once, after the first request
    second = eng.generate(prompts, policy="sage", max_new_tokens=12, budget="auto")
    assert measured == [1]
    assert first.token_ids == ar.token_ids == second.token_ids
