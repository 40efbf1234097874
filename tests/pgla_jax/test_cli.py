"""The `python -m pgla_jax.attack` contract: JSON schema, PNG grid, no silent overwrite, exit code 2 on bad input."""

import json
import subprocess
import sys

import pytest

from pgla_jax import attack

ROW_KEYS = {"epsilon", "noise", "calibration", "denoiser", "t_star", "grad_cosine", "grad_psnr", "image_psnr",
            "image_ssim", "label_accuracy"}


def test_cli_json_and_figure(tmp_path, capsys):
    out = tmp_path / "run"
    # The paper's setting on 2 digits, at the iteration count whose DLG program test_attacks already compiled.
    argv = ["--config", "mnist_lenet", "--epsilons", "1,100", "--images", "2", "--iterations", "500", "--out", str(out),
            "--denoiser", "none", "--denoisers", "none", "--json"]
    assert attack.main(argv) == 0
    captured = capsys.readouterr()
    res = json.loads(captured.out)  # exactly one JSON object on stdout
    assert [r["epsilon"] for r in res["results"]] == [1.0, 100.0]
    for r in res["results"]:
        assert ROW_KEYS <= set(r) and r["denoiser"] == "none" and r["noise"] == "gaussian"
        assert r["calibration"] == "paper" and 0.0 <= r["label_accuracy"] <= 1.0
    eps1, eps100 = res["results"]
    assert res["clean"]["label_accuracy"] == 1.0 and eps100["label_accuracy"] == 1.0
    # More privacy budget → less noise → a better gradient and a better image.
    assert eps100["grad_cosine"] > 0.999 > eps1["grad_cosine"]
    assert eps100["image_psnr"] > eps1["image_psnr"] + 10
    with open(res["figure"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "attacks" in captured.err  # the tqdm bar goes to stderr
    # A second run must not overwrite the figure silently.
    assert attack.main(argv) == 2
    assert "--force" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--epsilons", "0,1"], "epsilon"),
    (["--epsilons", "-3"], "epsilon"),
    (["--denoiser", "ckpt/gd"], "not found"),
    (["--denoiser", "none", "--denoisers", "none,diffusion"], "not available"),
    (["--noise", "gaussian,uniform"], "invalid choice"),
    (["--config", "no_such_config"], "unknown config"),
    (["--config", "cifar10_lenet", "--data-path", "/nonexistent/cifar"], "not found"),
    (["--config", "cifar10_lenet"], "not found"),
    (["--config", "digits_tiny", "--batch-size", "5000", "--images", "5000"], "larger than"),
    (["--config", "digits_tiny", "--noise", "uniform"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, needle):
    assert attack.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err


def test_real_process_exit_code(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pgla_jax.attack", "--epsilons", "0", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error:") and "Traceback" not in p.stderr


def test_cli_with_a_denoiser_checkpoint(tmp_path, capsys):
    """A (tiny, untrained) diffusion checkpoint: rows for every (noise, ε, denoiser), t* from the noise, attacked
    denoisers with image metrics and the others without, results.md / results.json beside the figures."""
    from flax import nnx

    from configs.pgla import denoiser_tiny
    from pgla_jax.denoise import store
    from pgla_jax.denoise.unet import UNet

    cfg = denoiser_tiny.get_config()
    ckpt = str(tmp_path / "denoiser")
    store.save(ckpt, store.to_pure(UNet(cfg.unet, rngs=nnx.Rngs(0))), cfg)
    out = tmp_path / "run"
    argv = ["--config", "digits_tiny", "--denoiser", ckpt, "--noise", "gaussian,laplace", "--epsilons", "1",
            "--images", "1", "--iterations", "20", "--denoisers", "none,wiener,diffusion,diffusion_released",
            "--attacked", "diffusion", "--out", str(out), "--json"]
    assert attack.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    rows = {(r["noise"], r["denoiser"]): r for r in res["results"]}
    assert len(res["results"]) == 8 and len(res["figures"]) == 2
    assert rows[("gaussian", "diffusion")]["t_star"] == 24 and rows[("laplace", "diffusion")]["t_star"] == 6
    assert rows[("laplace", "diffusion_released")]["t_star"] == 4 and rows[("gaussian", "none")]["t_star"] is None
    assert rows[("gaussian", "none")]["image_psnr"] is None and rows[("gaussian", "diffusion")]["image_psnr"] > 0
    assert (out / "results.md").read_text().count("\n") == 2 + 1 + 8
    assert json.loads((out / "results.json").read_text())["results"] == res["results"]
    # The same checkpoint on the 28×28 victim does not fit: one line, exit 2.
    assert attack.main(["--config", "mnist_lenet", "--denoiser", ckpt, "--out", str(tmp_path / "x")]) == 2
    assert "trained for a victim" in capsys.readouterr().err
