"""`sage_jax.prompts`: the dev and test splits (every kind, apart from each other and from every training source),
and `read_prompts_file`: a user's prompts, one per line or JSONL, and one-line errors."""

import collections
import json
import re

import pytest

from sage_jax import prompts
from sage_jax.prompts import read_prompts_file
from sage_jax.training import self_prompts


def test_lines_and_jsonl(tmp_path):
    plain = tmp_path / "p.txt"
    plain.write_text("What is 2 + 2?\n\n  Name a fruit.  \n", encoding="utf-8")
    assert read_prompts_file(plain) == ["What is 2 + 2?", "  Name a fruit.  "]
    rows = tmp_path / "p.jsonl"
    rows.write_text("\n".join(json.dumps({"prompt": p, "id": i}) for i, p in enumerate(["Héllo\nthere", "Bye"])))
    assert read_prompts_file(rows) == ["Héllo\nthere", "Bye"]


@pytest.mark.parametrize("name, content, msg", [
    ("missing.txt", None, "no such prompts file"),
    ("empty.txt", "\n \n", "holds no prompt"),
    ("bad.jsonl", '{"prompt": "ok"}\n{"prompt": \n', "line 2: not JSON"),
    ("nofield.jsonl", '{"text": "ok"}\n', 'line 1: expected an object with a "prompt" string'),
    ("blank.jsonl", '{"prompt": "  "}\n', "line 1: the prompt is empty"),
    ("binary.txt", b"\xff\xfe\x00bad", "cannot read prompts file"),
])
def test_bad_files_are_one_line_errors(tmp_path, name, content, msg):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=msg) as e:
        read_prompts_file(path)
    assert "\n" not in str(e.value)


# ******** The dev and test splits: sizes, and no prompt (or close relative) in any training source. ********


def _runs(text: str, n: int = 8) -> set[tuple[str, ...]]:
    w = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(w[i: i + n]) for i in range(len(w) - n + 1)}


def _relatives(prompts: list[str], corpus: list[str]) -> list[tuple[str, str]]:
    """(prompt, corpus text) pairs where the text holds the prompt (or the prompt the text), shares a run of 8
    words with it (a passage or code copied), or shares most of its topic: at least two of its content words that
    are rare in the corpus (in under 1% of its texts; common words are the templates' own, "explain", "difference",
    "percent", which make a form, not a topic), half of the prompt's and a quarter of the text's (a long passage
    holds a few of any prompt's words)."""
    def content(text):  # words of four letters or more: numbers and short words make no topic
        return {w for w in self_prompts._content_words(text) if len(w) >= 4 and w.isalpha()}

    words = [content(t) for t in corpus]
    df = collections.Counter(w for ws in words for w in ws)
    rare_at = 0.01 * len(corpus)
    by_word: dict[str, list[int]] = collections.defaultdict(list)
    n_topic = []
    for i, ws in enumerate(words):
        for w in ws:
            if df[w] < rare_at:
                by_word[w].append(i)
        n_topic.append(sum(df[w] < rare_at for w in ws))
    by_run = {r: i for i, t in enumerate(corpus) for r in _runs(t)}
    found = []
    for p in prompts:
        topic = {w for w in content(p) if df[w] < rare_at}
        hits = collections.Counter(i for w in topic for i in by_word.get(w, ()))
        near = [i for i, n in hits.items() if n >= max(2, 0.5 * len(topic), 0.25 * n_topic[i])]
        near += [by_run[r] for r in _runs(p) if r in by_run]
        near += [i for i, t in enumerate(corpus) if p in t or t in p]
        found += [(p, corpus[i]) for i in sorted(set(near))]
    return found


def _training_prompts() -> list[str]:
    """Every prompt the shipped head's recipe (`configs/sage/smollm2_eagle.py`) trained on that can be rebuilt
    offline: the Python-source and docs prompts and both WordNet blocks of its first stage, and the WordNet prompts
    its next stages answered. (The last stage's prompts, which the target wrote itself on an accelerator, were not
    kept; `self_prompts` now drops any near a dev or test prompt, `test_self_prompts_drop_every_split_prompt`.)"""
    from configs.sage.smollm2_eagle import get_config
    from sage_jax.training import data, wordnet

    first, answered = get_config("scratch").data, get_config("answers6k").data
    texts = [p.text for p in data.build_prompts(first.n_train, "train", 0)]
    texts += [t for _, t in wordnet.build_prompts(max(first.n_general, answered.n_answers), "train", 0,
                                                  first.general_templates)]
    for seed in first.extra_general_seeds:
        texts += [t for _, t in wordnet.build_prompts(first.n_general, "train", seed, first.general_templates)]
    return texts


def test_splits_hold_every_kind_and_test_is_apart_from_dev():
    for name in prompts.SPLITS:
        rows = prompts.split(name)
        kinds = collections.Counter(k for k, _, _ in rows)
        assert set(kinds) == set(prompts.KINDS) and min(kinds.values()) >= 32, (name, kinds)
        assert len({t for _, _, t in rows}) == len(rows)  # no prompt twice
        assert sorted(prompts.prompt_set(name)) == sorted(t for _, _, t in rows)
    dev, test = ([t for _, _, t in prompts.split(s)] for s in prompts.SPLITS)
    assert not _relatives(test, dev)
    assert prompts.prompt_set("dev-copy")[:8] != [t for _, t in prompts.COPY_PROMPTS]  # interleaved by category
    with pytest.raises(ValueError, match="unknown prompt set"):
        prompts.prompt_set("train")


def test_no_split_prompt_or_close_relative_is_a_training_prompt():
    from sage_jax.training import wordnet

    if not wordnet.available():
        pytest.skip("wordnet-base not installed")
    corpus = _training_prompts()
    assert len(corpus) > 8000
    every = [t for s in prompts.SPLITS for _, _, t in prompts.split(s)]
    assert _relatives(every, corpus) == []
    # The check can fail: a paraphrase of a training prompt, and a passage copied from one, are found.
    para = corpus[5000].replace("Explain", "Describe")
    run = " ".join(corpus[123].split()[:12])
    assert {p for p, _ in _relatives([para, f"Repeat this: {run}"], corpus)} == {para, f"Repeat this: {run}"}


def test_self_prompts_drop_every_split_prompt():
    held = self_prompts.held_out_words()
    for name in prompts.SPLITS:
        for _, _, text in prompts.split(name):
            assert self_prompts.near_held_out(text, held), text
