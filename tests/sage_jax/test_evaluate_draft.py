"""`python -m sage_jax.evaluate_draft`: its input errors are one line with exit code 2, found before any model loads."""

import pytest

from sage_jax import evaluate_draft


@pytest.mark.parametrize("argv, msg", [
    (["--policies", "sage,beam"], "unknown"),
    (["--prompts", "0"], "--prompts"),
    (["--policies", "eagle2", "--retrieval", "8"], "--retrieval with policy eagle2"),  # its depth cap is 6
    (["--policies", "sage", "--datastore", "--write-prior"], "--write-prior"),
    (["--vlm", "--draft-layers", "2"], "--vlm"),
    (["--vlm", "--prompt-set", "test-chat"], "--vlm"),
    (["--prompt-set", "test-chat", "--prompts", "41"], "--prompts must be in [1, 40]"),
    (["--prompt-set", "test-chat", "--write-prior"], "--write-prior"),
])
def test_bad_input_is_one_line_and_exit_2(argv, msg, capsys):
    assert evaluate_draft.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and msg in err[0]
