"""Federated-learning simulation: client gradients (batch and per-example), FedSGD / FedAvg, server aggregation.

Everything is a pure function of `(graphdef, params, data)` with `graphdef` static, so it jits once per shape.
Clients are a leading axis named ``"clients"`` (logical; `configs/sharding.py` maps it onto the mesh), which makes
a round data-parallel over the devices when a mesh is current and a plain `vmap` otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Float, Int, PyTree

from configs import sharding
from pgla_jax.models import apply

Params = PyTree[Float[Array, "..."]]


def soft_cross_entropy(logits: Float[Array, "B K"], y: Float[Array, "B K"]) -> Float[Array, ""]:
    """Mean cross entropy against soft (or one-hot) labels: DLG optimises the label as a free distribution."""
    return jnp.mean(optax.softmax_cross_entropy(logits, y))


def loss_fn(params: Params, graphdef: nnx.GraphDef, x: Float[Array, "B H W C"], y: Float[Array, "B K"]):
    return soft_cross_entropy(apply(graphdef, params, x), y)


def batch_grad(graphdef: nnx.GraphDef, params: Params, x: Float[Array, "B H W C"], y: Float[Array, "B K"]) -> Params:
    """The gradient a FedSGD client sends: ∇θ of the batch-mean loss."""
    return jax.grad(loss_fn)(params, graphdef, x, y)


def per_example_grads(
    graphdef: nnx.GraphDef, params: Params, x: Float[Array, "B H W C"], y: Float[Array, "B K"]
) -> Params:
    """Per-example gradients, each leaf with a leading batch axis (what DP-SGD clips)."""
    one = lambda xi, yi: batch_grad(graphdef, params, xi[None], yi[None])  # noqa: E731
    return jax.vmap(one)(x, y)


def one_hot(labels: Int[Array, " B"], num_classes: int) -> Float[Array, "B K"]:
    return jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)


# ---------------------------------------------------------------------------------------------------------------
# Rounds.
# ---------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef",))
def fedsgd_client_grads(
    graphdef: nnx.GraphDef, params: Params, x: Float[Array, "N B H W C"], y: Float[Array, "N B K"]
) -> Params:
    """FedSGD: every client (leading axis) computes one batch gradient on the shared weights."""
    x = sharding.shard(x, ("clients", "batch", "height", "width", "channels"))
    return jax.vmap(lambda xi, yi: batch_grad(graphdef, params, xi, yi))(x, y)


def local_sgd(
    graphdef: nnx.GraphDef, params: Params, x: Float[Array, "S B H W C"], y: Float[Array, "S B K"],
    lr: float | Float[Array, ""],
) -> Params:
    """FedAvg client: `S` plain SGD steps over its local batches; returns the update (new − old weights)."""

    def step(p, batch):
        xb, yb = batch
        g = batch_grad(graphdef, p, xb, yb)
        return jax.tree.map(lambda w, gw: w - lr * gw, p, g), None

    new, _ = jax.lax.scan(step, params, (x, y))
    return jax.tree.map(jnp.subtract, new, params)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def fedavg_client_updates(
    graphdef: nnx.GraphDef, params: Params, x: Float[Array, "N S B H W C"], y: Float[Array, "N S B K"],
    lr: float | Float[Array, ""],
) -> Params:
    """FedAvg: every client runs `local_sgd` from the same weights; one update per client."""
    x = sharding.shard(x, ("clients", None, "batch", "height", "width", "channels"))
    return jax.vmap(lambda xi, yi: local_sgd(graphdef, params, xi, yi, lr))(x, y)


def aggregate(updates: Params, weights: Float[Array, " N"] | None = None) -> Params:
    """Server: the (example-count-)weighted mean over the client axis."""
    if weights is None:
        return jax.tree.map(lambda u: u.mean(axis=0), updates)
    w = weights / weights.sum()
    return jax.tree.map(lambda u: jnp.tensordot(w, u, axes=1), updates)


def apply_update(params: Params, update: Params, server_lr: float = 1.0) -> Params:
    return jax.tree.map(lambda p, u: p + server_lr * u, params, update)


def fedsgd_round(graphdef, params, x, y, lr: float, weights=None) -> Params:
    """One FedSGD round: average the clients' gradients and take one SGD step."""
    g = aggregate(fedsgd_client_grads(graphdef, params, x, y), weights)
    return jax.tree.map(lambda p, gw: p - lr * gw, params, g)


def fedavg_round(graphdef, params, x, y, lr: float, weights=None) -> Params:
    """One FedAvg round: average the clients' local-SGD updates."""
    return apply_update(params, aggregate(fedavg_client_updates(graphdef, params, x, y, lr), weights))
