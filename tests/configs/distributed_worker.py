"""One process of a run of `test_distributed.py`: a SAGE generation sharded over a (data, model) mesh of 4 CPU
devices and the denoiser's training through its command line, either with all 4 devices in this process or with
2 in each of the 2 processes of a multi-process job.

    python tests/configs/distributed_worker.py SPEC.json

SPEC: {"devices": this process's CPU devices, "target" / "draft": LM checkpoints, "data_dir": the denoiser's
gradient data set, "workdir": its training folder, "out": where result.<process>.json goes, "cache": the persistent
compilation cache or null}. The job is described by the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID), which the training command's `configs.sharding.initialize_distributed` reads.
"""

import contextlib
import io
import json
import os
import sys
import time

# Left-padded into one 16-token bucket; over data=2 the first two rows are one process's, the last two the other's.
PROMPTS = [[5, 17, 33, 2, 90], [64, 8, 8, 120, 31, 7, 77, 3, 12], [101, 44, 9],
           [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]]


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import jax

    jax.config.update("jax_num_cpu_devices", spec["devices"])
    if spec["cache"]:
        jax.config.update("jax_compilation_cache_dir", spec["cache"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    from configs import sharding

    # The training command comes first: it joins the job itself (`initialize_distributed` before any JAX work).
    result = {"seconds": {}}
    for name, part in (("pgla", _pgla), ("sage", _sage), ("profiles", _profiles), ("local", _local)):
        t0 = time.perf_counter()
        result[name] = part(spec)
        result["seconds"][name] = round(time.perf_counter() - t0, 1)
    result.update(joined=sharding.initialize_distributed(), processes=jax.process_count(), devices=jax.device_count())
    with open(os.path.join(spec["out"], f"result.{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)


def _sage(spec: dict) -> dict:
    """Four prompts with the SAGE policy (a small tree), target and draft tensor-parallel over `model`, the rows
    over `data`; which final-state reads had to gather rows held by the other process."""
    import jax

    import sage_jax
    from configs import sharding
    from sage_jax.decoding.policies import TreePolicy

    gathered, to_host = [], sharding.to_host

    def spy(x):
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
            gathered.append(list(x.shape))
        return to_host(x)

    sharding.to_host = spy
    try:
        engine = sage_jax.load_engine(spec["target"], draft=spec["draft"], mesh=sharding.make_mesh(data=2, model=2))
        policy = TreePolicy.sage(n_max=12, frontier=4, d_cap=4, d_min=1, d_max=3, top_k=4, w_max=4)
        gen = engine.generate(PROMPTS, policy=policy, max_new_tokens=12)
    finally:
        sharding.to_host = to_host
    st = gen.stats
    return {"token_ids": gen.token_ids, "steps": st.steps, "draft_forwards": st.draft_forwards,
            "mean_accepted": st.mean_accepted, "accepted_at": st.accepted_at, "gathered": gathered,
            "qkv_spec": str(engine.target_lm.layers[0]["qkv"].sharding.spec)}


def _pgla(spec: dict) -> dict:
    """`python -m pgla_jax.train_denoiser` (in this process): one step of the tiny recipe data-parallel over every
    device, then the same command again, which resumes: it restores the state every process saved, finds the step
    done and writes the denoiser anew from the restored weights (a second training step would compile the step again,
    ~20 s more on one core; so would the DnCNN baseline, left out). What each run printed."""
    from pgla_jax import train_denoiser

    argv = ["--config", "denoiser_tiny", "--workdir", spec["workdir"], "--data-dir", spec["data_dir"],
            "--mesh", "data=-1", "--max-steps", "1", "--set", "dncnn_steps=0"]
    printed = []
    for _ in range(2):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = train_denoiser.main(argv)
        assert code == 0, f"train_denoiser exited with {code}"
        printed.append(out.getvalue())
    return {"printed": printed}


def _profiles(spec: dict) -> dict:
    """The budget chooser's cost profile on hosts that each keep their own profile folder: measured by every process
    when process 0 has none stored (process 0's measurement used), read from process 0's folder when only it has
    one (nobody measures)."""
    import shutil

    import jax

    from sage_jax.decoding import budget

    me = jax.process_index()
    folder = os.path.join(spec["out"], f"profiles.{me}")
    measured = []

    def measure():
        measured.append(me)
        return budget.CostProfile(device=f"measured by process {me}", verify_widths=[2], verify_ms=[1.0 + me],
                                  draft_widths=[1], draft_ms=[0.5])

    first = budget.cached_profile("key", measure, folder)
    if me != 0:
        shutil.rmtree(folder)  # a host without the stored profile
    second = budget.cached_profile("key", measure, folder)
    return {"devices": [first.device, second.device], "measured": measured}


def _local(spec: dict) -> dict:
    """A checkpoint of arrays each process holds whole on its own device (as the DnCNN baseline's, trained by every
    host alike), saved by every process into one folder and restored."""
    import jax.numpy as jnp
    import numpy as np

    from configs import checkpoint

    path = os.path.join(spec["out"], "local_ckpt")
    checkpoint.save(path, {"w": jnp.arange(6.0).reshape(2, 3), "n": np.int32(7)}, kind="test", overwrite=True)
    back = checkpoint.restore(path)
    return {"w": np.asarray(back["w"]).tolist(), "n": int(back["n"])}


if __name__ == "__main__":
    main(sys.argv[1])
