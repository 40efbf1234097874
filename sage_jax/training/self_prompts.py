"""Chat prompts the target writes itself: its user turn sampled from the chat template's empty user slot.

An instruction-tuned target has learned what its users ask (SmolLM2-Instruct: its SFT chat set). Given only the
template up to where a user message starts, it samples such a message (the "pre-query template" of Magpie, Xu et
al. 2024, arXiv 2406.08464): prompts from the distribution the draft will serve, instead of WordNet templates
around random nouns (`wordnet.py`), and with no data shipped or downloaded. Messages that run past the token limit,
are mostly not plain text, or share too much with a held-out prompt (`sage_jax/prompts.py`: the acceptance check's,
the benchmark's and the copy set's) are dropped; so are repeats.
"""

from __future__ import annotations

import json
import re
import time

from tqdm import tqdm

from sage_jax import chat
from sage_jax.prompts import SPLITS, split
from sage_jax.training import answers

KIND = "chat"
# Openings the sampled user message is made to start with, batch by batch in turn: left alone, the target mostly
# asks for advice ("Can you help me ..."); these spread the prompts over the kinds of requests a chat model meets
# (code, explanations, rewriting, lists, arithmetic, summaries, advice), not over any held-out prompt's topic.
STARTERS = ("", "Write a Python function", "Explain", "List", "Rewrite", "What is", "How do", "Write a",
            "Summarize", "Give me", "Why", "Can you", "What are the", "How many", "Correct", "Describe")
_MARK = "\x00USER\x00"
_STOP = frozenset(("the", "and", "for", "that", "this", "with", "what", "how", "are", "you", "your", "can", "into",
                   "from", "does", "when", "which", "about", "give", "make", "list", "write", "explain", "show",
                   "some", "why", "there", "their", "them", "then", "than", "have", "has", "its", "it's", "a", "an",
                   "of", "to", "in", "is", "on", "me", "my", "i", "do", "be", "as", "or", "by", "at", "it"))


def user_prefix_ids(tokenizer) -> list[int]:
    """Token ids of the chat template up to where the (first) user message starts (its default system turn
    included)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("prompts written by the target need a tokenizer with a chat template")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                             add_generation_prompt=False)
    if _MARK not in rendered:
        raise ValueError("the chat template does not render the user message verbatim")
    return list(tokenizer(rendered.split(_MARK)[0], add_special_tokens=False)["input_ids"])


def _content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9']+", text.lower())
            if (len(w) > 2 or any(c.isdigit() for c in w)) and w not in _STOP}


def held_out_words() -> list[set[str]]:
    """The content words of every held-out prompt: both splits of `sage_jax/prompts.py` (dev and test)."""
    return [_content_words(t) for name in SPLITS for _, _, t in split(name)]


def near_held_out(text: str, held: list[set[str]], share: float = 0.4) -> bool:
    """Whether `text` holds at least `share` of some held-out prompt's content words (and at least two of them, or
    all of a one-word one): a paraphrase or a close relative of a prompt the draft is measured on."""
    words = _content_words(text)
    return any(len(h & words) >= max(min(2, len(h)), share * len(h)) for h in held if h)


def acceptable(text: str, ended: bool, held: list[set[str]]) -> bool:
    """A sampled user message kept as a training prompt: it ended before the token limit, has 4-120 words, is
    mostly plain printable text, and is not near a held-out prompt."""
    if not ended or not 4 <= len(text.split()) <= 120:
        return False
    plain = sum(c.isascii() and (c.isprintable() or c == "\n") for c in text)
    return plain >= 0.97 * len(text) and not near_held_out(text, held)


def sample(engine, path: str, n: int, *, batch: int, temperature: float, max_tokens: int = 64,
           progress: bool = True, deadline: float | None = None) -> list[str]:
    """The first `n` acceptable user messages the target samples, batch by batch (batch k at seed k, opening with
    `STARTERS[k]`), appended to `path` as they come so that a rerun resumes; fewer when a batch ends
    after `deadline` (a `time.monotonic()` value)."""
    texts, seen, seed = [], set(), 0
    for r in answers.read_jsonl(path):
        seed = r["seed"] + 1
        for t in r["texts"]:
            if t not in seen:
                seen.add(t)
                texts.append(t)
    if len(texts) >= n:
        return texts[:n]
    prefix, held = user_prefix_ids(engine.tokenizer), held_out_words()
    eos = set(engine.cfg.eos_token_ids)
    with open(path, "a") as f, tqdm(total=n, initial=len(texts), desc="prompts", unit="prompt",
                                    disable=not progress) as bar:
        while len(texts) < n and (deadline is None or time.monotonic() < deadline):
            start = STARTERS[seed % len(STARTERS)]
            opening = engine.tokenizer.encode(start, add_special_tokens=False) if start else []
            gen = engine.generate([prefix + opening] * batch, policy="ar", temperature=temperature,
                                  max_new_tokens=max_tokens, seed=seed)
            kept = []
            for ids in gen.token_ids:  # decoded with the opening, so the word boundary after it stays
                text = chat.decode(engine.tokenizer, opening + list(ids), eos).strip()
                if text not in seen and acceptable(text, any(t in eos for t in ids), held):
                    seen.add(text)
                    kept.append(text)
            f.write(json.dumps({"seed": seed, "texts": kept}) + "\n")
            f.flush()
            texts += kept
            bar.update(min(len(kept), n - bar.n))
            seed += 1
    return texts[:n]
