"""Victim models for federated-learning gradient leakage: DLG LeNet, MLP, small ReLU ConvNet, ResNet-style net.

All take NHWC images in [0, 1] and return logits. None keeps running statistics (no BatchNorm): a gradient-inversion
victim must be a pure function of (params, x), and BatchNorm in train mode would couple the examples of a batch.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from pgla_jax.config import VictimConfig


def _uniform_half(key, shape, dtype=jnp.float32):
    # DLG's `weights_init`: every weight and bias ~ U(-0.5, 0.5). Large sigmoid weights make the gradient
    # strongly depend on the input, which is what makes DLG work on this net.
    return jax.random.uniform(key, shape, dtype, -0.5, 0.5)


class LeNet(nnx.Module):
    """The DLG LeNet: three 5×5 sigmoid convs (stride 2, 2, 1; 12 channels) and one linear layer.

    28×28×1 → 588 features (13,426 parameters with 10 classes); 32×32×3 → 768 features.
    """

    def __init__(self, image_shape: tuple[int, int, int], num_classes: int, width: int = 12, *, rngs: nnx.Rngs):
        h, w, c = image_shape
        kw = dict(kernel_size=(5, 5), padding=((2, 2), (2, 2)), kernel_init=_uniform_half, bias_init=_uniform_half)
        self.conv1 = nnx.Conv(c, width, strides=2, rngs=rngs, **kw)
        self.conv2 = nnx.Conv(width, width, strides=2, rngs=rngs, **kw)
        self.conv3 = nnx.Conv(width, width, strides=1, rngs=rngs, **kw)
        # Two stride-2 'same'-padded convs: ceil(ceil(n / 2) / 2) per spatial side.
        feat = math.ceil(math.ceil(h / 2) / 2) * math.ceil(math.ceil(w / 2) / 2) * width
        self.fc = nnx.Linear(feat, num_classes, kernel_init=_uniform_half, bias_init=_uniform_half, rngs=rngs)

    def __call__(self, x: Float[Array, "B H W C"]) -> Float[Array, "B K"]:
        x = jax.nn.sigmoid(self.conv1(x))
        x = jax.nn.sigmoid(self.conv2(x))
        x = jax.nn.sigmoid(self.conv3(x))
        return self.fc(x.reshape(x.shape[0], -1))


class MLP(nnx.Module):
    """Two sigmoid hidden layers: the "DNN" victim of the paper."""

    def __init__(self, image_shape: tuple[int, int, int], num_classes: int, width: int = 12, *, rngs: nnx.Rngs):
        d = image_shape[0] * image_shape[1] * image_shape[2]
        hidden = 8 * width
        self.l1 = nnx.Linear(d, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, num_classes, rngs=rngs)

    def __call__(self, x: Float[Array, "B H W C"]) -> Float[Array, "B K"]:
        x = x.reshape(x.shape[0], -1)
        return self.out(jax.nn.sigmoid(self.l2(jax.nn.sigmoid(self.l1(x)))))


class ConvNet(nnx.Module):
    """A small ReLU ConvNet (3×3 convs, 2× average pooling), the usual "CNN" victim."""

    def __init__(self, image_shape: tuple[int, int, int], num_classes: int, width: int = 12, *, rngs: nnx.Rngs):
        h, w, c = image_shape
        self.conv1 = nnx.Conv(c, width, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(width, 2 * width, kernel_size=(3, 3), rngs=rngs)
        self.fc = nnx.Linear((h // 4) * (w // 4) * 2 * width, num_classes, rngs=rngs)

    def __call__(self, x: Float[Array, "B H W C"]) -> Float[Array, "B K"]:
        x = nnx.avg_pool(jax.nn.relu(self.conv1(x)), (2, 2), (2, 2))
        x = nnx.avg_pool(jax.nn.relu(self.conv2(x)), (2, 2), (2, 2))
        return self.fc(x.reshape(x.shape[0], -1))


class _Block(nnx.Module):
    def __init__(self, cin: int, cout: int, stride: int, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(cin, cout, (3, 3), strides=stride, rngs=rngs)
        self.norm1 = nnx.GroupNorm(cout, num_groups=min(4, cout), rngs=rngs)
        self.conv2 = nnx.Conv(cout, cout, (3, 3), rngs=rngs)
        self.norm2 = nnx.GroupNorm(cout, num_groups=min(4, cout), rngs=rngs)
        self.skip = nnx.Conv(cin, cout, (1, 1), strides=stride, rngs=rngs) if (stride != 1 or cin != cout) else None

    def __call__(self, x):
        y = self.norm2(self.conv2(jax.nn.relu(self.norm1(self.conv1(x)))))
        return jax.nn.relu(y + (x if self.skip is None else self.skip(x)))


class ResNet(nnx.Module):
    """ResNet-style: a stem, three residual stages (GroupNorm, per-example), global average pooling."""

    def __init__(self, image_shape: tuple[int, int, int], num_classes: int, width: int = 12, *, rngs: nnx.Rngs):
        c = image_shape[2]
        self.stem = nnx.Conv(c, width, (3, 3), rngs=rngs)
        self.stage1 = _Block(width, width, 1, rngs=rngs)
        self.stage2 = _Block(width, 2 * width, 2, rngs=rngs)
        self.stage3 = _Block(2 * width, 4 * width, 2, rngs=rngs)
        self.fc = nnx.Linear(4 * width, num_classes, rngs=rngs)

    def __call__(self, x: Float[Array, "B H W C"]) -> Float[Array, "B K"]:
        x = self.stage3(self.stage2(self.stage1(jax.nn.relu(self.stem(x)))))
        return self.fc(x.mean(axis=(1, 2)))


_KINDS = {"lenet": LeNet, "mlp": MLP, "convnet": ConvNet, "resnet": ResNet}


def make_victim(cfg: VictimConfig) -> nnx.Module:
    """The victim model of `cfg`, initialised from `cfg.seed`."""
    if cfg.kind not in _KINDS:
        raise ValueError(f"unknown victim {cfg.kind!r}; expected one of {sorted(_KINDS)}")
    return _KINDS[cfg.kind](cfg.image_shape, cfg.num_classes, cfg.width, rngs=nnx.Rngs(cfg.seed))


def split_victim(cfg: VictimConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params): the static structure (a valid `jit` static argument) and the weight pytree."""
    return nnx.split(make_victim(cfg))


def apply(graphdef: nnx.GraphDef, params: nnx.State, x: Float[Array, "B H W C"]) -> Float[Array, "B K"]:
    """Logits of the victim `(graphdef, params)`: the pure function every attack differentiates twice."""
    return nnx.merge(graphdef, params)(x)
