"""The project's prompt splits, hand-written and never used for draft training: `dev`, on which every setting is
chosen (heads, thresholds, gates, budgets), and `test`, frozen, which no choice may read and which the README
quotes. Each holds three kinds of requests, because acceptance depends on how predictable the answer is:

- chat: everyday requests (explanations, lists, rewriting, arithmetic, summaries, advice, small code questions);
- copy: copy-heavy requests whose answer repeats long runs of the prompt (repeat, edit, fix, reformat, quote),
  where prompt-lookup chains pay;
- code: programming requests (write, explain, test, convert).

`dev` is the older sets below plus `assets/prompts/dev.jsonl`: `EVAL_PROMPTS` (24) are the draft-acceptance
check's (`python -m sage_jax.evaluate_draft`) and `BENCH_PROMPTS` (32) were the speed benchmark's, both chat (the
code ones of `EVAL_PROMPTS` count as code); `COPY_PROMPTS` (8) are copy. `test` is `assets/prompts/test.jsonl`.
`prompt_set("test-chat")` and the like give one kind of a split (`SETS`); `python -m sage_jax.bench --prompt-set
NAME` measures on it. Training data keeps every prompt of both splits out: the WordNet prompts avoid the older
sets' topics (`training/wordnet.py`), every training source's prompts are checked against both splits
(`tests/sage_jax/test_prompts.py`), and the prompts the target writes itself drop any near one of them
(`training/self_prompts.py`).
"""

from __future__ import annotations

import functools
import json
import os

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


BENCH_PROMPTS: tuple[tuple[str, str], ...] = (
    ("code", "Write a Python function that merges two sorted lists into one sorted list."),
    ("code", "Write a Python function that returns the largest element of a list without using max()."),
    ("code", "Write a SQL query that counts the orders per customer in a table named orders."),
    ("code", "Write a bash one-liner that counts the lines of every .txt file in a folder."),
    ("code", "Explain what this code prints:\n```python\nfor i in range(3):\n    print(i * 2)\n```"),
    ("code", "Write a Python function that removes duplicate items from a list while keeping their order."),
    ("explanation", "Explain the difference between RAM and a hard disk."),
    ("explanation", "How does a refrigerator keep food cold?"),
    ("explanation", "What is the greenhouse effect?"),
    ("explanation", "Explain what an API is to someone who does not program."),
    ("explanation", "Why do we have leap years?"),
    ("explanation", "What is the difference between weather and climate?"),
    ("rewriting", "Rewrite this sentence in the passive voice: The committee approved the new budget."),
    ("rewriting", "Correct the grammar: Me and him goes to the store yesterday and buyed three apple."),
    ("rewriting", "Rewrite more concisely: In the event that it rains, the picnic will be moved to a later date."),
    ("rewriting", "Make this friendlier: Your request has been denied. Do not contact us again about this."),
    ("rewriting", "Translate into simple English: The precipitation forecast indicates a high probability of "
                  "showers."),
    ("lists", "List five fruits that are high in vitamin C."),
    ("lists", "Name the seven continents."),
    ("lists", "List the days of the week in order."),
    ("lists", "Give five ideas for a child's birthday party."),
    ("lists", "List three advantages and three disadvantages of working from home."),
    ("math", "What is 15 percent of 240? Show your steps."),
    ("math", "If a train travels 60 km per hour for 2.5 hours, how far does it go?"),
    ("math", "Solve for x: 3x + 7 = 22."),
    ("math", "What is the area of a circle with a radius of 4 centimetres?"),
    ("summary", "Summarize the story of Cinderella in three sentences."),
    ("summary", "Summarize the water cycle in a short paragraph."),
    ("summary", "Give a one-paragraph summary of what the internet is."),
    ("advice", "How can I sleep better at night? Give practical tips."),
    ("advice", "What should I consider when buying a used car?"),
    ("advice", "How do I prepare for a job interview?"),
)


_PASSAGE = ("Speculative decoding lets a small draft model propose several tokens that a large target model then "
            "checks in a single forward pass. Every proposed token the target agrees with is kept, so the output is "
            "exactly what the target alone would have written, only produced in fewer sequential steps.")
_CODE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)"
         "\n\n\ndef variance(values):\n    m = mean(values)\n    return sum((v - m) ** 2 for v in values) / "
         "len(values)\n")

