"""The paper's pairs lowered for TPU from this CPU (`sage_jax.lowering`): the speculative prefill and decode loop of
Qwen2.5-VL-72B + 7B and LLaVA-OneVision-72B + 7B export for 4x4 and 8x8-chip meshes, with every weight and cache cut
as serving needs, and the bytes each chip holds in the exported programs are the bytes the sharding rules give."""

import glob
import math
import os
import re

import pytest

from sage_jax import lowering
from sage_jax.io import paper_targets

PAIRS = ("qwen2.5-vl-72b+7b", "llava-ov-72b+7b")


@pytest.fixture(scope="module")
def lowered():
    """{(preset, mesh name): Lowered}, the whole models (80 + 28 layers; about 15 s each here), hence -m integration
    for the tests that use it; the default suite lowers one real-sized layer of each model in the exact mode
    (`test_one_exact_layer_lowers_for_8_chips_without_a_sum_across_them`)."""
    return {(name, mesh): lowering.lower(paper_targets.presets()[name], *shape, layers=0)
            for name in PAIRS for mesh, shape in lowering.MESHES.items()}


def _lm_bytes(model: paper_targets.Model, tp: int) -> float:
    """Per-chip bytes of a model's language model under the inference rules, from its canonical parameters
    (`paper_targets`), an independent account of what the exported serving weights must come to."""
    return sum(math.prod(s) * b / n for name, s, b, n in paper_targets.param_shards(model, tp)
               if name.startswith("lm/"))


@pytest.mark.integration
@pytest.mark.parametrize("name", PAIRS)
@pytest.mark.parametrize("mesh", list(lowering.MESHES))
def test_the_pair_lowers_for_a_tpu_mesh_cut_as_serving_needs(lowered, name, mesh):
    data, model = lowering.MESHES[mesh]
    r = lowered[(name, mesh)]
    for exp in (r.prefill, r.decode):
        assert exp.platforms == ("tpu",) and exp.nr_devices == data * model
    text = r.decode.mlir_module()

    def spec(path):  # the Shardy sharding of the decode loop's input at `path`
        return re.search(rf'sharding<@mesh, \[([^\]]*)\]>[^%]*loc\("{re.escape(path)}"\)', text)[1]

    # The target's attention and MLP are tensor-parallel: fused rows cut over the model axis ...
    for w in ("qkv", "gate_up"):
        assert spec(f"lm_t.layers[0]['{w}']") == '{"model"}, {}'
    for w in ("o", "down"):
        assert spec(f"lm_t.layers[0]['{w}']") == '{}, {"model"}'
    # ... and its cache rows over the data replicas, its 8 kv heads one a chip.
    assert spec("state.t_cache.k[0]") == '{"data", "fsdp"}, {}, {"model"}, {}'
    # The 7B draft's 28 query heads do not split 8 ways: its attention stays whole on every chip, its MLP is cut.
    assert spec("lm_d.layers[0]['qkv']") == "{}, {}" and spec("lm_d.layers[0]['gate_up']") == '{"model"}, {}'
    assert spec("state.d_cache.k[0]") == '{"data", "fsdp"}, {}, {}, {}'
    # The prefill hands the loop its state as the loop takes it (no resharding between the two programs).
    pre = lowering.per_chip_inputs(r.prefill)
    assert lowering.per_chip_inputs(r.decode).keys() >= {k for k in pre if k.startswith("lm_")}
    out = re.search(r"func\.func public @main\(.*?\) -> \((.*?)\) \{", r.prefill.mlir_module(), re.S)[1]
    layers = paper_targets.presets()[name].target.build_config()[1].text.n_layers
    assert out.count('{"data", "fsdp"}, {}, {"model"}, {}') == 2 * layers  # the target cache's k and v, every layer


