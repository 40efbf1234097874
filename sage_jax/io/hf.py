"""Hugging Face (transformers) Llama / Qwen2 checkpoints <-> our parameter tree, through one name-mapping table.

Reading needs only `safetensors.numpy` (no torch). The same table, run backwards, writes `config.json` +
`model.safetensors` that `transformers.AutoModelForCausalLM.from_pretrained` loads. The GGUF reader
(`sage_jax.io.gguf`) renames its tensors to HF names and then goes through this table too, so every route into
our layout shares one set of transforms.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from sage_jax.models.config import LMConfig

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Transform:
    """HF tensor (torch layout: Linear weights are [out, in]) <-> our tensor, given the head dim H."""

    to_ours: Callable[[np.ndarray, int], np.ndarray]
    to_hf: Callable[[np.ndarray, int], np.ndarray]


COPY = Transform(lambda w, h: w, lambda w, h: w)
T = Transform(lambda w, h: w.T, lambda w, h: w.T)  # [out, in] <-> [in, out]
# q/k/v projections: [N*H, D] <-> [D, N, H]
IN_HEADS = Transform(lambda w, h: w.T.reshape(w.shape[1], -1, h), lambda w, h: w.reshape(w.shape[0], -1).T)
# o projection: [D, N*H] <-> [N, H, D]
OUT_HEADS = Transform(lambda w, h: w.T.reshape(-1, h, w.shape[0]), lambda w, h: w.reshape(-1, w.shape[-1]).T)
# q/k/v biases: [N*H] <-> [N, H]
BIAS_HEADS = Transform(lambda w, h: w.reshape(-1, h), lambda w, h: w.reshape(-1))

_L = r"model\.layers\.(\d+)\."
#: The one mapping table: (regex on the canonical HF name, our path, transform). A regex with a group is a
#: per-layer tensor; the group is the layer index on our stacked leading axis.
TABLE: tuple[tuple[str, str, Transform], ...] = (
    (r"model\.embed_tokens\.weight", "embed", COPY),
    (r"model\.norm\.weight", "final_norm", COPY),
    (r"lm_head\.weight", "lm_head", T),
    (_L + r"input_layernorm\.weight", "blocks/attn_norm", COPY),
    (_L + r"post_attention_layernorm\.weight", "blocks/mlp_norm", COPY),
    (_L + r"self_attn\.q_proj\.weight", "blocks/wq", IN_HEADS),
    (_L + r"self_attn\.k_proj\.weight", "blocks/wk", IN_HEADS),
    (_L + r"self_attn\.v_proj\.weight", "blocks/wv", IN_HEADS),
    (_L + r"self_attn\.q_proj\.bias", "blocks/bq", BIAS_HEADS),
    (_L + r"self_attn\.k_proj\.bias", "blocks/bk", BIAS_HEADS),
    (_L + r"self_attn\.v_proj\.bias", "blocks/bv", BIAS_HEADS),
    (_L + r"self_attn\.o_proj\.weight", "blocks/wo", OUT_HEADS),
    (_L + r"mlp\.gate_proj\.weight", "blocks/w_gate", T),
    (_L + r"mlp\.up_proj\.weight", "blocks/w_up", T),
    (_L + r"mlp\.down_proj\.weight", "blocks/w_down", T),
)

# Hub files of VLMs and newer transformers name the text model `model.language_model.*` (or
# `language_model.model.*`); older buffers and the other towers are not part of an LM.
_PREFIXES = ((re.compile(r"^(model\.language_model\.|language_model\.model\.)"), "model."),
             (re.compile(r"^language_model\.lm_head\."), "lm_head."))
IGNORED = re.compile(r"(rotary_emb\.inv_freq$|^(model\.)?(visual|vision_tower|multi_modal_projector|image_newline))")


def canonical_name(name: str) -> str:
    for rx, repl in _PREFIXES:
        name = rx.sub(repl, name)
    return name


Entry = tuple[str, str, Transform]
#: our path -> the HF tensors that make it: [(name as stored, layer index or None, transform)]
Plan = dict[str, list[tuple[str, int | None, Transform]]]


def plan(table: Iterable[Entry], names: Iterable[str], *, canonical: Callable[[str], str] = canonical_name,
         ignored: re.Pattern | None = IGNORED, n_layers: Callable[[str], int], expected: set[str],
         what: str = "a Llama/Qwen2 LM") -> Plan:
    """Which stored tensors make each of our parameters, checked before any tensor is read: every name is known
    or ignored, every stacked parameter has exactly layers 0..n_layers(path)-1, and the parameters are `expected`.

    `table` holds (regex on the canonical HF name, our path, transform); a regex group is the layer index on our
    stacked leading axis. A streamed conversion reads one parameter's tensors at a time from this plan."""
    compiled = [(re.compile(rx), path, tr) for rx, path, tr in table]
    out: Plan = {}
    for stored in names:
        name = canonical(stored)
        if ignored is not None and ignored.search(name):
            continue
        for rx, path, tr in compiled:
            m = rx.fullmatch(name)
            if m:
                out.setdefault(path, []).append((stored, int(m.group(1)) if m.groups() else None, tr))
                break
        else:
            raise ValueError(f"unexpected tensor {name!r} for {what}")
    for path, items in out.items():
        layers = sorted(i for _, i, _ in items if i is not None)
        if layers and layers != list(range(n_layers(path))):
            raise ValueError(f"{path}: layers {layers} stored, expected 0..{n_layers(path) - 1}")
        items.sort(key=lambda it: -1 if it[1] is None else it[1])
    if set(out) != expected:
        raise ValueError(f"tensors do not fit the config: missing {sorted(expected - set(out))}, "
                         f"unexpected {sorted(set(out) - expected)}")
    return out


