"""Prompts the target writes itself (`training/self_prompts.py`, `build_datastore --prompts self`): the template's
empty user slot, the filters that keep held-out prompts and garbage out, resuming, and their answers as rows."""

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest

from sage_jax import build_datastore
from sage_jax.prompts import BENCH_PROMPTS, COPY_PROMPTS, EVAL_PROMPTS
from sage_jax.training import data, self_prompts


def test_user_prefix_is_the_template_up_to_the_user_message(smollm2):
    _, _, tok, _ = smollm2
    prefix = self_prompts.user_prefix_ids(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False)
    assert tok.decode(prefix) == full[: full.index("Hello there")]
    assert tok.decode(prefix).endswith("<|im_start|>user\n")
    with pytest.raises(ValueError, match="chat template"):
        self_prompts.user_prefix_ids(SimpleNamespace(chat_template=None))


def test_every_held_out_prompt_and_close_paraphrases_are_near_held_out():
    held = self_prompts.held_out_words()
    for _, text in (*EVAL_PROMPTS, *BENCH_PROMPTS, *COPY_PROMPTS):
        assert self_prompts.near_held_out(text, held), text
    for text in ("Why is the sky blue?", "Can you list the planets in our solar system?",
                 "What should I look for when I buy a used car?"):
        assert self_prompts.near_held_out(text, held), text
    for text in ("How do I bake sourdough bread at home?", "Write a short poem about autumn leaves.",
                 "Can you help me plan a budget for a small bakery?"):
        assert not self_prompts.near_held_out(text, held), text


@pytest.mark.parametrize("text, ended, ok", [
    ("How do I bake sourdough bread at home?", True, True),
    ("How do I bake sourdough bread at home?", False, False),  # cut at the token limit
    ("Bread?", True, False),  # too short
    ("📌 How does colour work ⁄⛏⛏⛏⚡📺⓹☄★☆ in print?", True, False),  # mostly not plain text
    ("Why is the sky blue? Tell a child.", True, False),  # near a held-out prompt
])
def test_acceptable(text, ended, ok):
    assert self_prompts.acceptable(text, ended, self_prompts.held_out_words()) is ok


class _FakeEngine:
    """Samples fixed continuations; each `generate` call is one batch (its seed recorded)."""

    def __init__(self, tok, eos, texts):
        self.tokenizer, self.cfg, self.seeds = tok, SimpleNamespace(eos_token_ids=(eos,)), []
        self.texts, self.eos = texts, eos

    def generate(self, prompts, *, seed, **kw):
        self.seeds.append(seed)
        out = []
        for i in range(len(prompts)):
            text = self.texts[(seed * len(prompts) + i) % len(self.texts)]
            out.append(self.tokenizer.encode(text, add_special_tokens=False) + ([self.eos] if i % 4 else []))
        return SimpleNamespace(token_ids=out)


def test_self_prompts_filter_dedupe_and_resume(smollm2, tmp_path):
    _, _, tok, _ = smollm2
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    texts = [f" to plan a garden with {k} kinds of tomatoes" for k in range(40)]
    texts[2] = " the sky is blue, why? Tell a child."  # near a held-out prompt
    texts[6] = texts[5]  # a repeat within a batch
    path = str(tmp_path / "prompts.jsonl")
    eng = _FakeEngine(tok, eos, texts)  # every batch's first row runs past the limit (no EOS)
    got = self_prompts.sample(eng, path, 6, batch=4, temperature=0.8, progress=False)
    assert eng.seeds == [0, 1, 2] and len(set(got)) == 6
    assert got[:2] == ["to plan a garden with 1 kinds of tomatoes", "to plan a garden with 3 kinds of tomatoes"]
    assert got[2:4] == [f"{self_prompts.STARTERS[1]} to plan a garden with {k} kinds of tomatoes" for k in (5, 7)]
    assert got[4].startswith(self_prompts.STARTERS[2] + " to plan")
    eng2 = _FakeEngine(tok, eos, texts)
    assert self_prompts.sample(eng2, path, 6, batch=4, temperature=0.8, progress=False) == got
    assert eng2.seeds == []  # nothing sampled again
    more = self_prompts.sample(eng2, path, 8, batch=4, temperature=0.8, progress=False)
    assert more[:6] == got and len(more) == 8 and eng2.seeds == [3]  # the file held 7: one batch more
    eng3 = _FakeEngine(tok, eos, texts)  # a deadline already past: what the file holds, nothing sampled
    held = self_prompts.sample(eng3, path, 40, batch=4, temperature=0.8, progress=False, deadline=0.0)
    assert eng3.seeds == [] and held[:8] == more and 8 <= len(held) < 40


def test_answer_rows_of_self_prompts(smollm2, tmp_path):
    """`data.answers` of `--prompts self`: rows keep their texts' ids, kind "chat"; a prompt near a held-out one
    is dropped, ids that are not its text's are refused."""
    from configs.sage import smollm2_eagle
    from sage_jax.training import distillation, wordnet
    from sage_jax.training.recipe import DraftRecipe

    if not wordnet.available():
        pytest.skip("wordnet-base not installed")
    cfg, _, tok, _ = smollm2
    prompts = ["How do I bake sourdough bread?", "Write a short poem about autumn.", "Plan a tiny garden for me."]
    lines = [{"i": i, "prompt": data.encode(tok, t, 0), "answer": [100 + i, 7, 2], "text": t, "kind": "chat"}
             for i, t in enumerate(prompts)]
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    c = DraftRecipe.from_config(smollm2_eagle.get_config("answers4k"))
    c = dataclasses.replace(c, data=dataclasses.replace(c.data, answers=str(path), n_answers=0))
    rows = distillation.answer_rows(c, tok, cfg.pad_token_id)
    assert len(rows["tokens"]) == 3 and set(rows["kind"]) == {data.ALL_KINDS.index("chat")}
    for r in range(3):
        i = int(rows["tokens"][r, rows["answer_start"][r]]) - 100
        assert list(rows["tokens"][r, : rows["lengths"][r]]) == lines[i]["prompt"] + lines[i]["answer"]
    assert np.all(rows["answer_start"] == [len(lines[int(rows["tokens"][r, rows["answer_start"][r]]) - 100]["prompt"])
                                           for r in range(3)])
    bad = [dict(lines[0], text="Why is the sky blue? Explain it to a child.",
                prompt=data.encode(tok, "Why is the sky blue? Explain it to a child.", 0))] + lines[1:]
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    kept = distillation.answer_rows(c, tok, cfg.pad_token_id)  # the filter runs again on the file's prompts
    assert sorted(int(kept["tokens"][r, kept["answer_start"][r]]) for r in range(len(kept["tokens"]))) == [101, 102]
    path.write_text("".join(json.dumps(dict(r, prompt=r["prompt"][:-1])) + "\n" for r in lines))
    with pytest.raises(ValueError, match="differs"):
        distillation.answer_rows(c, tok, cfg.pad_token_id)


def test_a_workdir_of_the_other_prompt_source_is_refused(tmp_path, capsys):
    work = tmp_path / "w"
    work.mkdir()
    (work / "answers.jsonl").write_text(json.dumps({"i": 0, "prompt": [1, 2], "answer": [3]}) + "\n")
    assert build_datastore.main(["--prompts", "self", "--answers", "1", "--workdir", str(work)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not --prompts self" in err[0]
