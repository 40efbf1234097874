"""The target's features by batched teacher forcing, cached in array_record shards and read through grain.

Teacher forcing costs one parallel target forward per token (no decode loop), so any token sequence is training
data for a draft: the target's own greedy answers (`rollout.py`, tokens only) and offline corpus text placed in
the assistant turn of a chat (`corpus_rows`). The labels are the target's distributions at every position, so the
text need not be the target's; where it is not, `objectives.chain_valid` keeps the deeper training-time-test levels to
the chains a tree would have accepted, using the stored argmax `top`.

One record per row (a sequence right-padded to the block's length T), written by `write_shards` as an uncompressed
`.npz` of::

    tokens [T] int32   lengths, answer_start, kind: [] int32
    features [T, Z] float16   the inputs of the layers `taps` names, concatenated (Z = len(taps)·D); with no taps,
                              the last hidden state [T, D]
    hidden [T, D] float16     the target's last hidden state before its final norm (its logits' input)
    top [T] int32             the target's full-vocabulary argmax at each position (its greedy next token)

Shards are written atomically one by one (an interrupted run resumes at the first missing shard) and served by
`ShardSource`, a random-access grain source, so `data.batches` reshuffles them per epoch like in-memory rows.
"""

from __future__ import annotations

import functools
import io
import os
import random
import time
from collections.abc import Callable, Sequence

import grain
import jax
import jax.numpy as jnp
import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter
from jaxtyping import Array, Float, Int

from configs import cli
from sage_jax.models.serving_lm import LM
from sage_jax.training import data as ddata
from sage_jax.training import online

SCALARS = ("lengths", "answer_start", "kind")


def encode_row(row: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **row)
    return buf.getvalue()


