"""Offline self-distillation data: prompts from local corpora, the target's own greedy answers, target features.

Corpora (data.md §2): the Python standard library sources (`sysconfig.get_paths()['stdlib']`) and the Python
docs' reST sources (Debian `python3.11-doc`, /usr/share/doc/python3.11/html/_sources). Each corpus FILE belongs to
one split by a stable hash of its relative path (1 in `HELDOUT_MOD` files is held out), so held-out prompts never
share a source file with training prompts; the hand-written held-out prompts (`sage_jax/prompts.py`) are in neither.

A dataset is a set of equally long numpy arrays, one row per sequence (prompt + answer, right-padded)::

    tokens [rows, T] int32   lengths [rows] int32   answer_start [rows] int32   kind [rows] int32 (index into ALL_KINDS)
    features [rows, T, D] float32 (optional): the target's last hidden state before its final norm

stored as one `.npz` (tokens) + one `.npy` (features, memory-mapped), and served by a `grain.MapDataset`
(random access: the batch of step s is `ds[s]`, so the data position of a resumed run is just its step).
"""

from __future__ import annotations

import ast
import glob
import hashlib
import os
import random
import sysconfig
import textwrap
from dataclasses import dataclass

import grain
import numpy as np

from configs import cli

DOCS_DIR = "/usr/share/doc/python3.11/html/_sources"
HELDOUT_MOD = 10
KINDS = ("code", "explanation", "rewriting", "lists")  # of the corpus prompts
# Also the extended WordNet prompts' (`wordnet.build_prompts`) and the target's own (`self_prompts.py`, "chat").
ALL_KINDS = KINDS + ("summary", "advice", "math", "chat")

_TEMPLATES: dict[str, tuple[str, ...]] = {
    "code": (
        "Explain this Python code:\n```python\n{code}\n```",
        "What does the following Python function do?\n```python\n{code}\n```",
        "Write a short docstring for this function:\n```python\n{code}\n```",
        "Write a Python function that does the following: {doc}",
        "Rewrite this Python code to be easier to read:\n```python\n{code}\n```",
    ),
    "explanation": (
        "Summarize: {text}",
        "Explain the following passage from the Python documentation in simple terms:\n{text}",
        "What is the main idea of this text?\n{text}",
    ),
    "rewriting": (
        "Rewrite the following paragraph in plain English:\n{text}",
        "Paraphrase this text:\n{text}",
        "Make this paragraph shorter and clearer:\n{text}",
    ),
    "lists": (
        "List the key points of this text:\n{text}",
        "Make a bulleted list of the concepts mentioned here:\n{text}",
        "List three questions a student might ask about this:\n{text}",
        "List the steps performed by this code:\n```python\n{code}\n```",
    ),
}


def _split_of(relpath: str) -> str:
    h = int(hashlib.sha1(relpath.encode()).hexdigest()[:8], 16)
    return "heldout" if h % HELDOUT_MOD == 0 else "train"


