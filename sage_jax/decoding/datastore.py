"""A datastore of the target's own answers (REST-style retrieval), looked up inside the compiled loop.

Prompt lookup (`retrieval.py`) only finds what the request itself repeats. Free chat repeats *the target*: its
stock phrasings ("Here is a rewritten version", "In summary,", list scaffolding) recur across requests. The
datastore holds the target's greedy answers to training prompts; each step it proposes the continuation of the
longest newest n-gram (n = `n_max` down to `n_min`) of the prompt and the text so far that occurs there, taken
down the most frequent branch of that context's continuations (at every depth, the token most of the remaining
occurrences continue with). That chain is merged into the tree like the prompt-lookup chain (`retrieval.merge`);
acceptance treats it as any deterministic candidate, so decoding stays exact.

Layout (all arrays, so the loop takes the datastore as an argument, not as baked-in constants):

* `corpus` [N]: the answers back to back, each led by the last `n_max - 1` tokens of its prompt (the chat header a
  new answer starts after) and followed by a -1 separator;
* `keys` [K]: a 32-bit hash of every (n, context) that has a continuation, sorted (`searchsorted` finds it);
* `at` [K]: where in `corpus` that context's chosen continuation starts. The context itself sits in the n slots
  before it, so a hit is confirmed token by token there (a hash collision is a miss, never a wrong chain).

`build` makes one with numpy; `lookup` is the traced query.
"""

from __future__ import annotations

import collections
import os
import zipfile
from collections.abc import Sequence

import flax.struct
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

FILE = "datastore.npz"
SEPARATOR = -1
_MUL = np.uint32(0x01000193)  # FNV-1a's prime: xor a token in, then multiply (wrapping uint32)
_SEED = np.uint32(0x811C9DC5)


@flax.struct.dataclass
class Datastore:
    """See the module docstring. `n_min`, `n_max`: the context lengths looked up (static)."""

    corpus: Int[Array, " N"]
    keys: Int[Array, " K"]  # uint32
    at: Int[Array, " K"]
    n_min: int = flax.struct.field(pytree_node=False, default=2)
    n_max: int = flax.struct.field(pytree_node=False, default=4)

    @property
    def size(self) -> int:
        return int(self.keys.shape[0])

    def describe(self) -> str:
        n_answers = int(np.sum(np.asarray(self.corpus) == SEPARATOR))
        return (f"datastore: {n_answers} answers, {int(self.corpus.shape[0]) - n_answers} tokens, {self.size} "
                f"contexts of {self.n_min}..{self.n_max} tokens")


def _hash(n: int, ctx, xp=np):
    """32-bit hash of the contexts `ctx` [..., n], the same in numpy (`xp=np`, building) and traced (`xp=jnp`)."""
    h = xp.full(ctx.shape[:-1], _SEED ^ np.uint32(n), xp.uint32)
    for i in range(n):
        h = (h ^ ctx[..., i].astype(xp.uint32)) * xp.uint32(_MUL)
    return h


def build(answers: Sequence[tuple[Sequence[int], Sequence[int]]], *, length: int = 8, n_min: int = 2,
          n_max: int = 4) -> Datastore:
    """The datastore of (prompt ids, answer ids) pairs: every context of n_min..n_max tokens that some answer token
    follows, with the continuation down its most frequent branch (`length` deep)."""
    if not 1 <= n_min <= n_max:
        raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
    lead = n_max - 1
    parts, starts = [], []  # each part: lead prompt tokens, the answer, the separator
    offset = 0
    for prompt, answer in answers:
        head = list(prompt)[-lead:] if lead else []
        part = head + list(answer) + [SEPARATOR]
        parts.append(part)
        starts.append((offset + len(head), offset + len(head) + len(answer)))  # answer slots [a, b)
        offset += len(part)
    flat = [int(t) for p in parts for t in p]
    if not starts:
        raise ValueError("a datastore needs at least one answer")
    corpus = np.asarray(flat, np.int64)
    keys, at = [], []
    for n in range(n_min, n_max + 1):
        occurrences: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)
        for a, b in starts:
            for i in range(a, b):  # a continuation starting at answer slot i, after the n tokens before it
                ctx = tuple(flat[max(i - n, 0): i])
                if len(ctx) == n and SEPARATOR not in ctx:
                    occurrences[ctx].append(i)
        for ctx, where in occurrences.items():
            keys.append(_hash(n, np.asarray(ctx)[None])[0])
            at.append(_most_frequent_branch(flat, where, length))
    keys, at = np.asarray(keys, np.uint32), np.asarray(at, np.int64)
    order = np.argsort(keys, kind="stable")
    return Datastore(corpus=jnp.asarray(corpus, jnp.int32), keys=jnp.asarray(keys[order]),
                     at=jnp.asarray(at[order], jnp.int32), n_min=n_min, n_max=n_max)


