"""`python -m sage_jax.bench --quick` end to end (what CI runs), the prompt suite, and its CLI errors."""

import json
import os
import subprocess
import sys

import pytest

from configs.datasets import FASHION_MNIST_DIR
from sage_jax.bench import __main__ as bench
from sage_jax.prompts import BENCH_PROMPTS, bench_prompts


def test_prompt_suite_is_held_out_and_varied():
    from sage_jax.prompts import EVAL_PROMPTS

    assert len(BENCH_PROMPTS) >= 30 and len({k for k, _ in BENCH_PROMPTS}) >= 5
    assert len(set(bench_prompts())) == len(BENCH_PROMPTS)
    assert not {t for _, t in BENCH_PROMPTS} & {t for _, t in EVAL_PROMPTS}
    assert len({k for k, t in BENCH_PROMPTS if t in bench_prompts(6)}) == 6  # a prefix covers every kind
    from sage_jax.prompts import COPY_PROMPTS, held_out_texts

    copy = [t for _, t in COPY_PROMPTS]
    assert len(set(copy)) == len(copy) >= 8 and not set(copy) & set(held_out_texts())


@pytest.mark.parametrize("argv, msg", [
    (["--budget", "lots"], "--budget"),
    (["--budget", "0,3"], "--budget"),
    (["--methods", "ar,warp"], "unknown method"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
])
def test_bad_input_is_one_line_and_exit_2(argv, msg, capsys, tmp_path):
    assert bench.main(["--quick", "--no-hf", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and msg in err[0]


def test_prompts_file_replaces_the_set(tmp_path, capsys):
    """`--prompts-file`: the suite's prompts are the file's (the tiny target reads their toy tokenization); a bad
    file, or one given to `--vlm`, is one line and exit code 2."""
    from sage_jax.bench import suite

    path = tmp_path / "mine.txt"
    path.write_text("First question?\nSecond one, a little longer.\n", encoding="utf-8")
    s = suite.build(bench.parse(["--quick", "--no-hf", "--methods", "ar", "--prompts-file", str(path)]))
    assert len(s.prompts) == 2 and len(s.prompts[1]) == 24 and "2 prompts from mine.txt" in s.title
    for argv, msg in ((["--prompts-file", str(tmp_path / "none.txt")], "no such prompts file"),
                      (["--vlm", "--prompts-file", str(path)], "--prompts-file takes text prompts"),
                      (["--clips"], "--clips goes with --vlm"),
                      (["--vlm", "--clips", "--image", str(path)], "--clips asks the shipped VLM")):
        assert bench.main(["--quick", "--no-hf", "--out", str(tmp_path), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and msg in err[0]


@pytest.mark.integration
def test_quick_run_end_to_end(tmp_path, cache_dir):
    # A separate process, as CI users run it: the torch baselines' thread pools and the run's compiled programs
    # stay out of the test session (a long session segfaulted once in a later XLA compile with them loaded).
    scratch = tmp_path / "tmp"  # the run's temporary folders (transformers' export of the target) go here
    scratch.mkdir()
    proc = subprocess.run([sys.executable, "-m", "sage_jax.bench", "--quick", "--no-progress", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "TMPDIR": str(scratch)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("sage_bench_hf_")]  # removed on exit
    out = proc.stdout
    assert "| method | tok/s |" in out and "| sage |" in out and "| hf-assisted |" in out
    with open(os.path.join(tmp_path, "bench.json")) as fh:
        data = json.load(fh)
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {"ar", "ar-xla", "chain-lm", "sage", "hf-ar", "hf-assisted"}
    # Lossless against our AR, and transformers agrees with us on the same weights.
    assert all(r["same_as_ar"] for r in rows.values())
    assert rows["ar"]["speedup_vs_ar"] == 1.0 and rows["hf-ar"]["speedup_vs_hf_ar"] == 1.0
    assert rows["chain-lm"]["draft_forwards_per_token"] > 0 and rows["hf-assisted"]["draft_forwards_per_token"] > 0
    assert rows["sage"]["budgets"], "auto budget recorded"
    for png in ("speedup", "calibration", "entropy_autocorrelation", "verify_cost"):
        assert os.path.getsize(os.path.join(tmp_path, f"{png}.png")) > 1000
    prof = data["meta"]["profile"]
    assert prof["verify_widths"][-1] == 65 and len(prof["verify_ms"]) == len(prof["verify_widths"])
    # What produced the results: commit, command, draft (a self-draft here: no checkpoint), CPU, jax; table.md too.
    rec = data["meta"]["provenance"]
    assert rec["command"] == f"python -m sage_jax.bench --quick --no-progress --out {tmp_path}"
    assert rec["commit"] == "unknown" or len(rec["commit"].removesuffix("-dirty")) == 40
    assert rec["draft"] is None and rec["draft_sha256"] is None
    assert rec["cpu"] and rec["cores"] >= 1 and rec["jax"] and rec["jaxlib"] and rec["backend"] == "cpu"
    table = (tmp_path / "table.md").read_text()
    assert f"- commit: `{rec['commit']}`" in table and "- draft_sha256: `None`" in table and "| sage |" in table
    # A forced rerun with other methods replaces these results (no plot of the first run left beside the new
    # table) and keeps what the bench did not write (the scratch folder).
    first = (tmp_path / ".outputs").read_text().split()
    proc = subprocess.run([sys.executable, "-m", "sage_jax.bench", "--quick", "--no-progress", "--no-hf", "--methods",
                           "ar", "--force", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    second = (tmp_path / ".outputs").read_text().split()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".outputs", "tmp", *second])
    assert set(first) - set(second) and "| sage |" not in (tmp_path / "table.md").read_text()


def test_alpha_plots_use_the_sage_run_that_built_trees():
    from sage_jax.bench.plots import alpha_methods

    nan = float("nan")
    trees = lambda n, plain=0: {"alpha_traces": [[0.5] * n + [nan] * plain], "tau_traces": [[1] * n]}  # noqa: E731
    # `sage` under --budget auto explored for 3 steps, then decoded plainly; sage@25 built a tree every step.
    traces = {"ar": trees(0, 40), "sage": trees(3, 40), "sage@25": trees(40), "static": trees(40),
              "eagle2": trees(4, 40)}
    assert alpha_methods(traces) == ("sage@25", ["sage@25", "static"])
    assert alpha_methods({"sage": trees(30), "sage@25": trees(20)}) == ("sage", ["sage"])


@pytest.mark.integration
def test_vlm_quick_run_reports_the_pruning_sweep(tmp_path, monkeypatch):
    """`--vlm --quick` (SAGE only, one prompt, to stay small): SAGE equals AR on an image prompt, and the sweep
    reports the draft's prefill at each ratio; a draft that sees 20% of the image tokens runs fewer of them and
    fewer XLA operations in its prefill (XLA's count: noise-free, unlike the seconds the table also reports). The
    tiny models' folder is removed at the end."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert bench.main(["--vlm", "--quick", "--no-progress", "--max-new-tokens", "8", "--ratios", "0,0.8",
                       "--methods", "sage", "--prompts", "1", "--out", str(tmp_path)]) == 0
    assert not [p for p in scratch.iterdir() if p.name.startswith("sage_bench_")]  # (torch keeps its own there)
    assert (tmp_path / ".outputs").read_text().split() == ["vlm_bench.json", "vlm_pruning.png"]
    with open(tmp_path / "vlm_bench.json") as f:
        out = json.load(f)
    assert set(out["methods"]) == {"ar", "sage"}
    assert all(v["same_as_ar"] for v in [*out["methods"].values(), *out["sweep"]])
    off, on = out["sweep"]
    assert (off["ratio"], on["ratio"]) == (0.0, 0.8)
    assert off["draft_prompt_tokens"] == off["prompt_tokens"] > on["draft_prompt_tokens"]
    assert on["draft_prefill_gflops"] < 0.7 * off["draft_prefill_gflops"]
    assert on["draft_prefill_seconds"] > 0 and off["target_prefill_seconds"] > 0
    assert os.path.getsize(tmp_path / "vlm_pruning.png") > 10_000
    assert {"commit", "command", "draft_sha256", "cpu", "cores", "jax", "jaxlib", "backend"} <= set(out["provenance"])



def test_quick_keeps_the_sweep_it_was_given():
    """`--quick` trims the methods to a smoke set, but never the fixed budgets `--sweep` asked for."""
    from sage_jax.bench import suite
    from sage_jax.bench.__main__ import parse

    args = parse(["--quick", "--sweep", "7", "--no-hf"])
    names = [m.name for m in suite.select_methods(args, suite.parse_budget(args.budget), datastore=False)]
    assert "sage-fixed-7" in names and "sage" in names, names


@pytest.mark.skipif(not os.path.isdir(FASHION_MNIST_DIR), reason="dataset-fashion-mnist missing")
def test_the_vlm_bench_reads_dev_images_for_a_dev_prompt_set():
    """Drafts and settings are chosen on `bench --vlm --prompt-set dev…`: its images and clips are then dev ones,
    which no quoted figure reads; every other set reads the frozen test ones."""
    import numpy as np

    from sage_jax.bench import vlm as bench_vlm
    from sage_jax.training import vlm_data

    assert [bench_vlm.heldout_split(s) for s in ("dev", "dev-chat", "test", "test-chat")] == ["dev"] * 2 + ["test"] * 2
    dev, dev_labels = bench_vlm.heldout_images(3, split="dev")
    d = vlm_data.fashion("dev")
    idx = vlm_data.heldout_indices(3, "dev")
    np.testing.assert_array_equal(np.stack([np.asarray(im) for im in dev]), d.pixels[idx])
    np.testing.assert_array_equal(dev_labels, d.labels[idx])
    test, _ = bench_vlm.heldout_images(3)
    assert not np.array_equal(np.asarray(test[0]), np.asarray(dev[0]))
