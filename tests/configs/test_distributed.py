"""The multi-host path for real on CPU: two processes on localhost joined by `jax.distributed` (the CPU collectives,
gloo) run a sharded SAGE generation and the denoiser's training command, and give what one process with the same
four devices gives. Also the multi-host helpers of `configs/sharding.py` in one process, and `--mesh` parsing."""

import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs import checkpoint, sharding

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_worker.py")


# ---------------------------------------------------------------------------------------------------------------
# Two processes against one.
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny random target (its weights scaled up: confident enough that SAGE builds trees of a few levels), a
    draft that is the target perturbed by 5% noise (it agrees often, not always), and the tiny denoiser recipe's
    gradient data set."""
    from flax import nnx

    from configs import cli
    from pgla_jax.config import DenoiserConfig
    from pgla_jax.denoise import gradients
    from sage_jax.io import lm_checkpoint
    from sage_jax.models import Decoder, LMConfig

    root = tmp_path_factory.mktemp("distributed")
    target = Decoder(LMConfig.tiny(), rngs=nnx.Rngs(0))
    params = jax.tree.map(lambda x: np.asarray(x) * (40.0 if x.ndim > 1 else 1.0), target.params())
    rng = np.random.default_rng(1)
    draft = jax.tree.map(lambda x: (x * (1 + 0.05 * rng.standard_normal(x.shape))).astype(x.dtype), params)
    lm_checkpoint.save_lm(root / "target", target.cfg, params)
    lm_checkpoint.save_lm(root / "draft", target.cfg, draft)
    cfg = cli.load_config("denoiser_tiny", "configs.pgla", DenoiserConfig)
    gradients.build(cfg.gradients, str(root / "gradients"))
    return {"root": root, "target": str(root / "target"), "draft": str(root / "draft"),
            "data_dir": str(root / "gradients")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(inputs, name: str, processes: int, port: int) -> list[tuple[subprocess.Popen, str]]:
    """The worker's processes of one run (4 CPU devices in all), each with its own environment and log file.

    One process uses the tests' persistent compilation cache. Two processes compile everything: JAX reads and writes
    that cache in process 0 only, and a process much faster than the other (one reading a program from the cache
    while the other compiles it) fails at the program's first collective, where the CPU collectives (gloo) wait 30 s
    for the peers."""
    run = inputs["root"] / name
    (run / "out").mkdir(parents=True)
    spec = {"devices": 4 // processes, "target": inputs["target"], "draft": inputs["draft"],
            "data_dir": inputs["data_dir"], "workdir": str(run / "work"), "out": str(run / "out"),
            "cache": jax.config.jax_compilation_cache_dir if processes == 1 else None}
    (run / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES",
                                                                     "JAX_PROCESS_ID", "TPU_WORKER"))}
    # The pytest process forces 8 host devices through XLA_FLAGS; the workers set their own count.
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    env.update(JAX_NUMPY_RANK_PROMOTION="raise", SAGE_JAX_CACHE=str(run / "sage_cache"), PYTHONUNBUFFERED="1")
    procs = []
    for i in range(processes):
        if processes > 1:
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
                       JAX_PROCESS_ID=str(i))
        log = str(run / f"log.{i}.txt")
        with open(log, "w") as f:
            procs.append((subprocess.Popen([sys.executable, WORKER, str(run / "spec.json")], env=dict(env),
                                           stdout=f, stderr=subprocess.STDOUT, start_new_session=True), log))
    return procs


def _wait(procs, timeout: float) -> None:
    """Waits for every process; on a failure or past `timeout`, ends the others (a process whose peer died waits at
    the next collective until the coordination service gives up) and fails with the logs' tails."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p, _ in procs):
            if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p, _ in procs):
                break
            time.sleep(0.5)
    finally:
        for p, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    if any(p.returncode != 0 for p, _ in procs):
        tails = "\n".join(f"--- {log} (exit {p.returncode})\n" + open(log).read()[-3000:] for p, log in procs)
        pytest.fail(f"a worker failed or ran past {timeout:.0f} s:\n{tails}")


def _restored(path: str) -> dict:
    return jax.tree.map(np.asarray, checkpoint.restore(path))


def _training_state(workdir: str) -> dict:
    """The latest training state of the denoiser's loop in WORKDIR/state (an Orbax `CheckpointManager` folder), on
    this process's first device."""
    import orbax.checkpoint as ocp

    from pgla_jax.denoise import loop

    path = os.path.join(workdir, loop.STATE, str(loop.saved_step(workdir)), "state")
    ckptr = ocp.StandardCheckpointer()
    md = ckptr.metadata(path)
    md = getattr(getattr(md, "item_metadata", md), "tree", md)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), md)
    return jax.tree.map(np.asarray, ckptr.restore(path, abstract))


