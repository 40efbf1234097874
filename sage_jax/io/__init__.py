"""Weight I/O: GGUF and HF readers, the HF writer, our LM checkpoint, and `load_lm` over all of them.

No torch anywhere here: GGUF via `gguf` (numpy), safetensors via `safetensors.numpy`, tokenizers via `tokenizers`
and transformers' tokenizers backend.
"""

from sage_jax.io.gguf import read_gguf
from sage_jax.io.hf import read_hf, write_hf
from sage_jax.io.load import default_target, load_lm
from sage_jax.io.store import save_lm

__all__ = ["default_target", "load_lm", "read_gguf", "read_hf", "save_lm", "write_hf"]
