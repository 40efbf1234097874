"""Session fixtures shared by the sage_jax tests: the real SmolLM2 (loaded once), tiny random LMs."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from sage_jax.models import Decoder, LMConfig


def _rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="session")
def rel_err():
    """max|ours - ref| / max|ref|: the error relative to the reference's scale (every parity test uses it)."""
    return _rel_err


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """A private conversion cache for the session (never the user's ~/.cache)."""
    path = str(tmp_path_factory.mktemp("sage_jax_cache"))
    old = os.environ.get("SAGE_JAX_CACHE")
    os.environ["SAGE_JAX_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("SAGE_JAX_CACHE", None)
    else:
        os.environ["SAGE_JAX_CACHE"] = old


@pytest.fixture(scope="session")
def smollm2_path(cache_dir):
    from sage_jax.io import default_target

    return default_target()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(cfg, model, tokenizer, seconds) from the cold path: GGUF -> conversion cache -> our checkpoint."""
    import time

    from sage_jax.io import load_lm

    t0 = time.perf_counter()
    cfg, model, tok = load_lm(smollm2_path)
    return cfg, model, tok, time.perf_counter() - t0


def _tiny_lm(seed: int, scale: float = 6.0, **cfg) -> Decoder:
    """A tiny random decoder whose weights are scaled up so that its distributions are far from uniform
    (greedy paths then vary from token to token, which makes equality tests meaningful)."""
    model = Decoder(LMConfig.tiny(**cfg), rngs=nnx.Rngs(seed))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * scale if x.ndim > 1 else x, params))
    return model


@pytest.fixture(scope="session")
def tiny_lm():
    """Factory: tiny_lm(seed, scale=6.0, **LMConfig.tiny overrides) -> Decoder."""
    return _tiny_lm


# ------------------------------------------------------------------------------- tiny vision-language models


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory):
    """Factory: tiny_vlm(arch, seed, **kw) -> VisionLM (`sage_jax.bench.tiny_vlm`)."""
    from sage_jax.bench.tiny_vlm import tiny_vlm

    return lambda arch, seed, **kw: tiny_vlm(arch, seed, tmp_path_factory.mktemp(arch), **kw)
