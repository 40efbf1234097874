"""DLG (Zhu et al. 2019) and iDLG (Zhao et al. 2020): invert a gradient by L-BFGS on squared-L2 gradient matching.

DLG optimises a dummy batch *and* a dummy soft label; iDLG reads the label analytically from the output-bias
gradient and optimises the image alone. The whole optimisation is one `lax.fori_loop` inside `jax.jit`, and random
restarts are a `vmap` over keys (the best final matching loss is kept), so `restarts` costs no Python.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from pgla_jax.config import AttackConfig
from pgla_jax.inversion import matching

Params = PyTree[Float[Array, "..."]]


class Recovery(NamedTuple):
    """What an attack returns.

    Attributes:
      images: the recovered batch, clipped to [0, 1] (the data range of every metric).
      labels: argmax of the recovered (or analytic) label distribution.
      loss: the final matching loss of the winning restart.
      losses: final matching loss of every restart.
    """

    images: Float[Array, "B H W C"]
    labels: Int[Array, " B"]
    loss: Float[Array, ""]
    losses: Float[Array, " R"]


def _lbfgs_minimise(f, z0, iterations: int, memory: int, lr: float | None):
    """`iterations` L-BFGS steps of optax (zoom line search) on `f`, in a fori_loop; returns (z, f(z)).

    `lr=None` keeps optax's line-searched step; a float fixes the step instead (torch's DLG setting).
    """
    opt = optax.lbfgs(learning_rate=lr, memory_size=memory, linesearch=optax.scale_by_zoom_linesearch(
        max_linesearch_steps=20) if lr is None else None)
    # With a line search the value and gradient at the accepted point are already in the state: reuse them.
    vg = optax.value_and_grad_from_state(f) if lr is None else (lambda z, state: jax.value_and_grad(f)(z))

    def step(_, carry):
        z, state = carry
        value, grad = vg(z, state=state)
        updates, state = opt.update(grad, state, z, value=value, grad=grad, value_fn=f)
        z = optax.apply_updates(z, updates)
        return z, state

    z, _ = jax.lax.fori_loop(0, iterations, step, (z0, opt.init(z0)))
    return z, f(z)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "batch", "num_classes", "image_shape"))
def dlg(
    graphdef: nnx.GraphDef,
    params: Params,
    target: Params,
    key: PRNGKeyArray,
    *,
    cfg: AttackConfig,
    batch: int,
    num_classes: int,
    image_shape: tuple[int, int, int],
    labels: Int[Array, " B"] | None = None,
) -> Recovery:
    """DLG when `labels` is None (labels are optimised as soft logits), iDLG-style fixed labels otherwise."""
    cfg = cfg.resolved()
    known = labels is not None
    y_fixed = jax.nn.one_hot(labels, num_classes) if known else None

    def objective(z):
        x, y_logits = z
        y = y_fixed if known else jax.nn.softmax(y_logits, axis=-1)
        return matching.l2_distance(matching.dummy_grads(graphdef, params, x, y), target)

    def run(k):
        kx, ky = jax.random.split(k)
        # DLG's init: standard normal image and label logits (torch.randn), unconstrained during optimisation.
        z0 = (
            jax.random.normal(kx, (batch, *image_shape)),
            jax.random.normal(ky, (batch, num_classes)) if not known else jnp.zeros((batch, num_classes)),
        )
        z, loss = _lbfgs_minimise(objective, z0, cfg.iterations, cfg.memory, cfg.lr)
        # A diverged restart (NaN) must never win the arg-min below.
        return z, jnp.where(jnp.isfinite(loss), loss, jnp.inf)

    if cfg.restarts == 1:
        # No vmap for a single start: under vmap the line search's `lax.cond`s become selects that evaluate both
        # branches, which costs ~5× here (measured in benchmarks/pgla/bench_dlg.py).
        (x1, y1), l1 = run(key)
        (xs, ys), losses = (x1[None], y1[None]), l1[None]
    else:
        (xs, ys), losses = jax.vmap(run)(jax.random.split(key, cfg.restarts))
    best = jnp.argmin(losses)
    x, y = xs[best], ys[best]
    out_labels = labels.astype(jnp.int32) if known else jnp.argmax(y, axis=-1).astype(jnp.int32)
    return Recovery(jnp.clip(x, 0.0, 1.0), out_labels, losses[best], losses)


def idlg(graphdef, params, target, key, *, cfg: AttackConfig, batch: int, num_classes: int, image_shape) -> Recovery:
    """iDLG: analytic labels from the output-bias gradient, then L-BFGS on the image only."""
    labels = matching.infer_labels(target, batch)
    return dlg(graphdef, params, target, key, cfg=cfg, batch=batch, num_classes=num_classes,
               image_shape=image_shape, labels=labels)
