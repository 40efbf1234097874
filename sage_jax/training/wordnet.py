"""General-knowledge chat prompts from WordNet (Debian `wordnet-base`), so the draft sees more than Python text.

The held-out prompts (`sage_jax/prompts.py`) ask about everyday topics (tea, planets, climate); training
only on the Python docs would leave the draft off-distribution there. WordNet's common nouns (those with a
sense-tagged count in the Princeton corpus), their glosses and quoted example sentences give varied topics
without any download. Each lemma belongs to one split by a stable hash, and lemmas that occur in a benchmark
prompt are dropped from both splits.
"""

from __future__ import annotations

import hashlib
import os
import random
import re

from sage_jax.prompts import held_out_texts

WORDNET_DIR = "/usr/share/wordnet"
HELDOUT_MOD = 10

_TEMPLATES: dict[str, tuple[str, ...]] = {
    "explanation": (
        "Explain what {a} {lemma} is.",
        "What is {a} {lemma}? Explain it in a few sentences.",
        "Explain the word \"{lemma}\" ({gloss}) to a ten-year-old.",
        "Why does {a} {lemma} matter? Give a short explanation.",
        "Describe {a} {lemma} in a short paragraph.",
    ),
    "lists": (
        "List five facts about {lemma}.",
        "Give me a list of things related to {lemma}.",
        "List three questions people often ask about {lemma}.",
        "What are the pros and cons of {lemma}? Answer as a bulleted list.",
        "List the steps to learn about {lemma}.",
    ),
    "rewriting": (
        "Paraphrase: {example}",
        "Rewrite this sentence to sound more formal: {example}",
        "Make this sentence clearer: {example}",
        "Rewrite in plain English: {gloss}.",
    ),
    "code": (
        "Write a Python class that represents {a} {lemma}.",
        "Write a Python function that stores information about {a} {lemma} in a dictionary and prints it.",
    ),
}


# The "extended" style (config `data.general_templates`): the basic templates plus more of the phrasings chat
# users write, and the kinds the benchmark suite also asks (summaries, advice, small arithmetic problems).
_EXTENDED: dict[str, tuple[str, ...]] = {
    "explanation": _TEMPLATES["explanation"] + (
        "How does {a} {lemma} work?",
        "Explain {lemma} with a simple example.",
        "What is the difference between {a} {lemma} and {a2} {lemma2}?",
        "Why is {lemma} important? Explain it to a child.",
        "What does the word \"{lemma}\" mean? Answer in two sentences.",
    ),
    "lists": _TEMPLATES["lists"] + (
        "List five tips about {lemma}.",
        "Give me a list of ideas related to {lemma}.",
        "List the main kinds of {lemma}.",
        "What are the main uses of {a} {lemma}? Answer as a bulleted list.",
        "List six things to know about {lemma}.",
        "Name four things that are related to {lemma} and {lemma2}.",
    ),
    "rewriting": _TEMPLATES["rewriting"] + (
        "Turn this into a polite email: {example}",
        "Rewrite this sentence to sound more casual: {example}",
        "Correct the grammar and make this clearer: {example}",
        "Rewrite this in simpler words: {gloss}.",
        "Rewrite more concisely: {example}",
    ),
    "code": _TEMPLATES["code"] + (
        "Write a Python function that returns a short description of {a} {lemma}.",
        "Write a Python class for {a} {lemma} with a method that prints its details.",
        "Write a Python function that sorts a list of {lemma} names alphabetically.",
        "How do I store a list of {lemma} records in Python? Show a short example.",
        "Write a Python function that counts how many times the word \"{lemma}\" appears in a text.",
    ),
    "summary": (
        "Summarize what {a} {lemma} is in a short paragraph.",
        "Give a one-paragraph summary of {lemma}.",
        "Summarize this definition in one sentence: {gloss}.",
    ),
    "advice": (
        "How can I learn more about {lemma}? Give practical tips.",
        "What should I consider when choosing {a} {lemma}?",
        "How do I get started with {lemma}?",
    ),
}


