"""Every command's numbers at their boundaries: each numeric flag and each numeric config field (``--set``) gets 0,
−1, NaN, ±∞ and a huge value, and the command either takes it or answers one line ``error: ...`` with exit code 2,
never a traceback. The flags are found by asking each command's parser (`configs.cli.Parser`), so a new flag is
fuzzed without being listed here, and a numeric flag without a range (`type=int` / `type=float`) fails."""

import dataclasses
import importlib
import os
import typing

import pytest

from configs import cli, schema

COMMANDS = ("sage_jax.generate", "sage_jax.bench.__main__", "sage_jax.convert", "sage_jax.train_draft",
            "sage_jax.train_vlm", "sage_jax.build_datastore", "sage_jax.evaluate_draft", "sage_jax.lowering",
            "pgla_jax.attack", "pgla_jax.train_denoiser", "pgla_jax.prepare_data")
BOUNDARIES = ("0", "-1", "nan", "inf", "-inf", "1e308", "99999999999999999999", "1.5")


class _Parsed(Exception):
    """Raised by the spy in place of parsing: carries the parser."""


def _parser(module: str, monkeypatch) -> cli.Parser:
    def spy(self, args=None, namespace=None):
        raise _Parsed(self)

    with monkeypatch.context() as m:
        m.setattr(cli.Parser, "parse_args", spy)
        try:
            importlib.import_module(module).main([])
        except _Parsed as e:
            return e.args[0]
    raise AssertionError(f"{module} never parsed its arguments")


def _numeric(parser) -> list[tuple[str, str]]:
    flags = []
    for action in parser._actions:
        if action.type in (int, float):
            raise AssertionError(f"{parser.prog} {action.option_strings}: a number without a range; use "
                                 "cli.integer / cli.number")
        if getattr(action.type, "__name__", None) in ("integer", "number") and action.option_strings:
            flags.append((action.option_strings[-1], action.type.__name__))
    return flags


@pytest.mark.parametrize("module", COMMANDS)
def test_every_numeric_flag_takes_its_boundaries_or_refuses_in_one_line(module, monkeypatch, capsys):
    parser = _parser(module, monkeypatch)
    main = importlib.import_module(module).main
    for flag, kind in _numeric(parser):
        for value in BOUNDARIES:
            # `--help` after the value: an accepted value ends there (exit 0), before any work.
            try:
                code = main([flag, value, "--help"])
            except SystemExit as e:
                code = e.code
            out = capsys.readouterr()
            assert code in (0, 2), (module, flag, value, code)
            if code == 2:
                assert out.err.startswith("error: ") and out.err.count("\n") == 1, (module, flag, value, out.err)
                assert flag in out.err, (flag, out.err)
            if value in ("nan", "inf", "-inf") or (kind == "integer" and value == "99999999999999999999"):
                assert code == 2, (module, flag, value)  # never a setting: ∞, NaN and counts past int32


def _numeric_fields(cls, prefix=""):
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint, key = hints[f.name], f"{prefix}{f.name}"
        group = schema.group_type(hint)
        if group is not None:
            yield from _numeric_fields(group, key + ".")
            continue
        bare = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
        arms = typing.get_args(bare) or (bare,)
        arms = [typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a for a in arms]
        if int in arms or float in arms:
            yield key


RECIPES = [("smollm2_eagle", "configs.sage", "sage_jax.training.recipe", "DraftRecipe"),
           ("smollm2_vlm", "configs.sage", "sage_jax.training.vlm_recipe", "VLMRecipe"),
           ("smollm2_vlm_draft", "configs.sage", "sage_jax.training.vlm_recipe", "DraftVLMRecipe"),
           ("mnist_lenet", "configs.pgla", "pgla_jax.config", "ExperimentConfig"),
           ("denoiser_lenet", "configs.pgla", "pgla_jax.config", "DenoiserConfig")]


@pytest.mark.parametrize("name,package,module,cls", RECIPES)
def test_every_numeric_config_field_takes_its_boundaries_or_refuses_in_one_line(name, package, module, cls):
    """``--set key=value`` on every int / float field: a value or a one-line `BadInput`; NaN, ∞ and negative step
    counts never make a recipe."""
    cls = getattr(importlib.import_module(module), cls)
    keys = list(_numeric_fields(cls))
    assert len(keys) > 10, keys
    for key in keys:
        for value in ("0", "-1", "-5", "float('nan')", "1e999", "-1e999"):
            try:
                cli.load_config(name, package, cls, overrides=[f"{key}={value}"])
            except cli.BadInput as e:
                assert "\n" not in str(e) and key in str(e), (key, value, e)
            else:
                assert value not in ("float('nan')", "1e999", "-1e999"), (key, value)
    for key in [k for k in keys if k.endswith(".steps") or k == "steps"]:
        with pytest.raises(cli.BadInput, match="must be"):
            cli.load_config(name, package, cls, overrides=[f"{key}=-5"])


# ---------------------------------------------------------------------------------------------------------------
# Output locations: checked before any work, never overwritten without --force, no folder left by a refused run.
# ---------------------------------------------------------------------------------------------------------------

#: A folder nobody can write to, root included (a read-only file system).
UNWRITABLE = "/proc/sage_jax_unwritable"


