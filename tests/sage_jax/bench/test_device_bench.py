"""The prepared accelerator run (`benchmarks/device_bench.sh` -> `benchmarks/sage/device_bench.py`) at tiny sizes
on this CPU, so that a device's minutes are not spent finding its bugs."""

import json

import pytest


def test_cpu_smoke_run_writes_measured_and_predicted_curves(tmp_path, capsys, benchmark_script):
    """Tiny sizes: the verify curve beside the cost model's prediction for this machine, the attention paths, what
    produced the file; every cost positive and the widest verify dearer than one node."""
    benchmark_script("device_bench").main(["--out", str(tmp_path), "--sizes", "tiny", "--widths", "1,2,8,32",
                                           "--seconds", "30", "--attention-widths", "16", "--e2e-prompts", "0"])
    res = json.loads((tmp_path / "device_bench.json").read_text())
    meas, pred = res["verify_ms"]["tiny"], res["predicted_ms"]["tiny"]
    assert list(meas) == list(pred) == ["1", "2", "8", "32"]
    assert all(v > 0 for v in [*meas.values(), *pred.values()]) and pred["32"] > pred["1"]
    assert "xla_masked_einsum" in res["attention_ms"]["16"]
    assert res["provenance"]["commit"] and res["chip_model"].endswith("(measured)")
    assert "| model ms |" in capsys.readouterr().out


@pytest.mark.integration
def test_cpu_smoke_run_end_to_end(tmp_path, benchmark_script):
    """The end-to-end part on one prompt: the shipped SmolLM2 and head, AR, SAGE auto and SAGE's full trees, each
    output identical to AR's on this CPU (float32)."""
    benchmark_script("device_bench").main(["--out", str(tmp_path), "--sizes", "tiny", "--widths", "1,2",
                                           "--seconds", "30", "--attention-widths", "", "--e2e-prompts", "1",
                                           "--e2e-tokens", "8"])
    e2e = json.loads((tmp_path / "device_bench.json").read_text())["end_to_end"]
    assert set(e2e) == {"ar", "sage-auto", "sage-full"}
    assert all(r["identical"] == r["prompts"] == 1 for r in e2e.values())
    assert e2e["sage-full"]["tokens_per_step"] > 1.0
