"""SAGE: entropy-guided adaptive speculative decoding in JAX / Flax NNX.

The public API (imported on first use, so `python -m sage_jax.<cli>` starts fast)::

    import sage_jax

    engine = sage_jax.load_engine()                  # the shipped SmolLM2-135M-Instruct and its EAGLE-style head
    gen = engine.generate(["What is the capital of France?"], policy=sage_jax.TreePolicy.sage(), max_new_tokens=64)
    print(gen.text[0], gen.stats.summary())

    model = sage_jax.load(path)                      # GGUF file, HF directory or our checkpoint -> CausalLM
    logits = model(input_ids=ids, attention_mask=mask)   # [B, T, V] float32, as transformers' model(**inputs)

    vlm = sage_jax.load(qwen25_vl_or_llava_ov_path)  # -> VisionLM
    logits = vlm(**vlm.inputs("What is this?", images=["cat.png"]))   # the processor's keyword arrays

    engine = sage_jax.load_engine(vlm_path, draft=smaller_vlm_path)   # SAGE on a VLM; the draft sees 20% of the
    gen = engine.generate(["What is this?"], images=[["cat.png"]])    # image tokens and 10% of a video's

Names: `load`, `load_engine`, `Engine`, `Generation`, `Stats`, `CausalLM`, `VisionLM`, `TreePolicy`, `DraftSpec`,
`SamplingConfig`, `default_target`, `default_draft`, `default_vlm`; subpackages `io`, `models`, `decoding`,
`training`, `bench`.

Dimension names, used in einsum strings, `jaxtyping` annotations and variable suffixes across the package:

  Models
    B batch                 T query tokens (this forward)      S key/value (cache) slots
    D model width           N query heads                      K key/value heads
    G query heads per KV head (N = K*G)                        H head dim
    F MLP width             V vocabulary                       L layers
    E fused projection outputs ((N+2K)*H for q|k|v, 2F for gate|up)
    M tokens of a feature-major activation (B*T)
    U new slots a step writes past the committed prefix (the new keys/values of a cache-reading forward)
    I an EAGLE head's input width (2D: feature and embedding)   Vd a reduced draft vocabulary
    P image patches / visual tokens           Q probe queries (prompt slots whose attention ranks visual tokens)
    Td the draft's prompt slots after visual-token pruning     Dd a draft VLM's model width
  Decoding
    W verified tree slots (the root and n_max nodes)     C candidate-pool slots (the root included)
    R frontier: the nodes one draft level expands        J children considered per expanded node (top-k)
    A accepted-path slots (the root and up to d_cap accepted tokens)
    X features a drafter reads and predicts (D for an EAGLE head, 0 for an LM draft)
    Z tapped target features: the inputs of the layers an EAGLE-3-style head fuses, concatenated (taps·D)
  Bookkeeping buffers are spelled out: out (generated tokens), steps (per-step traces), hist (the τ history),
  ranks (node priority ranks), ctx (the prompt and output a retrieval lookup searches), chain (a retrieval
  chain's tokens).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_API = {
    "load": "sage_jax.io.loader",
    "default_target": "sage_jax.io.loader",
    "default_draft": "sage_jax.io.loader",
    "default_vlm": "sage_jax.io.loader",
    "load_engine": "sage_jax.engine",
    "Engine": "sage_jax.engine",
    "Generation": "sage_jax.engine",
    "Stats": "sage_jax.engine",
    "CausalLM": "sage_jax.models.causal_lm",
    "VisionLM": "sage_jax.io.vision_lm",
    "TreePolicy": "sage_jax.decoding.policies",
    "DraftSpec": "sage_jax.decoding.drafters",
    "SamplingConfig": "sage_jax.decoding.sampling",
}
_SUBPACKAGES = ("io", "models", "decoding", "training", "bench", "chat", "prompts", "engine")

__all__ = ["CausalLM", "DraftSpec", "Engine", "Generation", "SamplingConfig", "Stats", "TreePolicy", "VisionLM",
           "default_draft", "default_target", "default_vlm", "load", "load_engine"]

if TYPE_CHECKING:
    from sage_jax.decoding.drafters import DraftSpec
    from sage_jax.decoding.policies import TreePolicy
    from sage_jax.decoding.sampling import SamplingConfig
    from sage_jax.engine import Engine, Generation, Stats, load_engine
    from sage_jax.io.loader import default_draft, default_target, default_vlm, load
    from sage_jax.io.vision_lm import VisionLM
    from sage_jax.models.causal_lm import CausalLM


def __getattr__(name: str):
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API, *_SUBPACKAGES})