def _one_line(capsys, *needles):
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_bench_out_is_never_overwritten_without_force(tmp_path, capsys):
    from sage_jax.bench.__main__ import main

    out = tmp_path / "bench"
    out.mkdir()
    (out / "bench.json").write_text("{}")
    before = _snapshot(out)
    assert main(["--quick", "--out", str(out)]) == 2
    _one_line(capsys, "bench.json exists", "--force")
    assert _snapshot(out) == before
    (tmp_path / "file").write_text("x")
    assert main(["--quick", "--out", str(tmp_path / "file")]) == 2
    _one_line(capsys, "is a file")


def test_bench_refused_run_leaves_no_folder_and_sweep_is_checked(tmp_path, capsys):
    from sage_jax.bench.__main__ import main

    out = tmp_path / "never"
    assert main(["--quick", "--methods", "no_such_method", "--out", str(out)]) == 2
    _one_line(capsys, "unknown method")
    assert not out.exists()
    for bad in ("abc", "-5", "0", "7,x"):
        assert main(["--quick", "--sweep", bad, "--out", str(out)]) == 2
        _one_line(capsys, "--sweep")
    for argv, needle in ((["--ratios", "abc"], "--ratios"), (["--ratios", "0.5,2"], "--ratios"),
                         (["--methods", "warp"], "unknown --vlm method")):
        assert main(["--vlm", "--quick", *argv, "--out", str(out)]) == 2
        _one_line(capsys, needle)
    assert not out.exists()


def test_evaluate_draft_out_is_checked_before_the_evaluation(tmp_path, capsys):
    from sage_jax.evaluate_draft import main

    assert main(["--out", str(tmp_path)]) == 2  # a folder: refused at once, not after the whole evaluation
    _one_line(capsys, "is a folder")
    existing = tmp_path / "acc.json"
    existing.write_text('{"kept": true}')
    assert main(["--out", str(existing)]) == 2
    _one_line(capsys, "exists", "--force")
    assert existing.read_text() == '{"kept": true}'


def test_build_datastore_out_is_never_overwritten_without_force(tmp_path, capsys):
    from sage_jax.build_datastore import main

    (tmp_path / "datastore.npz").write_bytes(b"old")
    assert main(["--workdir", str(tmp_path)]) == 2
    _one_line(capsys, "datastore.npz exists", "--force")
    assert (tmp_path / "datastore.npz").read_bytes() == b"old"


def test_attack_out_naming_a_file_and_no_empty_folder(tmp_path, capsys):
    from pgla_jax.attack import main

    (tmp_path / "file").write_text("x")
    assert main(["--out", str(tmp_path / "file")]) == 2
    _one_line(capsys, "is a file")
    out = tmp_path / "never"
    assert main(["--denoisers", "none,no_such_denoiser", "--out", str(out)]) == 2
    _one_line(capsys, "not available")
    assert not out.exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's read-only /proc")
@pytest.mark.parametrize("module,argv", [
    ("sage_jax.train_draft", ["--config", "tiny", "--workdir", UNWRITABLE + "/w"]),
    ("sage_jax.train_vlm", ["--config", "smollm2_vlm", "--workdir", UNWRITABLE + "/w"]),
    ("pgla_jax.train_denoiser", ["--config", "denoiser_tiny", "--workdir", UNWRITABLE + "/w"]),
    ("pgla_jax.attack", ["--out", UNWRITABLE + "/o"]),
    ("sage_jax.bench.__main__", ["--quick", "--out", UNWRITABLE + "/o"]),
    ("sage_jax.evaluate_draft", ["--out", UNWRITABLE + "/acc.json"]),
    ("sage_jax.build_datastore", ["--workdir", UNWRITABLE + "/w"]),
])
def test_an_unwritable_output_is_one_line_before_any_work(module, argv, capsys):
    assert importlib.import_module(module).main(argv) == 2
    _one_line(capsys, "cannot write to")


# ---------------------------------------------------------------------------------------------------------------
# Cases the boundary fuzz above would also let pass as exit 0 (a value some flag or field may take): each pinned.
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("module,argv,needle", [
    ("pgla_jax.attack", ["--iterations", "-1"], "--iterations"),
    ("pgla_jax.attack", ["--iterations", "0"], "--iterations"),
    ("sage_jax.train_draft", ["--config", "smollm2_eagle", "--set", "eagle.train.steps=-5"], "steps"),
    ("sage_jax.train_vlm", ["--config", "smollm2_vlm", "--set", "align.steps=-1"], "steps"),
    ("pgla_jax.train_denoiser", ["--config", "denoiser_tiny", "--set", "unet.width=0"], "unet.width"),
])
def test_nonsense_settings_are_refused_before_any_work(module, argv, needle, tmp_path, capsys):
    """A negative or zero count of attack iterations or training steps, a denoiser of width 0: one line and exit 2
    (they once ran to exit 0 with an untrained head or a results table, or to a ZeroDivisionError)."""
    main = importlib.import_module(module).main
    extra = ["--workdir", str(tmp_path / "w")] if module != "pgla_jax.attack" else ["--out", str(tmp_path / "o")]
    assert main([*argv, *extra]) == 2
    _one_line(capsys, needle)
    assert not os.listdir(tmp_path)  # refused before any folder was made