# Copy-heavy requests: the answer repeats long runs of the prompt (what retrieval branches are for). Not in
# `held_out_texts` (whose words the WordNet prompts avoid), so that the shipped head's recipe still reproduces it;
# the next training data must keep these texts out itself.
COPY_PROMPTS: tuple[tuple[str, str], ...] = (
    ("repeat", f"Repeat the following paragraph exactly, word for word:\n\n{_PASSAGE}"),
    ("edit", f"Rewrite this paragraph, replacing every 'target' with 'verifier' and changing nothing else:\n\n"
             f"{_PASSAGE}"),
    ("edit", f"Add a docstring to each function and print the whole code:\n\n```python\n{_CODE}```"),
    ("fix", "Fix the bug in this code and print the whole corrected code:\n\n```python\ndef is_even(n):\n    "
            "return n % 2 == 1\n\n\nfor i in range(5):\n    print(i, is_even(i))\n```"),
    ("fix", "Correct the spelling mistakes and print the corrected text: Teh meeting will start at nine oclock "
            "tomorow morning in the main confrence room. Please bring you're laptop and the quartely report."),
    ("summary", f"Quote the first sentence of this paragraph, then summarize the rest in one sentence:\n\n"
                f"{_PASSAGE}"),
    ("edit", f"Rename the function mean to average everywhere and print the whole code:\n\n```python\n{_CODE}```"),
    ("repeat", "Put this list in alphabetical order and print it: pear, apple, mango, cherry, banana, kiwi, grape, "
               "lemon, orange, plum."),
)


def bench_prompts(n: int | None = None) -> list[str]:
    """The first `n` prompt texts (all by default), interleaving kinds so that a prefix covers every kind."""
    order = [text for _, text in _interleaved(BENCH_PROMPTS)]
    return order if n is None else order[:n]


def _interleaved(rows) -> list[tuple[str, str]]:
    """(first field, text) of `rows` (text last), grouped by their fields but the text, one of each group in turn."""
    groups: dict[tuple, list[tuple[str, str]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[:-1]), []).append((row[0], row[-1]))
    order, i = [], 0
    while len(order) < len(rows):
        order += [g[i] for g in groups.values() if i < len(g)]
        i += 1
    return order


SPLITS = ("dev", "test")
KINDS = ("chat", "copy", "code")
#: The names `prompt_set` takes: a whole split, or one kind of it.
SETS = (*SPLITS, *(f"{split}-{kind}" for split in SPLITS for kind in KINDS))
_ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "prompts")


@functools.cache
def split(name: str) -> tuple[tuple[str, str, str], ...]:
    """Every prompt of split `name` ("dev" or "test") as (kind, category, text), in file order."""
    if name not in SPLITS:
        raise ValueError(f"unknown split {name!r}; expected one of {', '.join(SPLITS)}")
    rows = []
    if name == "dev":
        rows += [("chat", cat, text) for cat, text in BENCH_PROMPTS]
        rows += [("code" if cat == "code" else "chat", cat, text) for cat, text in EVAL_PROMPTS]
        rows += [("copy", cat, text) for cat, text in COPY_PROMPTS]
    with open(os.path.join(_ASSETS, f"{name}.jsonl"), encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                r = json.loads(line)
                rows.append((r["kind"], r["category"], r["prompt"]))
    return tuple(rows)


def prompt_set(name: str) -> list[str]:
    """The prompt texts of set `name` (`SETS`: "dev", "test", or "<split>-<kind>", e.g. "test-chat"), kinds and
    categories interleaved so that a prefix covers every category."""
    return [text for _, text in prompt_rows(name)]


def prompt_rows(name: str) -> list[tuple[str, str]]:
    """(kind, text) of `prompt_set(name)`'s prompts, in its order."""
    if name not in SETS:
        raise ValueError(f"unknown prompt set {name!r}; expected one of {', '.join(SETS)}")
    split_name, _, kind = name.partition("-")
    return _interleaved([r for r in split(split_name) if not kind or r[0] == kind])


def held_out_texts(bench: bool = True) -> list[str]:
    """Every held-out prompt text (with `bench`, the benchmark's too): what training data must stay away from."""
    return [text for _, text in (*EVAL_PROMPTS, *(BENCH_PROMPTS if bench else ()))]


def read_prompts_file(path: str | os.PathLike) -> list[str]:
    """The prompts of a user's file: a JSONL file (`.jsonl`) holds one JSON object with a "prompt" string per line,
    any other file one prompt per line; blank lines are skipped. ValueError (one line, naming the file and line)
    for a missing, unreadable or empty file, a line that is not such an object, or an empty prompt."""
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except FileNotFoundError:
        raise ValueError(f"no such prompts file: {name}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read prompts file {name}: {getattr(e, 'strerror', None) or e}") from None
    jsonl = name.endswith(".jsonl")
    prompts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if jsonl:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{name}, line {i}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{name}, line {i}: expected an object with a \"prompt\" string")
            line = obj["prompt"]
        if not line.strip():
            raise ValueError(f"{name}, line {i}: the prompt is empty")
        prompts.append(line)
    if not prompts:
        raise ValueError(f"prompts file {name} holds no prompt")
    return prompts
