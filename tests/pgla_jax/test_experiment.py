"""`pgla_jax.experiment`'s attack-aware path: the noise misfit the attacker computes, the blend it keeps, and the
committed ε table it produced (the README's PGLA attack rows)."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pgla_jax import experiment, fl, protections
from pgla_jax.config import ProtectionConfig
from pgla_jax.inversion.dlg import Recovery

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EPS_TABLES = {name: os.path.join(ROOT, "benchmarks", "pgla", "results", name, "results.json")
              for name in ("eps_table", "eps_table_colour")}


def _digit(mnist, i):
    return jnp.asarray(mnist.images[i : i + 1]), jnp.asarray(mnist.labels[i : i + 1])


def _recovery(x, labels):
    return Recovery(x, labels.astype(jnp.int32), jnp.float32(0), jnp.zeros((1,)))


@pytest.mark.parametrize("noise", ["gaussian", "laplace"])
def test_noise_misfit_is_about_one_for_the_truth_and_larger_for_anything_else(mnist, lenet, noise):
    """The true image explains the protected gradient up to the noise (its misfit is the noise's own size, ≈ 1 over
    the LeNet's 13,426 entries); another digit, or the right digit with a wrong label, does not."""
    graphdef, params = lenet
    prot = ProtectionConfig(noise=noise, calibration="paper")
    plan = protections.plan(prot, 1.0, 1)
    x, labels = _digit(mnist, 0)
    other, other_labels = _digit(mnist, int(np.argmax(mnist.labels != mnist.labels[0])))
    assert int(other_labels[0]) != int(labels[0])
    g_sent = protections.protected_grad(graphdef, params, x, fl.one_hot(labels, 10), jax.random.key(3), cfg=prot,
                                        noise_plan=plan)
    truth = experiment.noise_misfit(graphdef, params, g_sent, _recovery(x, labels), plan, prot, 10)
    assert abs(truth - 1.0) < 0.05, truth
    for wrong in (_recovery(other, other_labels), _recovery(x, other_labels), _recovery(x * 0.5, labels)):
        assert experiment.noise_misfit(graphdef, params, g_sent, wrong, plan, prot, 10) > truth + 0.02


def test_attack_aware_keeps_the_blend_that_best_explains_the_protected_gradient(mnist, lenet):
    """A stand-in attack that recovers the true digit only from the α = 0.5 blend: that blend is kept, with the
    gradient it inverted; the known ends are not attacked again, and each run ticks the progress bar once."""
    graphdef, params = lenet
    prot = ProtectionConfig(noise="gaussian", calibration="paper")
    plan = protections.plan(prot, 1.0, 1)
    x, labels = _digit(mnist, 0)
    g_sent = protections.protected_grad(graphdef, params, x, fl.one_hot(labels, 10), jax.random.key(3), cfg=prot,
                                        noise_plan=plan)
    g_hat = jax.tree.map(lambda g: 0.5 * g, g_sent)
    half = jax.tree.map(lambda h, s: 0.5 * h + 0.5 * s, g_hat, g_sent)
    wrong = _recovery(*_digit(mnist, int(np.argmax(mnist.labels != mnist.labels[0]))))
    calls, ticks = [], []

    def attack(g, p, target, key):
        calls.append(target)
        same = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(target), jax.tree.leaves(half)))
        return _recovery(x, labels) if same else wrong

    rec, alpha, target = experiment.attack_aware(graphdef, params, g_sent, g_hat, plan, prot, attack,
                                                 jax.random.key(0), 10, known={0.0: wrong, 1.0: wrong},
                                                 progress=ticks.append)
    assert alpha == 0.5 and rec.images is x and len(calls) == 3 and ticks == [1, 1, 1]
    for a, b in zip(jax.tree.leaves(target), jax.tree.leaves(half)):
        np.testing.assert_array_equal(a, b)
    # One blend: the protected gradient's own attack, nothing else run.
    rec, alpha, _ = experiment.attack_aware(graphdef, params, g_sent, g_hat, plan, prot, attack, jax.random.key(0),
                                            10, blends=(0.0,), known={0.0: wrong})
    assert alpha == 0.0 and rec is wrong and len(calls) == 3


def test_aware_base_is_the_best_available_denoiser():
    assert experiment.aware_base(("none", "prior_ddim", "prior_refined", "diffusion_ddim")) == "prior_refined"
    assert experiment.aware_base(("none", "diffusion_ddim")) == "diffusion_ddim"
    assert experiment.aware_base(("none", "wiener")) is None


@pytest.mark.parametrize("table", sorted(EPS_TABLES))
def test_committed_eps_table_the_default_path_never_costs_the_attack(table):
    """benchmarks/pgla/results/eps_table (8 MNIST digits, DLG, paper calibration, ε 0.5-10 × Gaussian/Laplace, 4
    more random starts for the jitter) and eps_table_colour (4 colour patches, the 32×32×3 LeNet, 2 more starts):
    through `attack_aware` DLG is never worse than from the protected gradient by more than the attack's own jitter,
    strictly better wherever t* > 0, and at Laplace ε = 1 and 1.5 not below it."""
    with open(EPS_TABLES[table]) as f:
        res = json.load(f)
    assert res["provenance"]["command"].startswith("python -m pgla_jax.attack")
    rows = {(r["noise"], r["epsilon"], r["denoiser"]): r for r in res["results"]}
    cells = {(n, e) for n, e, _ in rows}
    assert cells == {(n, e) for n in ("gaussian", "laplace") for e in (0.5, 1.0, 1.5, 2.0, 4.0, 10.0)}
    for noise, eps in sorted(cells):
        none, aware = rows[(noise, eps, "none")], rows[(noise, eps, experiment.AWARE)]
        gain = aware["image_psnr"] - none["image_psnr"]
        assert gain >= -none["image_psnr_jitter"], (noise, eps, gain)
        if aware["t_star"]:
            assert gain > 0.0, (noise, eps, gain)
        if noise == "laplace" and eps in (1.0, 1.5):
            assert gain >= 0.0, (noise, eps, gain)


@pytest.mark.integration
def test_attack_aware_beats_the_protected_gradient_where_the_prior_alone_loses(mnist):
    """The real path (shipped denoisers, DLG 300 iterations) on 2 digits at Laplace ε = 1.5, where DLG from the
    prior's output loses ~2.6 dB against the protected gradient (benchmarks/pgla/results/eps_table)."""
    from configs import cli
    from pgla_jax.codec import make_codec
    from pgla_jax.config import ExperimentConfig
    from pgla_jax.denoise import denoisers
    from pgla_jax.denoise.denoiser_checkpoint import shipped_for
    from pgla_jax.models import split_victim

    cfg = cli.load_config("mnist_lenet", "configs.pgla", ExperimentConfig)
    cfg = cfg.replace(epsilons=(1.5,), num_images=2, protection=dataclasses.replace(cfg.protection, noise="laplace"))
    dens = denoisers.load(shipped_for(cfg.victim), make_codec(split_victim(cfg.victim)[1], "image2d", 4))
    out = experiment.run(cfg, mnist, denoisers=dens, names=("none", "prior_refined"))
    rows = {r["denoiser"]: r for r in out.rows}
    assert rows["prior_refined"]["image_psnr"] < rows["none"]["image_psnr"] - 1.0
    assert rows[experiment.AWARE]["image_psnr"] > rows["none"]["image_psnr"]
    assert 0.0 < rows[experiment.AWARE]["blend"] < 1.0
