"""The `python -m pgla_jax.attack` and `python -m pgla_jax.train_denoiser` contracts (`configs.cli`): JSON schema, PNG
grid, no silent overwrite, one line `error: ...` and exit code 2 on bad input."""

import json
import os
import subprocess
import sys

import pytest

from pgla_jax import attack, train_denoiser

ROW_KEYS = {"epsilon", "noise", "calibration", "denoiser", "t_star", "grad_cosine", "grad_psnr", "image_psnr",
            "image_ssim", "label_accuracy"}


@pytest.mark.integration
def test_cli_json_and_figure(tmp_path, capsys):
    out = tmp_path / "run"
    # The paper's setting on 2 digits, at the iteration count whose DLG program test_inversion already compiled.
    argv = ["--config", "mnist_lenet", "--epsilons", "1,100", "--images", "2", "--iterations", "500", "--out", str(out),
            "--denoiser", "none", "--denoisers", "none", "--json"]
    assert attack.main(argv) == 0
    captured = capsys.readouterr()
    res = json.loads(captured.out)  # exactly one JSON object on stdout
    assert [r["epsilon"] for r in res["results"]] == [1.0, 100.0]
    for r in res["results"]:
        assert ROW_KEYS <= set(r) and r["denoiser"] == "none" and r["noise"] == "gaussian"
        # DLG's label lands on the right class even through ε = 1 noise (the last layer's bias gradient, ≈ p − 1 for
        # the true class, dwarfs the noise's 0.087).
        assert r["calibration"] == "paper" and r["label_accuracy"] == 1.0
    eps1, eps100 = res["results"]
    # Measured: clean 51.2 dB, ε = 100 45.2 dB, ε = 1 5.0 dB (mean of the 2 digits).
    assert res["clean"]["label_accuracy"] == 1.0 and res["clean"]["image_psnr"] >= 40.0
    # More privacy budget → less noise → a better gradient and a better image.
    assert eps100["grad_cosine"] > 0.999 > eps1["grad_cosine"]
    assert eps100["image_psnr"] > eps1["image_psnr"] + 10
    with open(res["figure"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "attacks" in captured.err  # the tqdm bar goes to stderr
    # A second run must not overwrite the figure silently.
    assert attack.main(argv) == 2
    assert "--force" in capsys.readouterr().err
    # --force replaces the earlier run's results (its Gaussian figure goes with them) and nothing else.
    (out / "notes.txt").write_text("mine")
    assert attack.main([*argv, "--noise", "laplace", "--force"]) == 0
    figures = json.loads(capsys.readouterr().out)["figures"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".outputs", "notes.txt", "results.json", "results.md", *(os.path.basename(f) for f in figures)])
    assert "laplace" in figures[0] and res["figure"] not in figures


@pytest.mark.parametrize("argv,needle", [
    (["--epsilons", "0,1"], "epsilon"),
    (["--epsilons", "1,inf"], "finite"),
    (["--epsilons", "-3"], "epsilon"),
    (["--denoiser", "ckpt/gd"], "not found"),
    (["--denoiser", "none", "--denoisers", "none,diffusion"], "not available"),
    (["--denoiser", "none", "--attacked", "none,attack_aware"], "attack_aware blends one of"),
    (["--noise", "gaussian,uniform"], "invalid choice"),
    (["--config", "no_such_config"], "unknown config"),
    (["--config", "patches_lenet", "--data", "cifar10", "--data-path", "/nonexistent/cifar"], "not found"),
    (["--config", "patches_lenet", "--data", "cifar10"], "not found"),
    (["--config", "digits_tiny", "--batch-size", "1800", "--images", "1800"], "larger than"),
    (["--config", "digits_tiny", "--noise", "uniform"], "invalid choice"),
    (["--config", "denoiser_tiny"], "expected ExperimentConfig"),
    (["--set", "attack.no_such_field=1"], "unknown config key"),
    (["--set", "attack.iterations=many"], "--set attack.iterations"),
    (["--jitter", "-1"], "--jitter: must be"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, needle):
    assert attack.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err


#: Python files that are not configs: --config FILE is one line `error: ...` and exit 2 for each, never a traceback.
NOT_CONFIGS = {
    "raises": "raise RuntimeError('boom')\n",
    "no_get_config": "X = 1\n",
    "wrong_type": "def get_config():\n    return {'steps': 3}\n",
    "get_config_raises": "def get_config():\n    1 / 0\n",
}


@pytest.mark.parametrize("kind", list(NOT_CONFIGS))
def test_a_file_that_is_not_a_config_is_one_line_exit_2(tmp_path, capsys, kind):
    bad = tmp_path / "not_a_config.py"
    bad.write_text(NOT_CONFIGS[kind])
    for main, rest in [(attack.main, ["--out", str(tmp_path / "out")]),
                       (train_denoiser.main, ["--workdir", str(tmp_path / "work")])]:
        assert main(["--config", str(bad), *rest]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "not_a_config.py" in err, err
    assert not (tmp_path / "work").exists()


def test_set_overrides_fields_and_the_flags_win():
    cfg = attack.build_config(attack.parse(["--set", "protection.delta=1e-5", "--set", "attack.iterations=7",
                                            "--set", "epsilons=(2, 3)", "--iterations", "9"]))
    assert cfg.protection.delta == 1e-5 and cfg.epsilons == (2.0, 3.0) and cfg.attack.iterations == 9
    cfg = train_denoiser.build_config(train_denoiser.parse(["--set", "unet.width=8", "--set", "steps=5", "--steps", "6",
                                                            "--workdir", "unused"]))
    assert cfg.unet.width == 8 and cfg.steps == 6 and cfg.unet.mults == (1, 2, 4)


@pytest.mark.parametrize("argv,needle", [
    (["--config", "mnist_lenet"], "expected DenoiserConfig"),
    (["--config", "no_such_config"], "unknown config"),
    (["--steps", "0"], "--steps: must be"),
    (["--extend"], "--extend needs --steps"),
    (["--max-steps", "0"], "--max-steps: must be"),
    (["--set", "unet.no_such_field=1"], "unknown config key"),
    (["--mesh", "data=2,model=x"], "positive integer"),
    (["--mesh", "batch=2"], "unknown mesh axis"),
    (["--config", "denoiser_tiny", "--mesh", "data=3"], "needs 3 devices"),  # the tests' 8 host devices
    (["--prior-only", "--set", "prior_rank=0"], "--prior-only needs prior_rank"),
    (["--refiner-only", "--set", "refiner.steps=0"], "--refiner-only needs refiner.steps"),
    (["--refiner-only", "--prior-only"], "exclude each other"),
    (["--refiner-only", "--set", "refiner.gradients.victim.image_shape=(32,32,3)"], "is not the prior's victim"),
])
def test_train_denoiser_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, needle):
    assert train_denoiser.main([*argv, "--workdir", str(tmp_path / "work")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "work").exists()


def test_train_denoiser_mesh_flag():
    """--mesh: data-parallel over every device by default (run for real, in two processes, by
    tests/configs/test_distributed.py)."""
    assert train_denoiser.parse(["--workdir", "w"]).mesh == {"data": -1}
    assert train_denoiser.parse(["--workdir", "w", "--mesh", "data=2,fsdp=4"]).mesh == {"data": 2, "fsdp": 4}


def test_train_denoiser_workdir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert train_denoiser.main(["--config", "denoiser_tiny", "--workdir", str(tmp_path / "file")]) == 2
    assert "is not a folder" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.parametrize("module,rest", [("pgla_jax.attack", ["--out", "OUT"]),
                                         ("pgla_jax.train_denoiser", ["--workdir", "OUT"])])
def test_real_process_with_a_file_that_is_not_a_config(tmp_path, module, rest):
    bad = tmp_path / "not_a_config.py"
    bad.write_text(NOT_CONFIGS["raises"])
    rest = [str(tmp_path / "out") if a == "OUT" else a for a in rest]
    p = subprocess.run([sys.executable, "-m", module, "--config", str(bad), *rest], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: ") and "RuntimeError: boom" in p.stderr


def test_train_denoiser_does_not_import_the_attack_cli():
    code = "import sys, pgla_jax.train_denoiser; sys.exit('pgla_jax.attack' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


@pytest.mark.integration
def test_real_process_exit_code(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pgla_jax.attack", "--epsilons", "0", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error:") and "Traceback" not in p.stderr


@pytest.mark.integration
def test_cli_with_a_denoiser_checkpoint(tmp_path, capsys):
    """A (tiny, untrained) diffusion checkpoint: rows for every (noise, ε, denoiser), t* from the noise, attacked
    denoisers with image metrics and the others without, results.md / results.json beside the figures."""
    from flax import nnx

    from configs.pgla import denoiser_tiny
    from pgla_jax.config import DenoiserConfig
    from pgla_jax.denoise import denoiser_checkpoint
    from pgla_jax.denoise.unet import UNet

    cfg = DenoiserConfig.from_config(denoiser_tiny.get_config())
    ckpt = str(tmp_path / "denoiser")
    denoiser_checkpoint.save(ckpt, denoiser_checkpoint.to_pure(UNet(cfg.unet, rngs=nnx.Rngs(0))), cfg)
    out = tmp_path / "run"
    argv = ["--config", "digits_tiny", "--denoiser", ckpt, "--noise", "gaussian,laplace", "--epsilons", "1",
            "--images", "1", "--iterations", "20", "--denoisers", "none,wiener,diffusion,diffusion_released",
            "--attacked", "diffusion", "--jitter", "2", "--out", str(out), "--json"]
    assert attack.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    rows = {(r["noise"], r["denoiser"]): r for r in res["results"]}
    assert len(res["results"]) == 8 and len(res["figures"]) == 2
    assert rows[("gaussian", "diffusion")]["t_star"] == 24 and rows[("laplace", "diffusion")]["t_star"] == 4
    assert rows[("laplace", "diffusion_released")]["t_star"] == 4 and rows[("gaussian", "none")]["t_star"] is None
    assert rows[("gaussian", "none")]["image_psnr"] is None and rows[("gaussian", "wiener")]["label_accuracy"] is None
    # --jitter: the protected gradient attacked from 3 starts (even though `none` is not attacked), spread > 0;
    # the other rows carry none.
    for noise in ("gaussian", "laplace"):
        assert rows[(noise, "none")]["image_psnr_jitter"] > 0.0
        assert rows[(noise, "diffusion")]["image_psnr_jitter"] is None
    # Untrained weights: 24 steps of the correct loop wreck the gradient (cosine 0.32 against 0.51 as received, image
    # 3.7 dB against the clean gradient's 12.3 dB after 20 iterations), while the released loop, which never
    # iterates, leaves it where it was (cosine 0.001 / 0.004 from the input's, Gaussian / Laplace).
    g_none, g_diff, g_rel = (rows[("gaussian", n)] for n in ("none", "diffusion", "diffusion_released"))
    assert g_diff["grad_cosine"] < g_none["grad_cosine"] - 0.1
    assert g_diff["image_psnr"] < res["clean"]["image_psnr"] - 4.0
    for noise in ("gaussian", "laplace"):
        assert abs(rows[(noise, "diffusion_released")]["grad_cosine"] - rows[(noise, "none")]["grad_cosine"]) < 0.02
    assert g_rel["image_psnr"] is None
    head, table = (out / "results.md").read_text().split("\n\n")
    assert table.count("\n") == 2 + 1 + 8
    assert json.loads((out / "results.json").read_text())["results"] == res["results"]
    # What produced them: the command, the commit, the denoiser's sha256, the CPU and jax.
    rec = res["provenance"]
    assert rec["command"].startswith("python -m pgla_jax.attack --config digits_tiny --denoiser ")
    assert rec["denoiser"] == ckpt and len(rec["denoiser_sha256"]) == 64 and "prior" not in rec
    assert rec["cpu"] and rec["jax"] and rec["jaxlib"] and rec["backend"] == "cpu" and rec["commit"]
    assert f"- denoiser_sha256: `{rec['denoiser_sha256']}`" in head.splitlines()
    # The same checkpoint on the 28×28 victim does not fit: one line, exit 2.
    assert attack.main(["--config", "mnist_lenet", "--denoiser", ckpt, "--out", str(tmp_path / "x")]) == 2
    assert "trained for a victim" in capsys.readouterr().err


@pytest.mark.slow
def test_train_denoiser_end_to_end(tmp_path):
    """The tiny recipe through the real command line (one CPU device, strict rank promotion as in the tests): the data
    set, the U-Net and DnCNN checkpoints; then a longer schedule on the finished workdir without --extend is the
    library's refusal, one line and exit 2. ~80-90 s, most of it compiling the U-Net's training step."""
    from configs.pgla import denoiser_tiny
    from pgla_jax.config import DenoiserConfig
    from pgla_jax.denoise import denoiser_checkpoint, prior

    env = {**os.environ, "XLA_FLAGS": "", "JAX_NUMPY_RANK_PROMOTION": "raise"}
    work = tmp_path / "work"
    argv = [sys.executable, "-m", "pgla_jax.train_denoiser", "--config", "denoiser_tiny", "--workdir", str(work)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith(f"denoiser checkpoint: {work / 'denoiser'}") and "DnCNN baseline" in p.stderr
    assert denoiser_checkpoint.load(str(work / "denoiser"))[2]["provenance"]["steps"] == 4
    assert denoiser_checkpoint.load(str(work / "dncnn"), "pgla-dncnn")[1].dncnn_steps == 2
    assert "Gaussian prior" in p.stderr
    assert prior.load(str(work / "prior")).rank == DenoiserConfig.from_config(denoiser_tiny.get_config()).prior_rank
    assert (work / "refiner").is_dir() and "refiner" in p.stderr  # the prior's learned correction, on the same victim
    p = subprocess.run([*argv, "--steps", "6"], capture_output=True, text=True, timeout=300, env=env)
    last = p.stderr.splitlines()[-1]
    assert p.returncode == 2 and last.startswith("error: ") and "--extend" in last and "Traceback" not in p.stderr


@pytest.mark.integration
@pytest.mark.parametrize("delay", [4.0, 8.0, 12.0])
def test_ctrl_c_is_one_line_and_exit_130_wherever_it_lands(tmp_path, delay):
    """Ctrl-C while importing, compiling or attacking: one line, exit 130, never a traceback or a crash (the
    interpreter's teardown while XLA compiles on its threads segfaulted before `cli.run` ended the process itself)."""
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-m", "pgla_jax.attack", "--images", "2", "--epsilons", "1,2",
                          "--denoiser", "none", "--out", str(tmp_path / "o")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, (p.returncode, err[-2000:])
    assert err.splitlines()[-1] == "interrupted" and "Traceback" not in err and out == ""