def _most_frequent_branch(corpus: list[int], where: list[int], length: int) -> int:
    """Of the continuations starting at `where`, one that follows the most frequent token at every depth (ties:
    the earliest occurrence)."""
    left = list(where)
    for k in range(length):
        if len(left) == 1:
            break
        tokens = [corpus[i + k] if i + k < len(corpus) else SEPARATOR for i in left]
        counts = collections.Counter(t for t in tokens if t != SEPARATOR)
        if not counts:
            break
        best = max(counts, key=lambda t: (counts[t], -tokens.index(t)))
        left = [i for i, t in zip(left, tokens, strict=True) if t == best]
    return left[0]


def lookup(store: Datastore, history: Int[Array, "B ctx"], valid: Bool[Array, "B ctx"], end: Int[Array, " B"],
           length: int) -> tuple[Int[Array, "B chain"], Int[Array, " B"]]:
    """The datastore's chain for the n-gram ending at slot `end` of `history` (the newest token), longest n first:
    (tokens [B, L], how many are real [B]); as `retrieval.lookup` returns them."""
    b = history.shape[0]
    corpus, keys, at = store.corpus, store.keys, store.at
    n_corpus, n_keys = corpus.shape[0], keys.shape[0]
    found = jnp.zeros((b,), bool)
    start = jnp.zeros((b,), jnp.int32)
    for n in range(store.n_max, store.n_min - 1, -1):
        idx = end[:, None] - jnp.arange(n - 1, -1, -1)[None]  # the context's slots, oldest first
        ok = jnp.all((idx >= 0) & jnp.take_along_axis(valid, jnp.maximum(idx, 0), 1), axis=1)
        ctx = jnp.take_along_axis(history, jnp.maximum(idx, 0), 1)
        h = _hash(n, ctx, jnp)
        i = jnp.minimum(jnp.searchsorted(keys, h), n_keys - 1)
        cont = at[i]
        stored = corpus[jnp.clip(cont[:, None] - n + jnp.arange(n)[None], 0, n_corpus - 1)]
        hit = ok & (keys[i] == h) & jnp.all(stored == ctx, axis=1) & (cont >= n)
        take = ~found & hit
        start = jnp.where(take, cont, start)
        found = found | take
    slots = start[:, None] + jnp.arange(length)[None]
    tokens = corpus[jnp.clip(slots, 0, n_corpus - 1)]
    real = found[:, None] & (slots < n_corpus) & (tokens != SEPARATOR)
    real = jnp.cumprod(real, axis=1).astype(bool)  # up to the end of that answer
    return jnp.where(real, tokens, 0), jnp.sum(real, axis=1).astype(jnp.int32)


def save(store: Datastore, directory: str) -> str:
    """Writes `directory`/datastore.npz; returns its path."""
    path = os.path.join(directory, FILE)
    np.savez_compressed(path, corpus=np.asarray(store.corpus), keys=np.asarray(store.keys),
                        at=np.asarray(store.at), n_range=np.asarray([store.n_min, store.n_max]))
    return path


def load(directory: str) -> Datastore | None:
    """The datastore kept in `directory` (a draft checkpoint; or a .npz file itself), or None where it has none."""
    path = directory if directory.endswith(".npz") else os.path.join(directory, FILE)
    if not os.path.isfile(path):
        return None
    try:  # never unpickled: a file that is not our .npz is refused, whatever numpy would suggest
        with np.load(path, allow_pickle=False) as f:
            n_min, n_max = (int(v) for v in f["n_range"])
            return Datastore(corpus=jnp.asarray(f["corpus"], jnp.int32), keys=jnp.asarray(f["keys"], jnp.uint32),
                             at=jnp.asarray(f["at"], jnp.int32), n_min=n_min, n_max=n_max)
    except (ValueError, OSError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path} is not a readable datastore (build_datastore's .npz of corpus, keys, at and "
                         f"n_range; {type(e).__name__})") from None

