"""Session fixtures for the weight-I/O tests: the real SmolLM2 GGUF, loaded once by us and once by transformers.

torch and transformers' models are the parity reference here only; `sage_jax` itself never imports torch.
"""

import os

import numpy as np
import pytest


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


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path):
    """transformers' LlamaForCausalLM and tokenizer from the same GGUF (fp32, eager), loaded once (~13 s)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # One thread: on the 2-core CI box XLA's own threads are busy too, and torch's OpenMP workers then spin
    # against them (64 greedy tokens: 25 s with 2 threads vs 6 s with 1, measured under load).
    torch.set_num_threads(1)
    d, f = os.path.split(smollm2_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return model, tok
