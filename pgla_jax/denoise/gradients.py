"""The denoiser's training data: clean batch-1 gradients of a surrogate model along its own training trajectory.

The attacker (an honest-but-curious server) knows the global weights it sends to clients, so the surrogate starts
from them (the victim's architecture and init) and is trained by SGD on the attacker's own data (Fashion-MNIST in
the paper). At every step the batch-1 gradients of that step's images are recorded, then the weights take one step
on the batch mean. Each gradient is one array_record record (raw float32 bytes of the flat vector, in the codec's
fixed leaf order); `source` reads them back as a grain `MapDataset` with random access.
"""

from __future__ import annotations

import json
import os

import grain
import jax
import jax.numpy as jnp
import numpy as np

from configs import cli, sharding
from pgla_jax import data, fl
from pgla_jax.config import GradientDataConfig
from pgla_jax.models import split_victim

RECORDS = "gradients.array_record"
META = "gradients.json"


def _flat(tree) -> jax.Array:
    return jnp.concatenate([jnp.ravel(g) for g in jax.tree.leaves(tree)])


def build(cfg: GradientDataConfig, out_dir: str, progress=None) -> str:
    """Writes `cfg.steps × cfg.per_step` gradients to `out_dir/gradients.array_record`; returns the path.

    Skips the work when the folder already holds a data set built from the same config. In a multi-host run process
    0 builds first; the others then find its data set (a folder all hosts see) or build their own copy.
    """
    if not sharding.is_primary():
        sharding.barrier(f"gradients {out_dir}")
    path = _build(cfg, out_dir, progress)
    if sharding.is_primary():
        sharding.barrier(f"gradients {out_dir}")
    return path


def _build(cfg: GradientDataConfig, out_dir: str, progress) -> str:
    from array_record.python.array_record_module import ArrayRecordWriter

    os.makedirs(out_dir, exist_ok=True)
    path, meta_path = os.path.join(out_dir, RECORDS), os.path.join(out_dir, META)
    from configs.checkpoint import config_to_json

    want = config_to_json(cfg)
    if os.path.isfile(meta_path) and os.path.isfile(path):
        with open(meta_path) as f:
            if json.load(f).get("config") == want:
                return path
    ds = data.load(cfg.data)
    graphdef, params = split_victim(cfg.victim)
    k = cfg.victim.num_classes

    @jax.jit
    def step(params, x, y):
        y1 = fl.one_hot(y, k)
        per = fl.per_example_grads(graphdef, params, x, y1)
        flat = jax.vmap(_flat)(per)
        mean = jax.tree.map(lambda g: g.mean(axis=0), per)
        return jax.tree.map(lambda p, g: p - cfg.lr * g, params, mean), flat

    rng = np.random.default_rng(cfg.seed)
    varied = np.random.default_rng((cfg.seed, 1))  # its own stream: `augment` = 0 keeps the same images as before
    with cli.replacing(path) as staged:
        writer = ArrayRecordWriter(staged, "group_size:1")
        count, size = 0, None
        for _ in range(cfg.steps):
            idx = rng.choice(len(ds.labels), cfg.per_step, replace=False)
            images = augment(ds.images[idx], cfg.augment, varied) if cfg.augment else ds.images[idx]
            params, flat = step(params, jnp.asarray(images), jnp.asarray(ds.labels[idx]))
            for v in np.asarray(flat, np.float32):
                writer.write(v.tobytes())
                count, size = count + 1, v.size
            progress and progress(1)
        writer.close()
    with cli.written(meta_path) as f:
        json.dump({"config": want, "count": count, "size": size, "dtype": "float32"}, f)
    return path


def augment(images: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """`images` [N, H, W, C] in [0, 1] with about `fraction` of them varied: half become edge maps (the gradient
    magnitude, normalised: strokes from filled shapes), some are thresholded, each gets a random contrast (gamma
    0.5-2) and a shift of up to 3 pixels. Filled garments and thin strokes make other gradients: a model fitted to
    both transfers to images it never saw (MNIST digits from Fashion-MNIST)."""
    out = np.array(images, np.float32, copy=True)
    for i in np.flatnonzero(rng.random(len(out)) < fraction):
        x = out[i]
        if rng.random() < 0.5:
            gy, gx = np.gradient(x, axis=(0, 1))
            e = np.sqrt(gx**2 + gy**2)
            x = e / max(float(e.max()), 1e-6)
        if rng.random() < 0.3:
            x = (x > rng.uniform(0.2, 0.6)).astype(np.float32)
        x = np.clip(x, 0.0, 1.0) ** rng.uniform(0.5, 2.0)
        dy, dx = rng.integers(-3, 4, 2)
        out[i] = np.roll(x, (int(dy), int(dx)), axis=(0, 1))
    return out


def source(out_dir: str) -> tuple[grain.MapDataset, int]:
    """(grain MapDataset of flat float32 gradient vectors, vector length)."""
    with open(os.path.join(out_dir, META)) as f:
        meta = json.load(f)
    src = grain.sources.ArrayRecordDataSource(os.path.join(out_dir, RECORDS))
    return grain.MapDataset.source(src).map(lambda b: np.frombuffer(b, np.float32)), int(meta["size"])


def batch_indices(step: int, batch: int, n: int, seed: int) -> np.ndarray:
    """Indices of training batch `step`: epochs of a per-epoch seeded permutation, so a resumed run sees exactly
    the batches an uninterrupted one would."""
    start = step * batch
    out = []
    while len(out) < batch:
        epoch, pos = divmod(start + len(out), n)
        perm = np.random.default_rng((seed, epoch)).permutation(n)
        out.extend(perm[pos : pos + batch - len(out)])
    return np.asarray(out)

