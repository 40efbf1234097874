"""Weight I/O: GGUF and HF readers, the HF writer, our checkpoints, and `load` / `load_lm` over all of them.

No torch anywhere here: GGUF via `gguf` (numpy), safetensors via `safetensors.numpy`, tokenizers via `tokenizers`
and transformers' tokenizers backend.
"""

from sage_jax.io.gguf import read_gguf
from sage_jax.io.hf import read_hf, write_hf
from sage_jax.io.lm_checkpoint import load_head, save_head, save_lm
from sage_jax.io.loader import cache_dir, default_draft, default_target, default_vlm, load, load_lm

__all__ = ["cache_dir", "default_draft", "default_target", "default_vlm", "load", "load_head", "load_lm",
           "read_gguf", "read_hf", "save_head", "save_lm", "write_hf"]
