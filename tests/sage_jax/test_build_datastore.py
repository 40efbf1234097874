"""`python -m sage_jax.build_datastore`: answers already in the work folder are not asked again (a torn last line,
from a run cut mid-write, is dropped and asked again), the datastore is built from them, and bad input is one line
with exit code 2."""

import json

import numpy as np
import pytest

from sage_jax import build_datastore
from sage_jax.decoding import datastore


def test_reuses_the_answers_it_has_and_builds(tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    rows = [{"i": i, "prompt": [1, 2, 3 + i], "answer": [7, 8, 9, 10 + i]} for i in range(3)]
    (work / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"i": 3, "prom')
    assert [a for _, a in build_datastore.read_answers(str(work / "answers.jsonl"))] == [r["answer"] for r in rows]
    # three prompts answered: nothing to generate, so no model is loaded
    assert build_datastore.main(["--answers", "3", "--workdir", str(work), "--out", str(tmp_path / "out")]) == 0
    store = datastore.load(str(tmp_path / "out"))
    assert int(np.sum(np.asarray(store.corpus) == datastore.SEPARATOR)) == 3
    assert "3 answers" in capsys.readouterr().out


@pytest.mark.parametrize("argv, msg", [
    (["--answers", "0"], "--answers: must be between 1"),
    (["--length", "0"], "--length: must be between 1"),
    (["--workdir", "{file}"], "is not a folder"),
])
def test_bad_input_is_one_line_and_exit_2(argv, msg, tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    argv = [a.format(file=tmp_path / "f") for a in argv]
    assert build_datastore.main(["--workdir", str(tmp_path / "w"), *argv] if "--workdir" not in argv else argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and msg in err[0]


def test_answers_made_another_way_are_never_reused(tmp_path, capsys):
    """The work folder records how its answers were made; a rerun asking for longer answers is refused in one line
    (they would be silently reused), and nothing in the folder changes."""
    work = tmp_path / "work"
    work.mkdir()
    rows = [{"i": i, "prompt": [1, 2, 3 + i], "answer": [7, 8, 9, 10 + i]} for i in range(3)]
    (work / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert build_datastore.main(["--answers", "3", "--workdir", str(work), "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    before = (work / "answers.jsonl").read_text()
    assert build_datastore.main(["--answers", "3", "--workdir", str(work), "--max-new-tokens", "50", "--out",
                                 str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_new_tokens=96, this run asks 50" in err and "--restart" in err
    assert (work / "answers.jsonl").read_text() == before and not (tmp_path / "out2").exists()