@pytest.mark.integration
def test_two_processes_give_what_one_gives(inputs):
    """2 processes x 2 CPU devices against 1 process x 4, both started as a user would start them (fresh
    processes, `initialize_distributed` from the environment), all three at once."""
    t0 = time.perf_counter()
    one = _launch(inputs, "one", 1, 0)
    two = _launch(inputs, "two", 2, _free_port())
    _wait(one + two, timeout=480)
    print(f"three worker processes (1 + 2) in {time.perf_counter() - t0:.0f} s")
    res = {name: [json.loads((inputs["root"] / name / "out" / f"result.{i}.json").read_text()) for i in range(n)]
           for name, n in (("one", 1), ("two", 2))}
    (ref,), (p0, p1) = res["one"], res["two"]
    print("seconds per part:", {name: r["seconds"] for name, r in (("one", ref), ("two/0", p0), ("two/1", p1))})
    assert (ref["joined"], ref["processes"], ref["devices"]) == (False, 1, 4)
    assert [(p["joined"], p["processes"], p["devices"]) for p in (p0, p1)] == [(True, 2, 4)] * 2

    # SAGE: the same tokens and the same trees, step for step; the weights were cut over `model`, and the rows
    # held by the other process had to be gathered to read the result.
    sage = ref["sage"]
    assert len(sage["token_ids"]) == 4 and all(len(t) >= 1 for t in sage["token_ids"])
    assert sage["mean_accepted"] > 0  # real trees, some of their nodes accepted
    for p in (p0, p1):
        for key in ("token_ids", "steps", "draft_forwards", "accepted_at", "qkv_spec"):
            assert p["sage"][key] == sage[key], key
        assert p["sage"]["mean_accepted"] == pytest.approx(sage["mean_accepted"])
        assert p["sage"]["gathered"], "no result was spread over both processes"
    assert "model" in sage["qkv_spec"] and sage["gathered"] == []

    # PGLA: the training command's checkpoints (written by both processes into one folder) hold the same weights:
    # the denoiser (EMA; rewritten by the resumed run from the state it restored), the training state after one step.
    work = {name: str(inputs["root"] / name / "work") for name in ("one", "two")}
    for sub, read in (("denoiser", lambda w: _restored(os.path.join(w, "denoiser"))), ("state", _training_state)):
        a, b = read(work["one"]), read(work["two"])
        assert jax.tree.structure(a) == jax.tree.structure(b), sub
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-7, err_msg=sub)
    assert int(_training_state(work["two"])["step"]) == 1
    printed = [p["pgla"]["printed"] for p in (ref, p0, p1)]
    assert all(line.startswith("denoiser checkpoint: ") for line in printed[0] + printed[1])
    assert printed[2] == ["", ""]  # only process 0 prints

    # A checkpoint of arrays every process holds whole (each on its own device) is written once and reads back.
    assert [p["local"] for p in (ref, p0, p1)] == [{"w": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "n": 7}] * 3

    # The budget chooser's cost profile is process 0's on every process, measured or stored.
    for p in (ref, p0, p1):
        assert p["profiles"]["devices"] == ["measured by process 0"] * 2
    assert [p["profiles"]["measured"] for p in (ref, p0, p1)] == [[0], [0], [1]]


# ---------------------------------------------------------------------------------------------------------------
# The helpers in one process, and --mesh.
# ---------------------------------------------------------------------------------------------------------------


def test_single_process_helpers_are_their_plain_counterparts(devices):
    mesh = sharding.make_mesh(data=2, model=2, devices=devices[:4])
    where = sharding.named_sharding(("batch", None), (8, 3), mesh)
    x = sharding.place(np.arange(24.0).reshape(8, 3), where)
    assert x.sharding == where
    np.testing.assert_array_equal(sharding.to_host(x), np.arange(24.0).reshape(8, 3))
    np.testing.assert_array_equal(sharding.process_rows(where, (8, 3)), np.arange(8))
    assert sharding.from_primary({"a": [1, 2]}) == {"a": [1, 2]}
    assert sharding.is_primary()
    sharding.barrier("nothing to wait for")
    assert sharding.mesh_of({"w": x, "n": np.zeros(2)}) is mesh and sharding.mesh_of({"n": np.zeros(2)}) is None


def test_initialize_distributed_passes_the_process_count_and_rank(monkeypatch):
    """JAX reads JAX_COORDINATOR_ADDRESS itself but not the other two: `initialize_distributed` passes them on."""
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.2:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert sharding.initialize_distributed() is True
    monkeypatch.setenv("JAX_PROCESS_ID", "three")
    with pytest.raises(ValueError, match="JAX_PROCESS_ID must be an integer"):
        sharding.initialize_distributed()
    monkeypatch.delenv("JAX_NUM_PROCESSES")
    monkeypatch.delenv("JAX_PROCESS_ID")
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    assert sharding.initialize_distributed() is True  # joined already: not again
    assert calls == [{"num_processes": 4, "process_id": 3}]


@pytest.mark.parametrize("text,sizes", [("data=1,model=8", {"data": 1, "model": 8}), ("model=-1", {"model": -1}),
                                        (" data = 2 , fsdp=2 ", {"data": 2, "fsdp": 2})])
def test_parse_mesh(text, sizes):
    assert sharding.parse_mesh(text) == sizes


@pytest.mark.parametrize("text,needle", [("tensor=8", "unknown mesh axis 'tensor'"), ("model=0", "positive integer"),
                                         ("model=two", "positive integer"), ("model", "AXIS=SIZE"),
                                         ("data=-1,model=-1", "at most one"), ("data=1,data=2", "twice"),
                                         ("", "AXIS=SIZE")])
def test_parse_mesh_rejects(text, needle):
    with pytest.raises(ValueError, match=needle) as e:
        sharding.parse_mesh(text)
    assert "\n" not in str(e.value)
