"""The real SmolLM2-135M-Instruct GGUF: our tokenizer, logits and greedy tokens vs transformers on the same file."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sage_jax.io import load_lm
from sage_jax.models.config import LMConfig

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List the first 12 prime numbers: 2, 3, 5, 7, ...",
]
TEXTS = PROMPTS + [
    "", " leading space", "digits 1234567890 and 3.14159", "tabs\tand\nnewlines\r\n  double  spaces",
    "Unicode: café, naïve, 日本語, emoji 🤖🚀", "<|im_start|>user\nhi<|im_end|>", "x<|endoftext|>y",
    "def f(x):\n    return x**2  # comment", "MiXeD CaSe and punctuation!!! ??? ...",
]


def _chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   tokenize=False)


def test_config_matches_preset(smollm2):
    cfg = smollm2[0]
    assert cfg.replace(norm_eps=1e-5) == LMConfig.smollm2_135m()
    assert abs(cfg.norm_eps - 1e-5) < 1e-12


def test_tokenizer_matches_transformers(smollm2, smollm2_reference):
    ours, ref = smollm2[2], smollm2_reference[1]
    for text in TEXTS + [_chat(ref, p) for p in PROMPTS]:
        assert ours.encode(text) == ref.encode(text), text
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids)
    msgs = [{"role": "user", "content": "Hi"}]
    assert _chat(ours, "Hi") == _chat(ref, "Hi")
    assert ours.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"] == \
        ref.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
    assert ours.eos_token == ref.eos_token == "<|im_end|>"


def test_logits_match_transformers(smollm2, smollm2_reference, rel_err):
    import torch

    _, model, tok, _ = smollm2
    ref_model, _ = smollm2_reference
    ids = [tok.encode(_chat(tok, p)) for p in PROMPTS]
    t = max(map(len, ids))
    # Right-padded into one batch: causal attention keeps padding after a prompt from touching it.
    batch = np.array([x + [0] * (t - len(x)) for x in ids], np.int32)
    logits = np.asarray(nnx.jit(lambda m, x: m(x)[0])(model, jnp.asarray(batch)))
    errs = []
    for i, x in enumerate(ids):
        with torch.no_grad():
            ref = ref_model(torch.tensor([x])).logits[0].numpy()
        errs.append(rel_err(logits[i, : len(x)], ref))
        assert np.array_equal(logits[i, : len(x)].argmax(-1), ref.argmax(-1))
    print(f"SmolLM2 logits rel err per prompt: {[f'{e:.2e}' for e in errs]}")
    assert max(errs) <= 1e-4


def _greedy(model, prompt: list[int], n_new: int, capacity: int) -> list[int]:
    """Prefill, then one token per step through the KV cache (mask: slots 0..pos visible; written at pos)."""
    graphdef, state = nnx.split(model)
    cache = model.init_cache(1, capacity)
    slots = jnp.arange(capacity)

    @jax.jit
    def prefill(state, tokens, cache):
        m = nnx.merge(graphdef, state)
        p = tokens.shape[1]
        pos = jnp.arange(p)[None]
        logits, _, cache = m(tokens, pos, (slots[None, :] <= pos[0][:, None])[None], cache, jnp.zeros((1,), jnp.int32))
        return jnp.argmax(logits[0, -1]), cache

    @jax.jit
    def step(state, token, pos, cache):
        m = nnx.merge(graphdef, state)
        logits, _, cache = m(token[None, None], pos[None, None], (slots <= pos)[None, None], cache, pos[None])
        return jnp.argmax(logits[0, -1]), cache

    tok, cache = prefill(state, jnp.asarray([prompt], jnp.int32), cache)
    out = [int(tok)]
    for pos in range(len(prompt), len(prompt) + n_new - 1):
        tok, cache = step(state, tok, jnp.int32(pos), cache)
        out.append(int(tok))
    return out


@pytest.mark.integration
def test_greedy_64_tokens_match_transformers(smollm2, smollm2_reference):
    import torch

    _, model, tok, _ = smollm2
    ref_model, _ = smollm2_reference
    prompt = tok.encode(_chat(tok, "Write a short story about a robot who learns to paint."))
    with torch.no_grad():
        ref = ref_model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    assert len(ref) == 64, "the prompt should not end within 64 tokens"
    ours = _greedy(model, prompt, 64, capacity=len(prompt) + 64)
    assert ours == ref, (tok.decode(ours), tok.decode(ref))


def test_cached_load_skips_the_gguf_and_is_identical(smollm2, smollm2_path, cache_dir, monkeypatch):
    """The second load restores the converted checkpoint without reading the GGUF again (checked by making the
    GGUF reader fail; a timing comparison flaked on a loaded 2-core machine) and gives the same model."""
    from sage_jax.io import loader

    cfg, model, _, cold_s = smollm2

    def no_gguf(spec):
        raise AssertionError(f"read {spec} again instead of the conversion cache")

    monkeypatch.setattr(loader, "read", no_gguf)
    t0 = time.perf_counter()
    cfg2, model2, tok2 = load_lm(smollm2_path)
    warm_s = time.perf_counter() - t0
    print(f"SmolLM2 load: cold (GGUF + conversion) {cold_s:.1f} s, warm (cached checkpoint) {warm_s:.1f} s")
    assert cfg2 == cfg and tok2 is not None
    a, b = nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(model2))
    assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), a, b))


def test_bfloat16_logits_follow_float32(smollm2, smollm2_path, rel_err):
    """`dtype="bfloat16"`: weights, activations and the KV cache in bf16; RMSNorm, RoPE, attention scores, softmax
    and the LM head's logits in float32. Logits within 5% of the float32 model's scale (measured: 2.8%), and
    the same next token at >= 90% of the prompts' positions."""
    _, model, tok, _ = smollm2
    _, m16, _ = load_lm(smollm2_path, dtype="bfloat16")
    assert m16.embed[...].dtype == jnp.bfloat16
    fwd = nnx.jit(lambda m, x: m(x)[0])
    errs, agree, total = [], 0, 0
    for p in PROMPTS:
        x = jnp.asarray([tok.encode(_chat(tok, p))])
        l32, l16 = np.asarray(fwd(model, x))[0], np.asarray(fwd(m16, x), np.float32)[0]
        errs.append(rel_err(l16, l32))
        agree += int(np.sum(l16.argmax(-1) == l32.argmax(-1)))
        total += l32.shape[0]
    print(f"SmolLM2 bf16 vs float32 logits: rel err {max(errs):.3f}, top-1 agreement {agree}/{total}")
    assert max(errs) <= 0.05 and agree >= 0.9 * total


@pytest.mark.slow
def test_bfloat16_load_keeps_the_greedy_answer(smollm2_path):
    cfg, model, tok = load_lm(smollm2_path, dtype="bfloat16")
    assert model.embed[...].dtype == jnp.bfloat16
    prompt = tok.encode(_chat(tok, "What is the capital of France?"))
    assert "Paris" in tok.decode(_greedy(model, prompt, 8, capacity=len(prompt) + 8))
