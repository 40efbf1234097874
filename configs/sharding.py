"""The one sharding vocabulary of the project: logical axis names, mesh axes, and the rules between them.

Model code (SAGE and PGLA alike) names the *logical* axes of every parameter and activation (``"embed"``,
``"heads"``, ...). This module is the only place that names *mesh* axes (``data``, ``fsdp``, ``model``) and maps
one onto the other, with one rule set for training (FSDP on) and one for inference (no FSDP when serving).

Typical use::

    mesh = sharding.make_mesh(data=-1)                     # every device on `data`
    with sharding.use(mesh, sharding.INFERENCE_RULES):
        params = sharding.init_sharded(lambda: Model(cfg, rngs=nnx.Rngs(0)))
        y = jax.jit(fn)(params, x)                        # `shard(...)` constraints inside resolve here

Parameters carry their logical names as NNX metadata: ``nnx.Param(value, axes=("embed", "mlp"))``.

Multi-host jobs (a TPU pod slice, or several processes on CPU): every process calls `initialize_distributed()` first,
then builds the same mesh over every host's devices and runs the same program; the last section's helpers (`place`,
`to_host`, `from_primary`, `process_rows`, `barrier`) keep what the hosts do outside compiled code alike.

We build meshes with ``AxisType.Auto`` on purpose (``jax.make_mesh`` now defaults to ``Explicit``): our model code
places constraints with ``with_sharding_constraint`` and lets GSPMD propagate; under ``Explicit`` axes every
matmul whose contracting dimension is sharded on both sides (exactly what FSDP does) would need an explicit
``out_sharding``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

# ---------------------------------------------------------------------------------------------------------------
# Vocabulary.
# ---------------------------------------------------------------------------------------------------------------

#: Mesh axes, outermost first. `data`: replicas over the batch; `fsdp`: parameters sharded, gathered per layer
#: (training only); `model`: tensor parallelism over heads / MLP / vocab.
MESH_AXES: tuple[str, ...] = ("data", "fsdp", "model")

#: Logical axes used by model code. Language models: batch, seq (query tokens), cache_seq (key/value positions),
#: embed, heads, kv_heads, head_dim, mlp, vocab, layers (scan-stacked layers). PGLA: clients (FL clients /
#: restarts), channels, height, width, grad (a flattened gradient vector). `None` always means replicated.
LOGICAL_AXES: tuple[str, ...] = (
    "batch", "seq", "cache_seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers",
    "clients", "channels", "height", "width", "grad",
)

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

#: Training: batch over data x fsdp, parameters' embed dimension FSDP-sharded, tensor parallel on `model`.
TRAIN_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("clients", ("data", "fsdp")),
    ("seq", None),
    ("cache_seq", None),
    ("embed", "fsdp"),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("head_dim", None),
    ("mlp", "model"),
    ("vocab", "model"),
    ("layers", None),
    ("channels", "model"),
    ("height", None),
    ("width", None),
    ("grad", "fsdp"),
)

#: Inference: no FSDP (weights are read every step; gathering them each step would dominate), batch over `data`
#: (and `fsdp`, so a mesh built for training still uses every device), tensor parallel on `model`.
INFERENCE_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("clients", ("data", "fsdp")),
    ("seq", None),
    ("cache_seq", None),
    ("embed", None),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("head_dim", None),
    ("mlp", "model"),
    ("vocab", "model"),
    ("layers", None),
    ("channels", "model"),
    ("height", None),
    ("width", None),
    ("grad", None),
)

_RULE_SETS = {"train": TRAIN_RULES, "inference": INFERENCE_RULES}

# ---------------------------------------------------------------------------------------------------------------
# Meshes.
# ---------------------------------------------------------------------------------------------------------------


def mesh_shape(n_devices: int, data: int = -1, fsdp: int = 1, model: int = 1) -> tuple[int, int, int]:
    """Axis sizes for `n_devices`; at most one size may be -1 (= the devices left over)."""
    sizes = [data, fsdp, model]
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got data={data} fsdp={fsdp} model={model}")
    known = math.prod(s for s in sizes if s != -1)
    if known <= 0 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh axis sizes must be positive or -1, got data={data} fsdp={fsdp} model={model}")
    if -1 in sizes:
        if n_devices % known:
            raise ValueError(f"{n_devices} devices do not split into data={data} fsdp={fsdp} model={model}")
        sizes[sizes.index(-1)] = n_devices // known
    if math.prod(sizes) != n_devices:
        raise ValueError(f"mesh {tuple(sizes)} needs {math.prod(sizes)} devices, {n_devices} present")
    return tuple(sizes)  # type: ignore[return-value]


def make_mesh(data: int = -1, fsdp: int = 1, model: int = 1, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, model) mesh over `devices` (default: all, on every host) with `AxisType.Auto` axes."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(len(devices), data, fsdp, model)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def parse_mesh(text: str) -> dict[str, int]:
    """A mesh as a user writes it, ``"data=1,model=8"`` -> the `make_mesh` sizes ``{"data": 1, "model": 8}``.

    Axes are `MESH_AXES` names, each at most once; a size is a positive integer or -1 (the devices left over, as in
    `make_mesh`); axes not named keep `make_mesh`'s defaults. ValueError (one line) otherwise; whether the sizes fit
    the devices present is `make_mesh`'s check."""
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = (x.strip() for x in part.partition("="))
        if not sep or not name:
            raise ValueError(f"a mesh is AXIS=SIZE[,AXIS=SIZE...] over {', '.join(MESH_AXES)}, got {text!r}")
        if name not in MESH_AXES:
            raise ValueError(f"unknown mesh axis {name!r} in {text!r}; the axes are {', '.join(MESH_AXES)}")
        if name in sizes:
            raise ValueError(f"mesh axis {name!r} given twice in {text!r}")
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1 and size != -1:
            raise ValueError(f"mesh axis {name}: the size must be a positive integer or -1, got {value!r}")
        sizes[name] = size
    if list(sizes.values()).count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {text!r}")
    return sizes


