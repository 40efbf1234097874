"""Gradient-matching objectives shared by the inversion attacks, and analytic label recovery (iDLG)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int, PyTree

from pgla_jax import fl

Params = PyTree[Float[Array, "..."]]


def dummy_grads(graphdef: nnx.GraphDef, params: Params, x: Float[Array, "B H W C"], y: Float[Array, "B K"]):
    """The gradient the dummy batch would produce; attacks differentiate this w.r.t. (x, y) (double backprop)."""
    return fl.batch_grad(graphdef, params, x, y)


def l2_distance(a: Params, b: Params) -> Float[Array, ""]:
    """DLG's objective: Σ over every parameter of the squared difference (not a mean: DLG's scale, lr 1)."""
    return sum(jnp.sum((x - y) ** 2) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def cosine_distance(a: Params, b: Params) -> Float[Array, ""]:
    """Inverting Gradients' objective: 1 − cos over the whole concatenated gradient (scale-invariant, so the
    attack survives unknown learning rates and noise that inflates the norm)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    dot = sum(jnp.sum(x * y) for x, y in zip(la, lb, strict=True))
    na = jnp.sqrt(sum(jnp.sum(x * x) for x in la))
    nb = jnp.sqrt(sum(jnp.sum(y * y) for y in lb))
    return 1.0 - dot / (na * nb + 1e-12)


def total_variation(x: Float[Array, "B H W C"]) -> Float[Array, ""]:
    """Anisotropic TV (mean absolute neighbour difference), IG's image prior."""
    dh = jnp.abs(x[:, 1:, :, :] - x[:, :-1, :, :]).mean()
    dw = jnp.abs(x[:, :, 1:, :] - x[:, :, :-1, :]).mean()
    return dh + dw


def last_layer_bias_grad(target: Params) -> Float[Array, " K"]:
    """The gradient of the output layer's bias: the leaf of shape (K,) that comes last in the victim's tree.

    For softmax cross entropy ∂L/∂b_k = mean_i (p_ik − y_ik), negative only at the true labels; iDLG reads the
    label off its sign.
    """
    leaves = [x for x in jax.tree.leaves(target) if x.ndim == 1]
    return leaves[-1]


def infer_labels(target: Params, batch: int) -> Int[Array, " B"]:
    """iDLG's analytic labels. Batch 1: the one negative entry of the output-bias gradient (exact for soft-max CE
    at any weights). Batch > 1: the `batch` most negative entries (exact when the labels in the batch are distinct,
    the usual assumption of this extension)."""
    gb = last_layer_bias_grad(target)
    return jnp.argsort(gb)[:batch].astype(jnp.int32)