@pytest.mark.integration
@pytest.mark.parametrize("name", PAIRS)
def test_bytes_per_chip_are_the_rules_bytes_and_fit_the_chip(lowered, name):
    preset = paper_targets.presets()[name]
    for mesh in lowering.MESHES:
        b = lowered[(name, mesh)].bytes_per_chip
        # The serving weights each chip holds are exactly the canonical weights' shards under the inference rules:
        # fusing lost no cut and replicated nothing more.
        assert b["target_weights"] == pytest.approx(_lm_bytes(preset.target, 8), rel=1e-9)
        assert b["draft_weights"] == pytest.approx(_lm_bytes(preset.draft, 8), rel=1e-9)
        t = preset.target.build_config()[1].text
        run_capacity = b["target_kv"] / (2 * t.n_layers * (t.n_kv_heads // 8) * t.head_dim * 2)
        assert run_capacity >= lowering.Shape().prompt_len + lowering.Shape().max_new_tokens  # one row a replica
        assert sum(b.values()) < 0.8 * paper_targets.hbm_gib("v6e") * 2**30


@pytest.mark.integration
def test_the_docs_show_the_exported_table(lowered):
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    pages = [os.path.join(root, "README.md"), *sorted(glob.glob(os.path.join(root, "docs", "*.md")))]
    table = lowering.report(list(lowered.values()))
    assert any(table in open(p, encoding="utf-8").read() for p in pages)  # regenerate: python -m sage_jax.lowering


def test_cli_prints_the_memory_table(capsys):
    assert lowering.main(["--memory-table"]) == 0
    out = capsys.readouterr().out
    assert paper_targets.table() in out and lowering.EXACT_BYTES in out


def test_cli_projects_the_exact_mode_beside_the_fast_mode(capsys):
    """`--project v6e` prints the fast mode's table as before, then a row per pair in the exact mode: AR and SAGE
    tokens/s in both modes and the exact mode's tax on each, its 65-row verify reading the weights once on a TPU."""
    assert lowering.main(["--project", "v6e"]) == 0
    fast, exact = capsys.readouterr().out.split("The exact mode")
    assert "| AR tok/s |" in fast and "exact" not in fast
    rows = [line for line in exact.splitlines() if line.startswith("| ") and "8 x v6e" in line]
    assert [r.split(" | ")[0].strip("| ") for r in rows] == list(PAIRS)
    assert "exact tax: AR / SAGE" in exact
    for r in rows:
        cells = r.split(" | ")
        ar, sage = (tuple(float(x) for x in cells[i].split(" / ")) for i in (2, 3))
        tax_ar, tax_sage = (float(x.rstrip("%")) for x in cells[4].split(" / "))
        assert ar[1] <= ar[0] and sage[1] <= sage[0] < 1e3
        assert tax_ar == pytest.approx(100 * (1 - ar[1] / ar[0]), abs=0.2)
        assert tax_sage == pytest.approx(100 * (1 - sage[1] / sage[0]), abs=0.2)
        assert cells[5].startswith("1, 5, ")  # a 65-row verify: one weight read (128-row tiles), 5 KV reads


def test_cli_reports_bad_meshes_in_one_line(capsys):
    assert lowering.main(["--mesh", "8by8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --mesh") and "\n" not in err
    assert lowering.main(["--layers", "-1"]) == 2


@pytest.mark.integration
def test_two_exported_layers_scale_to_the_full_programs_bytes(lowered):
    """`--layers N` (a quick look at a big mesh) exports N real-sized layers and scales them to full depth: the same
    bytes as the whole programs."""
    two = lowering.lower(paper_targets.presets()["qwen2.5-vl-72b+7b"], 2, 8, layers=2)
    assert two.bytes_per_chip == pytest.approx(lowered[("qwen2.5-vl-72b+7b", "4x4")].bytes_per_chip, rel=1e-9)


def _exact_checks(r: lowering.Lowered, data: int):
    """The exact mode's programs for a data x 8 mesh: no all-reduce anywhere (nothing is summed across chips), the
    layers' outputs all-gathered, every attention the fixed-order kernel's, the o and down projections cut on their
    output rows (the target's heads are cut; the 7B draft's 28 heads are not, so only its down projection moves)."""
    for exp in (r.prefill, r.decode):
        text = exp.mlir_module()
        assert exp.platforms == ("tpu",) and exp.nr_devices == data * 8
        assert "all_reduce" not in text and "all_gather" in text
        assert "exact_attention_tpu" in text and "row_tiled_matmul_tpu" in text
    text = r.decode.mlir_module()

    def spec(path):
        return re.search(rf'sharding<@mesh, \[([^\]]*)\]>[^%]*loc\("{re.escape(path)}"\)', text)[1]

    for w in ("qkv", "o", "gate_up", "down"):
        assert spec(f"lm_t.layers[0]['{w}']") == '{"model"}, {}'
    assert spec("lm_d.layers[0]['o']") == "{}, {}" and spec("lm_d.layers[0]['down']") == '{"model"}, {}'


def test_one_exact_layer_lowers_for_8_chips_without_a_sum_across_them():
    """One real-sized layer of Qwen2.5-VL-72B and of its 7B draft, the exact mode's prefill and decode loop exported
    for 8 TPU chips (`lowering.lower(..., matmul="exact")`); the whole pairs, and their bytes per chip against the
    fast mode's, under -m integration."""
    _exact_checks(lowering.lower(paper_targets.presets()["qwen2.5-vl-72b+7b"], 1, 8, layers=1, matmul="exact"), 1)


@pytest.mark.integration
@pytest.mark.parametrize("name", PAIRS)
def test_the_paper_pairs_export_in_the_exact_mode_for_8_chip_meshes(name):
    """Both 72B + 7B pairs whole (80 + 28 layers), the exact mode, a 2 x 8 mesh (each replica's target and draft
    cut 8 ways), at the fast mode's bytes per chip."""
    r = lowering.lower(paper_targets.presets()[name], 2, 8, matmul="exact")
    _exact_checks(r, 2)
    assert r.bytes_per_chip == pytest.approx(lowering.lower(paper_targets.presets()[name], 2, 8).bytes_per_chip)