def initialize_distributed() -> bool:
    """Calls `jax.distributed.initialize()` (once per process) when the environment describes a multi-host job;
    True in such a job.

    Cloud TPU pods are detected by `TPU_WORKER_HOSTNAMES` listing several hosts (JAX then finds the coordinator
    itself); other clusters by `JAX_COORDINATOR_ADDRESS` (host:port of process 0) with `JAX_NUM_PROCESSES` and
    `JAX_PROCESS_ID` (JAX reads the address itself, not these two: they are passed on here). Call it first thing
    in an entry point, before any other JAX call; then every process runs the same program (`multi-host` below).
    """
    multi_tpu = len([h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1
    if not (multi_tpu or os.environ.get("JAX_COORDINATOR_ADDRESS")):
        return False
    if jax.distributed.is_initialized():  # a second entry point in the same process
        return True
    kw = {}
    for arg, var in (("num_processes", "JAX_NUM_PROCESSES"), ("process_id", "JAX_PROCESS_ID")):
        if os.environ.get(var):
            try:
                kw[arg] = int(os.environ[var])
            except ValueError:
                raise ValueError(f"{var} must be an integer, got {os.environ[var]!r}") from None
    jax.distributed.initialize(**kw)
    return True


# ---------------------------------------------------------------------------------------------------------------
# Logical names -> PartitionSpec.
# ---------------------------------------------------------------------------------------------------------------

# Set while `map_shards` traces its function: (mesh, the rules as that map cuts the shards).
_inside: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar("map_shards", default=None)
_current: contextvars.ContextVar[tuple[Mesh | None, Rules]] = contextvars.ContextVar(
    "sharding_context", default=(None, INFERENCE_RULES)
)


def rules_for(kind: str) -> Rules:
    """`"train"` or `"inference"` -> the rule set."""
    try:
        return _RULE_SETS[kind]
    except KeyError:
        raise ValueError(f"unknown rule set {kind!r}; expected one of {sorted(_RULE_SETS)}") from None


@contextlib.contextmanager
def use(mesh: Mesh | None, rules: Rules | str = INFERENCE_RULES) -> Iterator[Mesh | None]:
    """Makes `mesh` and `rules` current for `shard`, `init_sharded` and `jax.jit` (via `jax.set_mesh`)."""
    rules = rules_for(rules) if isinstance(rules, str) else rules
    token = _current.set((mesh, rules))
    try:
        if mesh is None or not isinstance(mesh, Mesh):  # an AbstractMesh (lowering for devices not here)
            yield mesh
        else:
            with jax.set_mesh(mesh):
                yield mesh
    finally:
        _current.reset(token)


def current() -> tuple[Mesh | None, Rules]:
    """The (mesh, rules) made current by `use`, or (None, INFERENCE_RULES)."""
    return _current.get()


def logical_to_spec(
    names: Sequence[str | None], rules: Rules | None = None, *, shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> PartitionSpec:
    """Logical axis names -> a mesh `PartitionSpec`.

    A mesh axis is used at most once per spec (the first logical axis that claims it wins). With `shape` and
    `mesh`, mesh axes that do not divide a dimension are dropped for it (e.g. 3 KV heads on a 2-way `model`
    axis stay replicated) instead of failing at placement time.
    """
    rules = current()[1] if rules is None else rules
    table = dict(rules)
    used: set[str] = set()
    out: list[str | tuple[str, ...] | None] = []
    for i, name in enumerate(names):
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise ValueError(f"unknown logical axis {name!r}; add it to configs/sharding.py")
        target = table[name]
        axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        picked: list[str] = []
        size = 1
        for ax in axes:
            if ax in used:
                continue
            if mesh is not None and shape is not None:
                ax_size = mesh.shape[ax]
                if shape[i] % (size * ax_size):
                    continue
                size *= ax_size
            picked.append(ax)
        used.update(picked)
        out.append(None if not picked else picked[0] if len(picked) == 1 else tuple(picked))
    return PartitionSpec(*out)


def named_sharding(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh | None = None,
                   rules: Rules | None = None) -> NamedSharding:
    mesh = mesh if mesh is not None else current()[0]
    if mesh is None:
        raise ValueError("no mesh: pass one or enter `configs.sharding.use(mesh, ...)`")
    return NamedSharding(mesh, logical_to_spec(names, rules, shape=shape, mesh=mesh))


def shard(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrains activation `x` to the sharding of its logical `names`; a no-op when no mesh is current, and inside
    `map_shards` (each device holds its own shard there: nothing is left for the partitioner to place)."""
    mesh, rules = current()
    if mesh is None or _inside.get() is not None:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"{len(names)} logical names {tuple(names)} for an array of rank {x.ndim}")
    return jax.lax.with_sharding_constraint(x, named_sharding(names, x.shape, mesh, rules))


def map_shards(fn: Callable, in_names: Sequence[Sequence[str | None]], out_names, *args):
    """`fn(*args)` run on every device's shard (`jax.shard_map`), the shards cut by the arrays' logical `in_names`
    under the current mesh and rules; the output [.., out_names] is put back together the same way (`out_names`: one
    tuple of names, or a tuple of them for a tuple of outputs). Without a current mesh, plain `fn(*args)`. For ops
    the partitioner cannot split itself (a Pallas kernel is opaque to it), and for computations that choose their
    own collectives (`gather`).

    A logical name splits every array it names alike: where its mesh axes do not divide one of those dimensions, it
    is replicated in all of them (two arrays that must be cut together, such as query heads and the kv heads
    they group over, are given the same name)."""
    mesh, rules = current()
    if mesh is None:
        return fn(*args)
    if len(in_names) != len(args):
        raise ValueError(f"{len(in_names)} name tuples for {len(args)} arguments")
    table = dict(rules)
    kept = {}
    for names, a in zip(in_names, args, strict=True):
        if len(names) != a.ndim:
            raise ValueError(f"{len(names)} logical names {tuple(names)} for an array of rank {a.ndim}")
        for name, dim in zip(names, a.shape, strict=True):
            if name is not None:
                if name not in table:
                    raise ValueError(f"unknown logical axis {name!r}; add it to configs/sharding.py")
                target = table[name]
                axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
                fits = dim % math.prod(mesh.shape[ax] for ax in axes) == 0
                kept[name] = kept.get(name, True) and fits
    local = tuple(r for r in rules if kept.get(r[0], True))
    local += tuple((name, None) for name, ok in kept.items() if not ok)
    specs = tuple(logical_to_spec(names, local) for names in in_names)
    several = bool(out_names) and isinstance(out_names[0], tuple | list)
    out_spec = tuple(logical_to_spec(n, local) for n in out_names) if several else logical_to_spec(out_names, local)

    def body(*a):  # `gather` inside reads the rules as this map cuts the shards
        token = _inside.set((mesh, local))
        try:
            return fn(*a)
        finally:
            _inside.reset(token)

    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=False)(*args)


def gather(x: jax.Array, name: str, axis: int) -> jax.Array:
    """Inside `map_shards`: the whole of `x`'s `axis`, which the logical `name` cuts there, from every device's
    shard in mesh order (an all-gather; nothing is summed, so no value depends on how many devices hold it). `x`
    itself where `name` cuts nothing: outside `map_shards`, or where the map left it replicated."""
    inside = _inside.get()
    if inside is None:
        return x
    mesh, rules = inside
    target = dict(rules).get(name)
    axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    axes = tuple(a for a in axes if mesh.shape[a] > 1)
    if not axes:
        return x
    return jax.lax.all_gather(x, axes[0] if len(axes) == 1 else axes, axis=axis % x.ndim, tiled=True)


# ---------------------------------------------------------------------------------------------------------------
# Parameters.
# ---------------------------------------------------------------------------------------------------------------


def _axes_of(variable) -> tuple[str | None, ...] | None:
    meta = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
    return meta.get("axes")


def state_shardings(state, mesh: Mesh | None = None, rules: Rules | None = None):
    """An `nnx.State` (or abstract state) -> a pytree of `NamedSharding`s of the same structure.

    Variables without `axes` metadata (counters, RNG state) are replicated.
    """
    from flax import nnx

    mesh = mesh if mesh is not None else current()[0]
    if mesh is None:
        raise ValueError("no mesh: pass one or enter `configs.sharding.use(mesh, ...)`")
    rules = current()[1] if rules is None else rules

    def one(v):
        axes = _axes_of(v)
        shape = np.shape(v.get_value() if hasattr(v, "get_value") else v)
        if axes is None:
            return v.replace(NamedSharding(mesh, PartitionSpec()))
        if len(axes) != len(shape):
            raise ValueError(f"axes {axes} do not match a parameter of shape {shape}")
        return v.replace(NamedSharding(mesh, logical_to_spec(axes, rules, shape=shape, mesh=mesh)))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def init_sharded(factory: Callable[[], object], mesh: Mesh | None = None, rules: Rules | None = None):
    """Builds an NNX module with every parameter born sharded (no full copy on one device)."""
    from flax import nnx

    abstract = nnx.eval_shape(factory)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, mesh, rules)
    state = jax.jit(lambda: nnx.split(factory())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def mesh_of(tree) -> Mesh | None:
    """The mesh the arrays of `tree` (parameters, a module's state) are placed on: that of the first leaf with a
    `NamedSharding` over a concrete mesh, or None when nothing is on a mesh."""
    for leaf in jax.tree.leaves(tree):
        s = getattr(leaf, "sharding", None)
        if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh):
            return s.mesh
    return None


def tensor_parallelism(mesh: Mesh | None) -> int:
    """How many ways the inference rules cut a layer's heads and MLP on `mesh` (its `model` axis; 1 without a
    mesh)."""
    return 1 if mesh is None else int(dict(mesh.shape).get("model", 1))


# ---------------------------------------------------------------------------------------------------------------
# Multi-host. Every process runs the same program (multi-controller JAX): the same jitted calls in the same order,
# with the same host values (numpy inputs are taken as replicated, so they must agree). These helpers keep the
# host-side parts alike; with one process each is its plain single-host counterpart.
# ---------------------------------------------------------------------------------------------------------------


def is_primary() -> bool:
    """Whether this is process 0: the one that prints and writes files meant once per job."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Returns once every process has called `barrier(name)` (at once with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def place(value, where: jax.sharding.Sharding) -> jax.Array:
    """`jax.device_put(value, where)` for a value every host holds alike (numpy, or an array on this host's devices):
    on a mesh over several hosts each host fills only its own devices' slices, with no traffic between hosts
    (`device_put` would send every host's copy to every other, to check that they agree)."""
    if jax.process_count() == 1 or where.is_fully_addressable:
        return jax.device_put(value, where)
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, where, lambda index: value[index])


def to_host(x) -> np.ndarray:
    """The whole value of `x` as numpy. An array spread over several hosts' devices is gathered from them, which is a
    collective: every process must call it for the same arrays in the same order."""
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def from_primary(value):
    """Process 0's `value` (anything `json` writes) on every process, for host-side choices that must agree (a cost
    measured on each host, a file only one host may have). A collective; `value` itself with one process."""
    if jax.process_count() == 1:
        return value
    import json

    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8) if is_primary() else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
    buf = np.zeros(size, np.uint8)
    buf[: data.size] = data
    return json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes().decode())


def process_rows(where: NamedSharding, shape: Sequence[int]) -> np.ndarray:
    """Indices along axis 0 of a global array of `shape` placed by `where` that this process's devices hold, in
    order: the rows its part must have for `jax.make_array_from_process_local_data(where, part, shape)` (a
    data-parallel batch is loaded that way, each host reading only its rows). Every row with one process."""
    rows: set[int] = set()
    for index in where.addressable_devices_indices_map(tuple(shape)).values():
        rows.update(range(*index[0].indices(shape[0])))
    return np.asarray(sorted(rows), np.int64)
