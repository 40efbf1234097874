"""Gradient codec: a model's gradient pytree ↔ the array a denoiser sees, with an exact round trip.

Three layouts, all from one fixed leaf order (`jax.tree.leaves`, i.e. sorted module paths of the `nnx.State`):

* ``image2d`` (the paper's): every leaf flattened and concatenated, padded with the vector's **mean** (the released
  `channel_deal_3`) to side², reshaped to a [side, side, 1] image. The side is the smallest multiple of the U-Net's
  downsampling factor whose square holds the gradient (116 for the 13,426-parameter LeNet; the paper pads to 120).
* ``vector1d``: the same flat vector as a [L, 1] signal, L the next multiple of the downsampling factor.
* ``per_layer``: one row per leaf, each padded with its own mean to the longest leaf: [leaves, L].

Decoding drops the padding, so `decode(encode(g)) == g` bit for bit (the padding only exists for the U-Net).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PyTree

from pgla_jax.config import Layout

Params = PyTree[Float[Array, "..."]]


@dataclasses.dataclass(frozen=True)
class GradientCodec:
    """Attributes:
      treedef: the gradient pytree's structure (hashable: a codec is a valid static `jit` argument).
      shapes: each leaf's shape, in leaf order.
      layout: see the module docstring.
      side: image2d side; vector1d / per_layer length (the padded length).
    """

    treedef: jax.tree_util.PyTreeDef
    shapes: tuple[tuple[int, ...], ...]
    layout: Layout
    side: int

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def size(self) -> int:
        """Number of real gradient entries (the rest is padding)."""
        return sum(self.sizes)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of one encoded gradient (no batch axis)."""
        if self.layout == "image2d":
            return (self.side, self.side, 1)
        if self.layout == "vector1d":
            return (self.side, 1)
        return (len(self.shapes), self.side)

    def encode(self, grads: Params) -> Float[Array, "..."]:
        leaves = self.treedef.flatten_up_to(grads)
        if self.layout == "per_layer":
            rows = []
            for g in leaves:
                v = jnp.ravel(g).astype(jnp.float32)
                rows.append(jnp.concatenate([v, jnp.full((self.side - v.size,), v.mean(), v.dtype)]))
            return jnp.stack(rows)
        flat = jnp.concatenate([jnp.ravel(g).astype(jnp.float32) for g in leaves])
        total = math.prod(self.shape)
        flat = jnp.concatenate([flat, jnp.full((total - flat.size,), flat.mean(), flat.dtype)])
        return flat.reshape(self.shape)

    def decode(self, x: Float[Array, "..."]) -> Params:
        if self.layout == "per_layer":
            leaves = [x[i, :n].reshape(s) for i, (n, s) in enumerate(zip(self.sizes, self.shapes, strict=True))]
        else:
            flat = x.reshape(-1)
            offsets = np.cumsum((0,) + self.sizes)
            leaves = [flat[a:b].reshape(s) for a, b, s in zip(offsets[:-1], offsets[1:], self.shapes, strict=True)]
        return jax.tree.unflatten(self.treedef, leaves)

    def unflatten(self, flat: Float[Array, " P"]) -> Params:
        """A flat vector in leaf order (what `jax.tree.leaves` + ravel + concatenate gives) → the pytree."""
        offsets = np.cumsum((0,) + self.sizes)
        leaves = [flat[a:b].reshape(s) for a, b, s in zip(offsets[:-1], offsets[1:], self.shapes, strict=True)]
        return jax.tree.unflatten(self.treedef, leaves)

    def mask(self) -> Float[Array, "..."]:
        """1 on real entries, 0 on padding (same shape as `encode`'s output)."""
        if self.layout == "per_layer":
            return jnp.stack([(jnp.arange(self.side) < n).astype(jnp.float32) for n in self.sizes])
        return (jnp.arange(math.prod(self.shape)) < self.size).astype(jnp.float32).reshape(self.shape)


def make_codec(grads_like: Params, layout: Layout = "image2d", multiple: int = 4, side: int | None = None
               ) -> GradientCodec:
    """A codec for gradients shaped like `grads_like` (arrays or `ShapeDtypeStruct`s).

    `multiple`: the U-Net's downsampling factor (`UNetConfig.multiple`); `side` overrides the image side
    (e.g. 120 for the paper's exact layout) and must be a multiple of it.
    """
    leaves, treedef = jax.tree.flatten(grads_like)
    shapes = tuple(tuple(int(d) for d in np.shape(g)) for g in leaves)
    sizes = [math.prod(s) for s in shapes]
    if layout == "image2d":
        need = math.ceil(math.sqrt(sum(sizes)))
    elif layout == "vector1d":
        need = sum(sizes)
    elif layout == "per_layer":
        need = max(sizes)
    else:
        raise ValueError(f"unknown layout {layout!r}; expected image2d, vector1d or per_layer")
    fit = -(-need // multiple) * multiple
    if side is not None:
        if side % multiple or side < need:
            raise ValueError(f"side {side} must be a multiple of {multiple} and at least {need}")
        fit = side
    return GradientCodec(treedef, shapes, layout, fit)
