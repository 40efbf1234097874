"""Inverting Gradients (Geiping et al. 2020): cosine gradient matching + total variation, signed Adam, box constraint.

Labels are given (the attacker's usual assumption) or recovered analytically (`matching.infer_labels`). The step
uses the *sign* of the objective's gradient fed to Adam, with IG's step decay at 3/8, 5/8 and 7/8 of the run, and
the image is projected onto [0, 1] after every step. One `lax.fori_loop` under `jax.jit`; restarts are vmapped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from pgla_jax.config import AttackConfig
from pgla_jax.inversion import matching
from pgla_jax.inversion.dlg import Recovery

Params = PyTree[Float[Array, "..."]]


def _schedule(lr: float, iterations: int) -> optax.Schedule:
    bounds = {int(iterations * f): 0.1 for f in (3 / 8, 5 / 8, 7 / 8)}
    return optax.piecewise_constant_schedule(lr, bounds)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "num_classes", "image_shape"))
def inverting_gradients(
    graphdef: nnx.GraphDef,
    params: Params,
    target: Params,
    labels: Int[Array, " B"],
    key: PRNGKeyArray,
    *,
    cfg: AttackConfig,
    num_classes: int,
    image_shape: tuple[int, int, int],
) -> Recovery:
    cfg = cfg.resolved()
    batch = labels.shape[0]
    y = jax.nn.one_hot(labels, num_classes)
    opt = optax.adam(_schedule(cfg.lr, cfg.iterations))

    def objective(x):
        dist = matching.cosine_distance(matching.dummy_grads(graphdef, params, x, y), target)
        return dist + cfg.tv * matching.total_variation(x)

    def run(k):
        x0 = jnp.clip(0.5 + 0.25 * jax.random.normal(k, (batch, *image_shape)), 0.0, 1.0)

        def step(_, carry):
            x, state = carry
            g = jax.grad(objective)(x)
            updates, state = opt.update(jnp.sign(g), state, x)
            return jnp.clip(optax.apply_updates(x, updates), 0.0, 1.0), state

        x, _ = jax.lax.fori_loop(0, cfg.iterations, step, (x0, opt.init(x0)))
        loss = objective(x)
        return x, jnp.where(jnp.isfinite(loss), loss, jnp.inf)

    xs, losses = jax.vmap(run)(jax.random.split(key, cfg.restarts))
    best = jnp.argmin(losses)
    return Recovery(xs[best], labels.astype(jnp.int32), losses[best], losses)


def ig(graphdef, params, target, key, *, cfg: AttackConfig, batch: int, num_classes: int, image_shape,
       labels: Int[Array, " B"] | None = None) -> Recovery:
    """IG with known `labels`, or with labels recovered analytically from `target` when None."""
    labels = matching.infer_labels(target, batch) if labels is None else labels
    return inverting_gradients(graphdef, params, target, labels, key, cfg=cfg, num_classes=num_classes,
                               image_shape=image_shape)
