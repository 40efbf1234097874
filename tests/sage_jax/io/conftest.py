"""Session fixtures for the weight-I/O tests: the real SmolLM2 GGUF, loaded once by us and once by transformers.

torch and transformers' models are the parity reference here only; `sage_jax` itself never imports torch.
"""

import os

import pytest


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