def corpus_files(split: str) -> tuple[list[str], list[str]]:
    """(python sources, reST docs) of `split` ("train" or "heldout"), sorted."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}")
    stdlib = sysconfig.get_paths()["stdlib"]
    py = [f for f in sorted(glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True))
          if not any(s in f for s in ("/test", "idlelib", "site-packages", "lib2to3/tests"))]
    rst = sorted(glob.glob(os.path.join(DOCS_DIR, "**", "*.rst.txt"), recursive=True))
    py = [f for f in py if _split_of("py/" + os.path.relpath(f, stdlib)) == split]
    rst = [f for f in rst if _split_of("rst/" + os.path.relpath(f, DOCS_DIR)) == split]
    return py, rst


def code_snippets(path: str, min_chars: int = 120, max_chars: int = 700) -> list[tuple[str, str]]:
    """(source, first docstring line) of functions in a Python file that are short enough."""
    try:
        src = open(path, encoding="utf-8").read()
        tree = ast.parse(src)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = src.split("\n")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            seg = "\n".join(lines[first - 1: node.end_lineno])
            if min_chars <= len(seg) <= max_chars:
                doc = (ast.get_docstring(node) or "").strip().split("\n")[0]
                out.append((textwrap.dedent(seg), doc))
    return out


def paragraphs(path: str, min_chars: int = 200, max_chars: int = 700) -> list[str]:
    """Prose paragraphs of a reST file (directives, headings, tables, code blocks dropped)."""
    try:
        text = open(path, encoding="utf-8").read()
    except UnicodeDecodeError:
        return []
    out = []
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if not lines or any(ln.startswith((" ", "..", "=", "-", "*", "+", "|", ">>>", ":")) for ln in lines):
            continue
        para = " ".join(ln.strip() for ln in lines)
        if min_chars <= len(para) <= max_chars and para[-1] in ".:)":
            out.append(para)
    return out


@dataclass(frozen=True)
class Prompt:
    kind: str
    text: str


def build_prompts(n: int, split: str, seed: int = 0) -> list[Prompt]:
    """`n` chat prompts, kinds in round-robin, each from a random snippet of `split`'s corpus files."""
    rng = random.Random(f"{split}-{seed}")
    py, rst = corpus_files(split)
    rng.shuffle(py)
    rng.shuffle(rst)
    want = max(n, 64)
    snippets: list[tuple[str, str]] = []
    for f in py:  # read files only until there is enough text (several files per prompt kind for variety)
        snippets += code_snippets(f)[:8]
        if len(snippets) >= want:
            break
    paras: list[str] = []
    for f in rst:
        paras += paragraphs(f)[:8]
        if len(paras) >= want:
            break
    if not snippets or not paras:
        raise RuntimeError(f"no corpus text for split {split!r} (is python3.11-doc installed? {DOCS_DIR})")
    rng.shuffle(snippets)
    rng.shuffle(paras)
    out: list[Prompt] = []
    i = 0
    while len(out) < n:
        kind = KINDS[i % len(KINDS)]
        template = rng.choice(_TEMPLATES[kind])
        code, doc = snippets[i % len(snippets)]
        if "{doc}" in template and not doc:
            template = _TEMPLATES["code"][0]
        text = template.format(code=code.strip(), doc=doc, text=paras[i % len(paras)])
        out.append(Prompt(kind, text))
        i += 1
    return out


def encode(tokenizer, text: str, vocab_size: int) -> list[int]:
    """Chat-templated prompt ids; without a tokenizer (tiny test targets) bytes folded into [2, V)."""
    if tokenizer is None:
        return [2 + b % (vocab_size - 2) for b in text.encode()]
    from sage_jax.chat import prompt_ids

    return prompt_ids(tokenizer, text)


def save(path_prefix: str, arrays: dict[str, np.ndarray]) -> None:
    """`<prefix>.npz` (integer arrays) + `<prefix>.features.npy` (when present). Atomic per file."""
    ints = {k: v for k, v in arrays.items() if k != "features"}
    with cli.written(path_prefix + ".npz", "wb") as f:
        np.savez(f, **ints)
    if "features" in arrays:
        with cli.written(path_prefix + ".features.npy", "wb") as f:
            np.save(f, arrays["features"])


def load(path_prefix: str, *, features: bool = True) -> dict[str, np.ndarray]:
    with np.load(path_prefix + ".npz") as z:
        out = {k: z[k] for k in z.files}
    if features and os.path.exists(path_prefix + ".features.npy"):
        out["features"] = np.load(path_prefix + ".features.npy", mmap_mode="r")
    return out


def exists(path_prefix: str, *, features: bool = True) -> bool:
    return os.path.exists(path_prefix + ".npz") and (not features or os.path.exists(path_prefix + ".features.npy"))


class _Rows:
    """Random-access source over the dataset arrays (one dict of rows per index)."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays
        self.n = len(arrays["tokens"])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return {k: np.asarray(v[i]) for k, v in self.arrays.items()}


def source(data) -> _Rows:
    """Random access over rows: in-memory arrays (a dict) are wrapped; a source (`features.ShardSource`) stays."""
    return _Rows(data) if isinstance(data, dict) else data


def batches(arrays, batch_size: int, *, seed: int, shuffle: bool = True) -> grain.MapDataset:
    """Infinite, reshuffled-per-epoch batches of in-memory arrays or a row source; `ds[step]` is the batch of
    `step` (deterministic)."""
    ds = grain.MapDataset.source(source(arrays))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds.repeat().batch(batch_size, drop_remainder=True)


def eval_batches(arrays, batch_size: int) -> grain.MapDataset:
    """The held-out rows once, in order, in full batches (the last partial batch is dropped)."""
    return grain.MapDataset.source(source(arrays)).batch(batch_size, drop_remainder=True)
