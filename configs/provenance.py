"""What produced a results file: the checkout's commit, the checkpoints measured, the machine and the command.

Every results file the benchmarks of both papers write carries `record(...)`: `python -m sage_jax.bench`
(`bench.json`, `table.md`, `vlm_bench.json`), `python -m pgla_jax.attack` (`results.json`, `results.md`) and the
scripts under `benchmarks/`. A figure quoted anywhere names such a file, so it can be traced to the code, the
weights and the CPU that gave it.

    {"commit": "86c144c...-dirty", "command": "python -m sage_jax.bench --out OUT",
     "draft": ".../smollm2_eagle", "draft_sha256": "3f0c...", "cpu": "AMD EPYC 7B13", "cores": 2, "threads": 2,
     "jax": "0.10.2", "jaxlib": "0.10.2", "backend": "cpu", "device_kind": "cpu", "time": "2026-12-06 10:00:00"}
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

#: The manifest a checkpoint directory may carry (`sha256  relative/path` per file; `sage_jax.io.loader`).
MANIFEST = "SHA256SUMS"

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit(root: str = _ROOT) -> str:
    """`git rev-parse HEAD` of the checkout at `root` (this project's by default), with "-dirty" when a tracked
    file has uncommitted changes; "unknown" outside a git checkout or without git."""
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.returncode != 0 or dirty.stdout.strip() else "")


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file, read in 1 MiB blocks: the one digest of files every module uses."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_sha256(path: str | os.PathLike | None) -> str | None:
    """One digest for a checkpoint: a file's sha256; for a directory, the sha256 of its `SHA256SUMS` manifest
    when it has one (which lists every file's digest), else the sha256 of the manifest it would have: one line
    `sha256  relative/path` per file, in sorted order. None for no path (e.g. a self-draft)."""
    if path is None:
        return None
    path = os.fspath(path)
    if os.path.isfile(path):
        return file_sha256(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path} not found")
    manifest = os.path.join(path, MANIFEST)
    if os.path.isfile(manifest):
        return file_sha256(manifest)
    rels = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)
    text = "".join(f"{file_sha256(os.path.join(path, r))}  {r}\n" for r in rels)
    return hashlib.sha256(text.encode()).hexdigest()


def cpu() -> tuple[str, int]:
    """The CPU's model name (/proc/cpuinfo's `model name`, else what `platform` says) and its core count."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            name = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), name)
    except OSError:
        pass
    return name, os.cpu_count() or 0


def command(prog: str, argv: Sequence[str] | None = None) -> str:
    """The command line as typed: `prog` (e.g. "python -m sage_jax.bench") and its arguments (default:
    `sys.argv[1:]`), shell-quoted."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join([prog, *map(shlex.quote, args)])


def record(prog: str, argv: Sequence[str] | None = None,
           checkpoints: Mapping[str, str | os.PathLike | None] = ()) -> dict:
    """Everything a results file records about what produced it. `checkpoints` names the weights measured, e.g.
    `{"draft": path}` or `{"denoiser": path}`: each gives a `<name>` (its path, or None) and `<name>_sha256` field
    (`checkpoint_sha256`)."""
    import jax
    import jaxlib

    name, cores = cpu()
    out: dict = {"commit": commit(), "command": command(prog, argv)}
    for key, path in dict(checkpoints).items():
        out[key] = None if path is None else os.path.abspath(os.fspath(path))
        out[f"{key}_sha256"] = checkpoint_sha256(path)
    dev = jax.devices()[0]
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    out.update(cpu=name, cores=cores, threads=threads, jax=jax.__version__, jaxlib=jaxlib.__version__,
               backend=dev.platform, device_kind=dev.device_kind, device_count=jax.device_count(),
               time=time.strftime("%Y-%m-%d %H:%M:%S"))
    return out


def machine(rec: Mapping) -> str:
    """One line for a report's header: CPU, cores, jax and the backend."""
    return f"{rec['cpu']}, {rec['cores']} cores, jax {rec['jax']} on {rec['backend']}"


def markdown(rec: Mapping) -> str:
    """The record as the opening lines of a Markdown results file (one `key: value` per line)."""
    order = ["command", "commit", *(k for k in rec if k not in ("command", "commit", "time")), "time"]
    return "\n".join(f"- {k}: `{rec[k]}`" for k in order if k in rec)
