"""Fixtures of the benchmark tests: the scripts under `benchmarks/sage/`, which are files, not package modules."""

import importlib.util
import pathlib

import pytest

_SCRIPTS = pathlib.Path(__file__).parents[3] / "benchmarks" / "sage"


@pytest.fixture(scope="session")
def benchmark_script():
    """Factory: benchmark_script("step_profile") -> that script loaded as a module."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, _SCRIPTS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load