def assemble(items: list[tuple[str, int | None, Transform]], read: Callable[[str], np.ndarray], head_dim: int,
             dtype=np.float32) -> np.ndarray:
    """One of our parameters from its `plan` items: each tensor read and transformed, per-layer ones written
    straight into the stacked array (memory: the result and one layer's tensor)."""

    def one(name: str, tr: Transform) -> np.ndarray:
        return np.asarray(tr.to_ours(np.asarray(read(name), dtype), head_dim), dtype)

    if items[0][1] is None:
        return one(items[0][0], items[0][2])
    out = None
    for name, i, tr in items:
        w = one(name, tr)
        if out is None:
            out = np.empty((len(items), *w.shape), dtype)
        out[i] = w
        del w
    return out


def to_params(cfg: LMConfig, tensors: Iterable[tuple[str, np.ndarray]]) -> Params:
    """(HF name, array) pairs -> our nested params dict (float32 numpy), layers stacked on axis 0."""
    arrays = dict(tensors)
    names = [n for n in arrays if not (cfg.tie_embeddings and canonical_name(n) == "lm_head.weight")]
    p = plan(TABLE, names, n_layers=lambda path: cfg.n_layers, expected=expected_paths(cfg))
    return unflatten({path: assemble(items, arrays.__getitem__, cfg.head_dim) for path, items in p.items()})


def n_layers(cfg: LMConfig, path: str) -> int:
    return cfg.n_layers


def expected_paths(cfg: LMConfig) -> set[str]:
    """Our LM parameter paths for a config (`TABLE`'s, less the untied head and biases the config lacks)."""
    expected = {p for _, p, _ in TABLE if p != "lm_head" or not cfg.tie_embeddings}
    if not cfg.qkv_bias:
        expected -= {"blocks/bq", "blocks/bk", "blocks/bv"}
    return expected


def from_params(cfg: LMConfig, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Our params -> {HF name: float32 array}, the inverse of `to_params` (canonical `model.layers.*` names)."""
    flat = flatten(params)
    out: dict[str, np.ndarray] = {}
    for rx, path, tr in TABLE:
        if path not in flat:
            continue
        w = np.asarray(flat[path], np.float32)
        name = rx.replace("\\.", ".")
        if name.startswith(_L.replace("\\.", ".")):
            for i in range(w.shape[0]):
                out[name.replace("(\\d+)", str(i))] = np.ascontiguousarray(tr.to_hf(w[i], cfg.head_dim))
        else:
            out[name] = np.ascontiguousarray(tr.to_hf(w, cfg.head_dim))
    return out


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        p = f"{prefix}/{k}" if prefix else k
        out.update(flatten(v, p) if isinstance(v, Mapping) else {p: v})
    return out


def unflatten(flat: Mapping[str, Any]) -> Params:
    out: Params = {}
    for path, v in flat.items():
        *parents, leaf = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


# ------------------------------------------------------------------------------------------------- directories


def is_hf_dir(path: str | os.PathLike) -> bool:
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, "config.json")) and (
        os.path.isfile(os.path.join(path, "model.safetensors"))
        or os.path.isfile(os.path.join(path, "model.safetensors.index.json")))


def tensor_index(path: str | os.PathLike) -> dict[str, str]:
    """{tensor name: safetensors file} of an HF directory, from the shard index or the file's header (no tensor
    is read)."""
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {name: os.path.join(path, file) for name, file in json.load(f)["weight_map"].items()}
    file = os.path.join(path, "model.safetensors")
    return {name: file for name in _header(file)[1] if name != "__metadata__"}


# safetensors dtype names -> numpy dtypes; bfloat16 (the hub's usual dtype) through ml_dtypes, which numpy lacks and
# `safetensors.numpy` refuses.
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _header(file: str) -> tuple[int, dict]:
    """(offset of the data, the JSON header) of a safetensors file."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        try:
            return 8 + n, json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError, MemoryError, OverflowError):
            raise ValueError(f"{file} is not a safetensors file (unreadable header)") from None