def decode_row(record: bytes, keys: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """A record's arrays (only `keys`, when given: an .npz inflates members on access, so the features of a
    row are not decoded to read its tokens)."""
    with np.load(io.BytesIO(record)) as z:
        return {k: z[k] for k in (z.files if keys is None else keys)}


@functools.partial(jax.jit, static_argnames=("taps",))
def teacher_forced(model: LM, tokens: Int[Array, "B T"], taps: tuple[int, ...]
                   ) -> tuple[Float[Array, "B T Z"], Float[Array, "B T D"], Int[Array, "B T"]]:
    """(tapped layer inputs or, without taps, the last hidden state; the last hidden state; the argmax) of
    right-padded rows, each attending causally from slot 0 (padding after a row's end changes nothing before)."""
    feats, hidden, top = online.target_features(model, tokens, taps)
    return feats.astype(jnp.float16), hidden.astype(jnp.float16), top


def shard_path(directory: str, name: str, k: int) -> str:
    return os.path.join(directory, f"{name}-{k:05d}.array_record")


def write_shards(model: LM, rows: dict[str, np.ndarray], directory: str, name: str, *, taps: tuple[int, ...] = (),
                 batch: int = 8, shard_rows: int = 256, log: Callable[[str], None] = print) -> list[str]:
    """Teacher-forces `rows` (the `data.py` layout without features: tokens [N, T], lengths, answer_start, kind)
    through the target in batches of `batch` and writes the records in shards of `shard_rows` rows; shards that
    exist are kept (resume). Each batch runs at the 32-multiple holding its longest row (rows sorted by length
    waste little); past the bucket the stored features are zero (past a row's length they are never read).
    Returns the shard paths in order."""
    n, t = rows["tokens"].shape
    shard_rows = max(batch, shard_rows // batch * batch)
    z = model.cfg.d_model * max(1, len(taps))  # the features' width
    os.makedirs(directory, exist_ok=True)
    paths, t0, done_tokens = [], time.perf_counter(), 0
    for k, s in enumerate(range(0, n, shard_rows)):
        path = shard_path(directory, name, k)
        paths.append(path)
        if os.path.exists(path) and _holds(path, rows, np.arange(s, min(s + shard_rows, n)), z):
            continue
        with cli.replacing(path) as staged:
            writer = ArrayRecordWriter(staged, "group_size:1")
            for b0 in range(s, min(s + shard_rows, n), batch):
                idx = np.arange(b0, min(b0 + batch, n))
                # the batch's rows cut to the 32-multiple holding the longest (a compiled shape per bucket, <= T/32)
                w = min(t, -(-int(np.max(rows["lengths"][idx])) // 32) * 32)
                toks = rows["tokens"][np.concatenate([idx, np.full(batch - len(idx), idx[-1])]), :w]
                feats, hidden, top = jax.device_get(teacher_forced(model, jnp.asarray(toks), taps))
                grow = lambda a, w=w: np.pad(a, [(0, t - w)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
                for j, r in enumerate(idx):
                    rec = {"tokens": rows["tokens"][r], "features": grow(feats[j]), "hidden": grow(hidden[j]),
                           "top": grow(top[j])}
                    rec.update({key: np.asarray(rows[key][r], np.int32) for key in SCALARS})
                    writer.write(encode_row(rec))
                done_tokens += int(np.sum(rows["lengths"][idx]))
            writer.close()
        log(f"[features] {name}: {min(s + shard_rows, n)}/{n} rows, {done_tokens / (time.perf_counter() - t0):.0f} "
            f"tokens/s")
    return paths


def _holds(path: str, rows: dict[str, np.ndarray], idx: np.ndarray, z: int) -> bool:
    """Whether the shard at `path` holds exactly rows `idx` of `rows` with features `z` wide. A resumed run keeps
    only such shards: a work directory reused with more rows (a grown answers file leaves its last shard short),
    other rows or other taps gets the shards that differ rewritten, never silently mixed in."""
    src = grain.sources.ArrayRecordDataSource([path])
    if len(src) != len(idx):
        return False
    for j, r in enumerate(idx):
        rec = decode_row(src[j], ("tokens", *SCALARS))
        if not (np.array_equal(rec["tokens"], rows["tokens"][r])
                and all(int(rec[k]) == int(rows[k][r]) for k in SCALARS)):
            return False
    return decode_row(src[0], ("features",))["features"].shape[-1] == z


class ShardSource:
    """Random access over the records of array_record shards (grain's `ArrayRecordDataSource`), decoded."""

    def __init__(self, paths: Sequence[str]):
        if not paths:
            raise ValueError("no feature shards")
        self.paths = list(paths)
        self._src = grain.sources.ArrayRecordDataSource(self.paths)

    def __len__(self) -> int:
        return len(self._src)

    def __getitem__(self, i):
        return decode_row(self._src[i])

    def arrays(self, keys: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Every row stacked in memory (for small held-out sets), or only the arrays `keys` names (the tokens of
        a large set)."""
        rows = [decode_row(self._src[i], keys) for i in range(len(self))]
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def corpus_rows(tokenizer, split: str, n: int, length: int, *, seed: int = 0, pad_id: int = 0,
                eos_id: int | None = None) -> dict[str, np.ndarray]:
    """`n` chat rows of offline corpus text for teacher forcing (`data.py`'s corpora, files of `split` only): a
    user turn asking for a passage or a function, and the corpus text itself as the assistant's answer, cut to
    `length` tokens. Kinds "explanation" (Python docs prose) and "code" (stdlib functions) alternate."""
    from sage_jax.chat import prompt_ids
    from sage_jax.prompts import COPY_PROMPTS, held_out_texts

    held = " ".join([*held_out_texts(), *(t for _, t in COPY_PROMPTS)])
    rng = random.Random(f"corpus-rows-{split}-{seed}")
    py, rst = ddata.corpus_files(split)
    rng.shuffle(py)
    rng.shuffle(rst)
    want = n // 2 + 16  # files are read only until there is enough text of each kind
    paras: list[str] = []
    for f in rst:
        paras += ddata.paragraphs(f, max_chars=1500)
        if len(paras) >= want:
            break
    snippets: list[tuple[str, str]] = []
    for f in py:
        snippets += ddata.code_snippets(f, max_chars=1500)
        if len(snippets) >= want:
            break
    rng.shuffle(paras)
    rng.shuffle(snippets)
    asks_prose = ("Explain this in a paragraph: {head}", "Tell me about the following. {head}",
                  "Write a short passage for the Python documentation that starts: {head}")
    asks_code = ("Write a Python function that does the following: {doc}", "Show me Python code for this: {doc}",
                 "Implement {name} in Python.")
    out = {"tokens": np.full((n, length), pad_id, np.int32), "lengths": np.zeros((n,), np.int32),
           "answer_start": np.zeros((n,), np.int32), "kind": np.zeros((n,), np.int32)}
    row = i = 0
    while row < n and i < 2 * max(len(paras), len(snippets)):
        prose = i % 2 == 0
        pool = paras if prose else snippets
        i += 1
        if not pool:
            continue
        item = pool[(i // 2) % len(pool)]
        if prose:
            ask, answer, kind = rng.choice(asks_prose).format(head=item.split(". ")[0][:200]), item, "explanation"
        else:
            code, doc = item
            name = code.split("(")[0].split()[-1] if "(" in code else "this"
            ask = rng.choice(asks_code).format(doc=doc or f"the function {name}", name=name)
            answer, kind = f"```python\n{code.strip()}\n```", "code"
        if any(line.strip() and len(line.strip()) > 40 and line.strip() in held for line in answer.split("\n")):
            continue  # shares a line with a held-out or benchmark prompt
        q = prompt_ids(tokenizer, ask)
        a = list(tokenizer(answer, add_special_tokens=False)["input_ids"]) + ([eos_id] if eos_id is not None else [])
        ids = (q + a)[:length]
        if len(q) >= length - 8:
            continue
        out["tokens"][row, : len(ids)] = ids
        out["lengths"][row], out["answer_start"][row] = len(ids), len(q)
        out["kind"][row] = ddata.ALL_KINDS.index(kind)
        row += 1
    if row < n:
        raise ValueError(f"the {split} corpus gave {row} rows, {n} wanted")
    return out
