"""The Colab quickstart notebooks (`notebooks/*.ipynb`) run end to end at CI size in a Jupyter kernel of this
interpreter, every cell without an error, and are stored without outputs.

CI size: the kernel gets `SAGE_JAX_NOTEBOOK_SMALL=1` (each notebook's "Sizes" cell reads it) and sees the machine's
one CPU device, as a CPU Colab runtime would (not the 8 host devices the rest of the suite forces).
"""

import json
import os
import pathlib
import sys
import time

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "sage-jax-notebook-test"


def test_the_quickstarts_are_there():
    assert {"sage_quickstart.ipynb", "pgla_quickstart.ipynb"} <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name} cell {i} has outputs"
        assert "attachments" not in cell, f"{path.name} cell {i} has attachments"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A kernelspec for this interpreter (with the notebooks' CI environment) on a private JUPYTER_PATH."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    xla = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f)
    env = {
        "SAGE_JAX_NOTEBOOK_SMALL": "1",
        "XLA_FLAGS": xla,
        "SAGE_JAX_CACHE": str(root / "sage_jax_cache"),  # a private conversion cache, never the user's ~/.cache
        # The suite's persistent compilation cache (tests/conftest.py): a second run skips the XLA compiles.
        "JAX_COMPILATION_CACHE_DIR": str(ROOT / ".cache" / "jax"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "sage-jax (tests)", "language": "python", "env": env}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(root))
        mp.setenv("JUPYTER_RUNTIME_DIR", str(root / "runtime"))
        yield KERNEL


# End to end in a Jupyter kernel (40 s to minutes each on 2 cores): under -m integration. The default suite checks that
# they are there and stored clean, and the parts they call in their own tests.
@pytest.mark.integration
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_end_to_end(path, kernel):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name=kernel, timeout=600, startup_timeout=120,
                            resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    client.execute()  # CellExecutionError (the cell and its traceback) on the first failing cell
    print(f"{path.name}: {time.perf_counter() - t0:.0f} s")
    if os.environ.get("SAGE_JAX_NOTEBOOK_OUT"):  # keep the executed notebook, outputs and pictures, to look at
        nbformat.write(nb, os.path.join(os.environ["SAGE_JAX_NOTEBOOK_OUT"], path.name))
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    pictures = sum("image/png" in o.get("data", {}) for o in outputs)
    assert pictures >= 2, f"{path.name} drew {pictures} pictures"