def tensor_reader(index: Mapping[str, str]) -> Callable[[str], np.ndarray]:
    """name -> array (read-only, memory-mapped), reading only that tensor's bytes from its shard. Any stored dtype,
    bfloat16 included."""
    headers: dict[str, tuple[int, dict]] = {}

    def read(name: str) -> np.ndarray:
        file = index[name]
        if file not in headers:
            headers[file] = _header(file)
        start, header = headers[file]
        meta = header[name]
        if meta["dtype"] not in _DTYPES:
            raise ValueError(f"{file}: tensor {name} has dtype {meta['dtype']}, which this reader does not take")
        lo, hi = meta["data_offsets"]
        dtype = np.dtype(_DTYPES[meta["dtype"]])
        if hi - lo != dtype.itemsize * int(np.prod(meta["shape"])) or start + hi > os.path.getsize(file):
            raise ValueError(f"{file} is truncated or corrupt at tensor {name}")
        return np.memmap(file, dtype=dtype, mode="r", offset=start + lo, shape=tuple(meta["shape"]))

    return read


def read_config(path: str | os.PathLike) -> LMConfig:
    with open(os.path.join(os.fspath(path), "config.json")) as f:
        hf = json.load(f)
    return LMConfig.from_hf(hf.get("text_config") or hf)  # a VLM keeps its LM under text_config


def read_tokenizer(path: str | os.PathLike):
    """The directory's tokenizer (`tokenizer.json` + `tokenizer_config.json`), or None if it has none."""
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    # Not AutoTokenizer: it imports torch when torch is installed; this class never does.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path)


def read_hf(path: str | os.PathLike) -> tuple[LMConfig, Params, Any]:
    """An HF directory (config.json + model.safetensors or a sharded index) -> (config, float32 params, tokenizer)."""
    path = os.fspath(path)
    if not is_hf_dir(path):
        raise ValueError(f"{path} is not an HF model directory (expected config.json and model.safetensors)")
    cfg = read_config(path)
    index = tensor_index(path)
    read = tensor_reader(index)
    params = to_params(cfg, ((name, read(name)) for name in index))
    return cfg, params, read_tokenizer(path)


def hf_config(cfg: LMConfig) -> dict[str, Any]:
    """Our config -> a transformers `config.json` dict (Qwen2 when the config has q/k/v biases, else Llama)."""
    r = cfg.rope
    rope: dict[str, Any] = {"rope_type": r.type, "rope_theta": r.theta}
    if r.type != "default":
        rope["factor"] = r.factor
    if r.type == "llama3":
        rope.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                    original_max_position_embeddings=r.original_max_position)
    if r.type == "yarn":
        rope.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow,
                    original_max_position_embeddings=r.original_max_position)
        if r.attention_factor is not None:
            rope["attention_factor"] = r.attention_factor
    qwen = cfg.qkv_bias
    eos = list(cfg.eos_token_ids)
    out = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position, "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope, "rope_theta": r.theta, "tie_word_embeddings": cfg.tie_embeddings,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None), "pad_token_id": cfg.pad_token_id,
        "torch_dtype": "float32", "dtype": "float32",
    }
    if not qwen:
        out.update(attention_bias=False, mlp_bias=False)
    return out


def write_hf(path: str | os.PathLike, cfg: LMConfig, params: Mapping[str, Any], tokenizer=None) -> str:
    """Writes `config.json` + `model.safetensors` (float32, whatever the params' dtype) (+ the tokenizer's files)
    loadable by transformers, e.g. for its assisted generation with our draft. Returns the absolute path."""
    from safetensors.numpy import save_file

    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(cfg.replace(param_dtype="float32", dtype="float32")), f, indent=1)
    save_file(from_params(cfg, params), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