def _math_prompt(rng: random.Random) -> str:
    """A small arithmetic problem with fresh numbers (the benchmark's math kind, never its exact prompts)."""
    a, b, c = rng.randint(2, 12), rng.randint(3, 40), rng.randint(2, 9)
    return rng.choice((
        lambda: f"What is {rng.choice((5, 10, 20, 25, 30, 40))} percent of {10 * rng.randint(3, 60)}? "
                "Show your steps.",
        lambda: f"Solve for x: {a}x + {b} = {a * c + b}.",
        lambda: f"If a car travels {10 * rng.randint(3, 12)} km per hour for {c} hours, how far does it go?",
        lambda: f"What is the area of a rectangle that is {a} metres long and {c} metres wide?",
        lambda: f"A shop sells pens for {c} dollars each. How much do {b} pens cost?",
        lambda: f"What is {a * b} divided by {a}? Explain briefly.",
    ))()


def _split_of(lemma: str) -> str:
    h = int(hashlib.sha1(("wn/" + lemma).encode()).hexdigest()[:8], 16)
    return "heldout" if h % HELDOUT_MOD == 0 else "train"


def available() -> bool:
    return os.path.isfile(os.path.join(WORDNET_DIR, "index.noun"))


def entries(split: str, min_tagged: int = 2, *, ban_bench: bool = False) -> list[tuple[str, str, list[str]]]:
    """(lemma, gloss, example sentences) of the common nouns of `split` (at least `min_tagged` sense-tagged
    occurrences), in file order; lemmas in a held-out chat prompt (and with `ban_bench`, a benchmark prompt) are
    left out."""
    if not available():
        raise RuntimeError(f"WordNet not found in {WORDNET_DIR} (apt-get install wordnet-base)")
    banned = " ".join(text.lower() for text in held_out_texts(ban_bench))
    out = []
    with open(os.path.join(WORDNET_DIR, "data.noun"), "rb") as data, \
            open(os.path.join(WORDNET_DIR, "index.noun"), encoding="utf-8") as index:
        for line in index:
            if line.startswith(" "):
                continue
            f = line.split()
            lemma, n_ptr = f[0], int(f[3])
            tagged = int(f[5 + n_ptr])
            offsets = f[6 + n_ptr:]
            word = lemma.replace("_", " ")
            if tagged < min_tagged or not offsets or len(word) < 3 or not re.fullmatch(r"[a-z][a-z \-]*", word):
                continue
            if word in banned or _split_of(word) != split:
                continue
            data.seek(int(offsets[0]))
            gloss_part = data.readline().decode("utf-8", "replace").split(" | ", 1)[-1].strip()
            examples = re.findall(r'"([^"]{20,200})"', gloss_part)
            gloss = gloss_part.split(";")[0].strip()
            out.append((word, gloss, examples))
    return out


def build_prompts(n: int, split: str, seed: int = 0, style: str = "basic") -> list[tuple[str, str]]:
    """`n` (kind, prompt text) pairs, kinds in round-robin, over random common nouns of `split`.

    `style` "basic" (the shipped head's recipe) or "extended" (more phrasings, plus summary / advice / math
    prompts; benchmark topics left out too). No prompt equals a held-out one."""
    if style not in ("basic", "extended"):
        raise ValueError(f"unknown prompt style {style!r} (basic, extended)")
    extended = style == "extended"
    rng = random.Random(f"wordnet-{split}-{seed}" + ("-extended" if extended else ""))
    items = entries(split, ban_bench=extended)
    rng.shuffle(items)
    with_examples = [e for e in items if e[2]]
    templates = _EXTENDED if extended else _TEMPLATES
    kinds = tuple(templates) + (("math",) if extended else ())
    held_out = set(held_out_texts(extended))
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if kind == "math":
            text = _math_prompt(rng)
        else:
            lemma, gloss, examples = (with_examples if kind == "rewriting" else items)[i % len(items)
                                                                                      if kind != "rewriting"
                                                                                      else i % len(with_examples)]
            lemma2 = items[(i * 7 + 3) % len(items)][0]
            template = rng.choice(templates[kind])
            example = rng.choice(examples) if examples else gloss
            text = template.format(lemma=lemma, gloss=gloss, example=example[0].upper() + example[1:],
                                   a=_article(lemma), lemma2=lemma2, a2=_article(lemma2))
        if text not in held_out:
            out.append((kind, text))
    return out


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"
