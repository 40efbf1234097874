"""General-knowledge chat prompts from WordNet (Debian `wordnet-base`), so the draft sees more than Python text.

The held-out benchmark prompts (`eval_prompts.py`) ask about everyday topics (tea, planets, climate); training
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

from sage_jax.draft.eval_prompts import EVAL_PROMPTS

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


def _split_of(lemma: str) -> str:
    h = int(hashlib.sha1(("wn/" + lemma).encode()).hexdigest()[:8], 16)
    return "heldout" if h % HELDOUT_MOD == 0 else "train"


def available() -> bool:
    return os.path.isfile(os.path.join(WORDNET_DIR, "index.noun"))


def entries(split: str, min_tagged: int = 2) -> list[tuple[str, str, list[str]]]:
    """(lemma, gloss, example sentences) of the common nouns of `split` (at least `min_tagged` sense-tagged
    occurrences), in file order."""
    if not available():
        raise RuntimeError(f"WordNet not found in {WORDNET_DIR} (apt-get install wordnet-base)")
    banned = " ".join(text.lower() for _, text in EVAL_PROMPTS)
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


def build_prompts(n: int, split: str, seed: int = 0) -> list[tuple[str, str]]:
    """`n` (kind, prompt text) pairs, kinds in round-robin, over random common nouns of `split`."""
    rng = random.Random(f"wordnet-{split}-{seed}")
    items = entries(split)
    rng.shuffle(items)
    with_examples = [e for e in items if e[2]]
    kinds = tuple(_TEMPLATES)
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        lemma, gloss, examples = (with_examples if kind == "rewriting" else items)[i % len(items)
                                                                                  if kind != "rewriting"
                                                                                  else i % len(with_examples)]
        template = rng.choice(_TEMPLATES[kind])
        example = rng.choice(examples) if examples else gloss
        a = "an" if lemma[0] in "aeiou" else "a"
        out.append((kind, template.format(lemma=lemma, gloss=gloss, example=example[0].upper() + example[1:],
                                          a=a)))
    return out
