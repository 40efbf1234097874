"""Held-out chat prompts for benchmarks (code, explanation, rewriting, lists). NEVER used for training.

They are hand-written here, not drawn from the corpora `data.py` samples, and `data.build_prompts` never reads
this module; `tests/sage_jax/draft` checks that no training prompt contains one of them.
"""

from __future__ import annotations

EVAL_PROMPTS: tuple[tuple[str, str], ...] = (
    ("code", "Write a Python function that returns the n-th Fibonacci number iteratively."),
    ("code", "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces."),
    ("code", "Explain this Python code:\n```python\ndef f(xs):\n    return sorted(set(xs), key=xs.index)\n```"),
    ("code", "Write a Python class for a stack with push, pop and peek methods."),
    ("code", "How do I read a CSV file into a list of dictionaries in Python? Show a short example."),
    ("code", "Write a Python function that counts how often each word appears in a text."),
    ("explanation", "Explain what a hash table is and why lookups are fast."),
    ("explanation", "Why is the sky blue? Explain it to a ten-year-old."),
    ("explanation", "What is the difference between a process and a thread?"),
    ("explanation", "Explain how photosynthesis works in a few sentences."),
    ("explanation", "What does HTTP stand for, and what happens when you open a web page?"),
    ("explanation", "Explain recursion with a simple example."),
    ("rewriting", "Rewrite this sentence to sound more formal: hey, can u send me the report by tomorrow?"),
    ("rewriting", "Paraphrase: The meeting was postponed because several team members were ill."),
    ("rewriting", "Make this clearer: The thing that we did with the stuff last week kind of worked but not really."),
    ("rewriting", "Rewrite in plain English: The aforementioned party shall indemnify the other party against all "
                  "losses arising hereunder."),
    ("rewriting", "Turn this into a polite email: I need the invoice fixed, it has the wrong amount."),
    ("lists", "List five tips for writing readable code."),
    ("lists", "List the planets of the solar system in order from the sun."),
    ("lists", "Give me a list of healthy breakfast ideas."),
    ("lists", "List the steps to make a cup of tea."),
    ("lists", "List four common sorting algorithms and their time complexity."),
    ("lists", "What are the main causes of climate change? Answer as a bulleted list."),
    ("lists", "List six things to pack for a weekend hiking trip."),
)


def eval_prompts(kind: str | None = None) -> list[str]:
    """The prompt texts (of one `kind`, or all)."""
    return [text for k, text in EVAL_PROMPTS if kind is None or k == kind]
