"""DLG speed: our jitted JAX DLG vs a PyTorch DLG (written here), 300 L-BFGS iterations, LeNet, one MNIST digit.

Same process, same CPU, same image, same victim weights (ours copied into the torch LeNet), same algorithm:

* ``line search``: L-BFGS with a strong-Wolfe line search (optax zoom / torch ``line_search_fn="strong_wolfe"``),
  history ``--memory`` (default 100, torch's and our default), exactly 300 iterations (torch's tolerances
  disabled, its evaluation cap lifted);
* ``fixed step``: L-BFGS with step 1 and no line search, the original DLG script's setting.

Our default DLG is the line-search one. Optax's fixed-step L-BFGS (first step scaled by its initial
preconditioner, unlike torch's) diverges from some starts: its PSNR column shows when it did.

Compilation is excluded from our timings (one warm-up call with another key); torch gets one warm-up run too.
Each timing is the median of ``--repeats`` runs. Prints what produced the run (commit, command line, CPU, jax:
`configs.provenance`) and a table with the speed ratio (torch time / our time).

    .venv/bin/python benchmarks/pgla/bench_dlg.py [--iterations 300] [--repeats 3] [--image 0]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import nn

from configs import provenance
from pgla_jax import data, fl, metrics
from pgla_jax.config import AttackConfig, VictimConfig
from pgla_jax.inversion import dlg
from pgla_jax.models import split_victim

# ---------------------------------------------------------------------------------------------------------------
# The PyTorch reference: the DLG LeNet and DLG's closure, written from the paper's description.
# ---------------------------------------------------------------------------------------------------------------


class TorchLeNet(nn.Module):
    def __init__(self, channels: int = 1, num_classes: int = 10, feat: int = 588):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, 12, 5, padding=2, stride=2), nn.Sigmoid(),
            nn.Conv2d(12, 12, 5, padding=2, stride=2), nn.Sigmoid(),
            nn.Conv2d(12, 12, 5, padding=2, stride=1), nn.Sigmoid(),
        )
        self.fc = nn.Linear(feat, num_classes)

    def forward(self, x):
        h = self.body(x)
        # Flatten in NHWC order so that the fc weights copied from our (NHWC) LeNet mean the same thing.
        return self.fc(h.permute(0, 2, 3, 1).reshape(h.shape[0], -1))


def torch_lenet_from(params) -> TorchLeNet:
    net = TorchLeNet()
    convs = [m for m in net.body if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        for conv, name in zip(convs, ("conv1", "conv2", "conv3"), strict=True):
            conv.weight.copy_(torch.from_numpy(np.asarray(params[name]["kernel"][...]).transpose(3, 2, 0, 1)))
            conv.bias.copy_(torch.from_numpy(np.asarray(params[name]["bias"][...])))
        net.fc.weight.copy_(torch.from_numpy(np.asarray(params["fc"]["kernel"][...]).T))
        net.fc.bias.copy_(torch.from_numpy(np.asarray(params["fc"]["bias"][...])))
    return net


def torch_dlg(net, target, iterations: int, line_search: bool, seed: int, memory: int):
    torch.manual_seed(seed)
    x = torch.randn(1, 1, 28, 28, requires_grad=True)
    y = torch.randn(1, 10, requires_grad=True)
    opt = torch.optim.LBFGS([x, y], lr=1.0, max_iter=iterations, max_eval=100 * iterations, history_size=memory,
                            tolerance_grad=-1.0, tolerance_change=-1.0,
                            line_search_fn="strong_wolfe" if line_search else None)
    params = list(net.parameters())

    def closure():
        opt.zero_grad()
        loss = torch.sum(-torch.softmax(y, -1) * torch.log_softmax(net(x), -1))
        grads = torch.autograd.grad(loss, params, create_graph=True)
        diff = sum(((g - t) ** 2).sum() for g, t in zip(grads, target, strict=True))
        diff.backward()
        return diff

    opt.step(closure)
    state = opt.state[x]
    return x.detach(), state["n_iter"], state["func_evals"]


# ---------------------------------------------------------------------------------------------------------------


def _median_time(fn, repeats: int):
    times, out = [], None
    for r in range(repeats):
        t0 = time.perf_counter()
        out = fn(r)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory", type=int, default=100, help="L-BFGS history (both sides)")
    ap.add_argument("--image", type=int, default=0, help="which of the class-cycling MNIST picks")
    args = ap.parse_args()

    xs, ys = data.pick(data.load_mnist5k(), args.image + 1, seed=0)
    x_np, label = xs[args.image : args.image + 1], ys[args.image : args.image + 1]
    graphdef, params = split_victim(VictimConfig())
    x = jnp.asarray(x_np)
    target = fl.batch_grad(graphdef, params, x, fl.one_hot(jnp.asarray(label), 10))

    net = torch_lenet_from(params)
    x_t = torch.from_numpy(x_np.transpose(0, 3, 1, 2).copy())
    y_t = torch.nn.functional.one_hot(torch.from_numpy(label.astype(np.int64)), 10).float()
    loss_t = torch.sum(-y_t * torch.log_softmax(net(x_t), -1))
    target_t = [g.detach() for g in torch.autograd.grad(loss_t, list(net.parameters()))]
    # Same victim, same gradient: the torch copy reproduces our gradient (up to float32 summation order).
    for ours_g, torch_g in ((target["fc"]["kernel"][...], target_t[-2].T), (target["conv1"]["kernel"][...],
                                                                             target_t[0].permute(2, 3, 1, 0))):
        np.testing.assert_allclose(np.asarray(ours_g), torch_g.numpy(), rtol=1e-3, atol=1e-5)

    print(provenance.markdown(provenance.record("python benchmarks/pgla/bench_dlg.py")))
    print(f"jax {jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); LeNet 13,426 params, MNIST label {int(label[0])}, "
          f"{args.iterations} L-BFGS iterations, median of {args.repeats}")
    rows = []
    default_threads = torch.get_num_threads()
    for mode, lr in (("line search", None), ("fixed step", 1.0)):
        cfg = AttackConfig(kind="dlg", iterations=args.iterations, lr=lr, memory=args.memory)

        def ours(r, cfg=cfg):
            rec = dlg.dlg(graphdef, params, target, jax.random.key(r), cfg=cfg, batch=1, num_classes=10,
                          image_shape=(28, 28, 1))
            return jax.block_until_ready(rec)

        t0 = time.perf_counter()
        ours(1000)  # compile
        compile_s = time.perf_counter() - t0
        t_ours, rec = _median_time(ours, args.repeats)
        psnr_ours = float(metrics.psnr(rec.images, x)[0])

        line_search = lr is None
        # Torch gets its best thread count: on a busy 2-core machine one thread is often faster than two.
        best = None
        for threads in sorted({1, default_threads}):
            torch.set_num_threads(threads)
            torch_dlg(net, target_t, 5, line_search, 1000, args.memory)  # warm-up
            t_torch, (xr, n_iter, n_eval) = _median_time(
                lambda r, ls=line_search: torch_dlg(net, target_t, args.iterations, ls, r, args.memory), args.repeats)
            print(f"  torch {mode}, {threads} thread(s): {t_torch:.3g} s")
            if best is None or t_torch < best[0]:
                best = (t_torch, xr, n_iter, n_eval, threads)
        t_torch, xr, n_iter, n_eval, threads = best
        torch.set_num_threads(default_threads)
        rec_t = np.clip(xr.numpy().transpose(0, 2, 3, 1), 0, 1)
        psnr_torch = float(metrics.psnr(jnp.asarray(rec_t), x)[0])
        rows.append((mode, t_ours, compile_s, psnr_ours, t_torch, threads, n_iter, n_eval, psnr_torch,
                     t_torch / t_ours))

    head = ("mode", "ours s", "compile s", "ours PSNR", "torch s", "threads", "torch iters", "torch evals",
            "torch PSNR", "speed-up")
    print(" | ".join(f"{h:>11}" for h in head))
    for r in rows:
        print(" | ".join(f"{v:>11}" if isinstance(v, str | int) else f"{v:>11.3g}" for v in r))
    print("speed-up = torch time / our time (compilation excluded; PSNR in dB with data range 1)")


if __name__ == "__main__":
    main()
