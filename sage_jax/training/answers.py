"""The target's answers to training prompts, kept as answers.jsonl (one JSON object a line: "i", "prompt" ids,
"answer" ids, and for self-written prompts their "text" and "kind"): written by `python -m sage_jax.build_datastore`,
read by the datastore and by draft training (`data.answers` of a recipe)."""

from __future__ import annotations

import json
import os

from sage_jax.training import wordnet


def read_answers(path: str) -> list[tuple[list[int], list[int]]]:
    """The (prompt ids, answer ids) pairs of an answers.jsonl, in prompt order (a torn last line is dropped)."""
    return [(r["prompt"], r["answer"]) for r in read_answer_lines(path)]


def read_jsonl(path: str) -> list[dict]:
    """The objects of a JSON-lines file that a run appends to as it goes, up to a torn last line (an interrupted
    write); [] when the file does not exist."""
    rows = []
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break
    return rows


def read_answer_lines(path: str) -> list[dict]:
    """The lines of an answers.jsonl as dicts, in prompt order (a torn last line is dropped); lines of `--prompts
    self` carry their prompt's "text" and "kind"."""
    rows = {r["i"]: r for r in read_jsonl(path)}
    return [rows[i] for i in sorted(rows)]


def training_prompts(n: int) -> list[tuple[str, str]]:
    """The (kind, text) of the first `n` prompts the target answers: training-split WordNet prompts, "extended"."""
    return wordnet.build_prompts(n, "train", style="extended")
