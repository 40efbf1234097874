"""`sage_jax.prompts.read_prompts_file`: a user's prompts, one per line or JSONL, and one-line errors."""

import json

import pytest

from sage_jax.prompts import read_prompts_file


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
