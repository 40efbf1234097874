"""The command-line contract of every entry point of both papers.

A mistake the user can fix (a missing file, a flag out of range, a config that is not one) is reported as one line
``error: ...`` on stderr with exit code 2, never a traceback; a real bug still raises. Entry points are written as::

    def main(argv=None) -> int:
        return cli.run(_main, argv)          # _main(argv) raises cli.BadInput for the user's mistakes

    with cli.reported(OSError, ValueError):  # library errors that are the user's input become BadInput
        model = load(path)

Configs (``--config NAME[:ARG]``) are Python files or named modules of a config package, each defining
``get_config()`` (or ``get_config(ARG)``) that returns an `ml_collections.ConfigDict` of plain data with a `kind`;
``--set a.b=value`` overrides a field of it (`override`), and the consuming package's dataclass validates the result
(`load_config`, `configs.schema`).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a command stopped by Ctrl-C


class BadInput(Exception):
    """A mistake the user can fix: reported as one line on stderr, exit code 2."""


def first_line(error: BaseException | str) -> str:
    """The first non-empty line of an error message (the exception's type name when it has none)."""
    text = str(error).strip()
    if text:
        return text.splitlines()[0]
    return "bad input" if isinstance(error, str) else type(error).__name__


class Parser(argparse.ArgumentParser):
    """argparse with the contract's errors: one line (argparse's own prints the usage block, then exits 2)."""

    def error(self, message):
        raise BadInput(first_line(message))


@contextlib.contextmanager
def reported(*errors: type[BaseException]) -> Iterator[None]:
    """Re-raises the listed exception types as `BadInput` (their first line): for library calls whose failure is
    the user's input, e.g. loading a file the user named."""
    try:
        yield
    except BadInput:
        raise
    except errors as e:
        raise BadInput(first_line(e)) from None


def run(body: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None, *,
        resumable: bool = False) -> int:
    """Calls `body(argv)`; a `BadInput` becomes ``error: <one line>`` on stderr and exit code 2, Ctrl-C one line
    ``interrupted`` (``; rerun the same command to resume`` for `resumable` commands, whose work folders keep only
    finished checkpoints) and exit code 130.

    Stopped either way as a command (`body` defined in ``__main__``, argv from the command line), the process ends
    right there (`os._exit`, after flushing): the interpreter's teardown would otherwise run while XLA may still be
    compiling on its own threads, which can crash it, or Orbax's readers print their own tracebacks."""
    command = argv is None and getattr(body, "__module__", None) == "__main__"
    try:
        with _ctrl_c_never_swallowed():
            return body(argv) or 0
    except BadInput as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return _end(EXIT_BAD_INPUT, command)
    except KeyboardInterrupt:
        print("\ninterrupted" + ("; rerun the same command to resume" if resumable else ""), file=sys.stderr)
        return _end(EXIT_INTERRUPTED, command)


@contextlib.contextmanager
def _ctrl_c_never_swallowed() -> Iterator[None]:
    """A Ctrl-C that lands inside a callback Python runs for itself (XLA's garbage-collection callback, a
    finaliser) is dropped with an "Exception ignored" note (`sys.unraisablehook`), and the command would run on to
    its end: such a KeyboardInterrupt is delivered again, to the main thread once the hook has returned (from
    another thread: delivered inside the hook, it would be dropped the same way)."""
    import _thread
    import threading

    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            threading.Timer(0.05, _thread.interrupt_main).start()
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def _end(code: int, command: bool) -> int:
    """`code`, or, for a command that stopped early, the process's end right here: work may still be in flight on
    other threads (XLA compiling, Orbax's readers of a damaged checkpoint) that would crash or print tracebacks
    during the interpreter's teardown."""
    if command:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


#: Bounds of the flags every command shares: tokens of one request, and random seeds (jax.random.key takes an int32
#: without x64).
MAX_TOKENS = 1 << 20
SEED_MAX = 2**31 - 1


def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An argparse `type`: an integer in [lo, hi] (None: unbounded), else argparse's one-line error naming the flag
    (``argument --steps: must be ≥ 1, got -5``): every command's integer flags go through it, so a bad number fails
    before any work."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        _in_range(value, lo, hi)
        return value

    parse.__name__ = "integer"  # argparse names the type in its own messages
    return parse


def number(lo: float | None = None, hi: float | None = None) -> Callable[[str], float]:
    """An argparse `type`: a finite float in [lo, hi] (None: unbounded); NaN and ±∞ are never a setting."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        _in_range(value, lo, hi)
        return value

    parse.__name__ = "number"
    return parse


def _in_range(value: float, lo: float | None, hi: float | None) -> None:
    from configs import schema

    try:
        schema.Range(lo, hi).check(value, "value")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("value ")) from None


def output_file(path: str, flag: str, force: bool = False) -> None:
    """Checks a file the command will write, before any work: not a folder, not already there unless `force`, and
    its folder writable (or creatable). Creates nothing."""
    if os.path.isdir(path):
        raise BadInput(f"{flag} {path} is a folder; name a file")
    if os.path.lexists(path) and not force:
        raise BadInput(f"{path} exists; pass --force to overwrite it or choose another {flag}")
    writable(os.path.dirname(os.path.abspath(path)), flag)


def output_dir(path: str, flag: str, force: bool = False, outputs: Sequence[str] = ()) -> None:
    """Checks a folder the command will write `outputs` (names inside it) to, before any work: not a file, none of
    them (nor any file an earlier run listed, `begin_outputs`) already there unless `force`, and writable (or
    creatable). Creates nothing."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise BadInput(f"{flag} {path} is a file; name a folder")
    if not force:
        for name in [*outputs, *_listed(path)]:
            if os.path.lexists(os.path.join(path, name)):
                raise BadInput(f"{os.path.join(path, name)} exists; pass --force to overwrite it or choose another "
                               f"{flag}")
    writable(path, flag)


#: A results folder's list of the files its last run wrote (names, one per line).
OUTPUTS_FILE = ".outputs"


def _listed(path: str) -> list[str]:
    try:
        with open(os.path.join(path, OUTPUTS_FILE), encoding="utf-8") as f:
            names = [n for n in f.read().splitlines() if n]
    except (OSError, UnicodeDecodeError):
        return []
    return [n for n in names if os.path.basename(n) == n and n not in (".", "..")]  # names in the folder only


def begin_outputs(path: str, outputs: Sequence[str] = ()) -> None:
    """Opens a results folder for a run that passed `output_dir` (with --force where results were there): creates
    it and removes the files of an earlier run (those it listed, `end_outputs`, and `outputs`), so that old and new
    results never sit side by side (an old plot beside a new table); files no run of the command wrote are never
    touched."""
    os.makedirs(path, exist_ok=True)
    for name in dict.fromkeys([*_listed(path), *outputs, OUTPUTS_FILE]):
        file = os.path.join(path, name)
        if os.path.isfile(file) or os.path.islink(file):
            os.remove(file)


def end_outputs(path: str, wrote: Sequence[str]) -> None:
    """Lists the files (paths or names in `path`) a finished run wrote there, for the next run's `begin_outputs`."""
    with written(os.path.join(path, OUTPUTS_FILE)) as f:
        f.write("".join(os.path.basename(w) + "\n" for w in wrote))


@contextlib.contextmanager
def written(path: str, mode: str = "w") -> Iterator:
    """An output file opened beside `path` and renamed onto it when the block ends without error (`replacing`): an
    interrupted or failed write never leaves a torn file that a rerun or a reader would trust."""
    with replacing(path) as staged, open(staged, mode) as f:
        yield f


@contextlib.contextmanager
def replacing(path: str, *, unless: Callable[[str], bool] | None = None) -> Iterator[str]:
    """The project's one way to write an output whole or not at all: yields a fresh path in the same folder (in a
    scratch folder of a unique name, so two processes writing the same output never share one) for the writer to
    create a file or a folder at; on success it is put in `path`'s place (a file by one atomic rename: a reader sees
    the old one or the new one; a folder, or over one, by renaming the old aside first, then removing it: never a
    merge of old and new), on any failure or Ctrl-C the partial output is removed and `path` is as it was. With
    `unless`, what is at `path` when the block ends is kept if `unless(path)` (a concurrent writer's equal output
    that won the race, which a reader may be using) and the new output dropped."""
    import shutil
    import tempfile

    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.partial-", dir=parent)
    staged = os.path.join(scratch, "out")
    try:
        yield staged
        if unless is not None and unless(path):
            return
        if not os.path.isdir(staged) and not os.path.isdir(path):
            os.replace(staged, path)
            return
        old = os.path.join(scratch, "old")
        if os.path.lexists(path):
            os.rename(path, old)
        try:
            os.rename(staged, path)
        except BaseException:
            if os.path.lexists(old):
                os.rename(old, path)  # the earlier output stays, never lost with the scratch folder
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


SETTINGS_FILE = "settings.json"


def settled(path: str, settings: Mapping, *, restart: bool = False, free: Sequence[str] = (),
            flag: str = "--workdir") -> None:
    """Makes a work folder know what it holds: the first run records `settings` (plain JSON data: the recipe and the
    flags that shape the work) in `path`/settings.json; a later run with other settings is refused in one line
    naming the first difference (its work would mix with theirs, or be silently reused), unless `restart`, which
    empties the folder and starts over. Keys in `free` (dotted, e.g. ``eagle.train.steps``) may change between runs
    (a longer schedule resumes)."""
    import json
    import shutil

    file = os.path.join(path, SETTINGS_FILE)
    settings = json.loads(json.dumps(settings, default=str))  # as stored: tuples are lists
    want = _flat(settings)
    if restart and os.path.isdir(path):
        shutil.rmtree(path)
    # Settings alone (a run that failed before any work, e.g. on a mistyped path) hold nothing to protect.
    work = os.path.isdir(path) and any(name != SETTINGS_FILE for name in os.listdir(path))
    if work and os.path.isfile(file):
        try:
            with open(file) as f:
                have = _flat(json.load(f))
        except (OSError, ValueError) as e:
            raise BadInput(f"{file} is unreadable ({first_line(e)}); pass --restart to start over") from None
        for key in sorted(set(want) | set(have)):
            if key in free or any(key.startswith(k + ".") for k in free):
                continue
            if want.get(key) != have.get(key):
                raise BadInput(f"{path} holds work made with {key}={have.get(key)!r}, this run asks "
                               f"{want.get(key)!r}: pass --restart to start over, or choose another {flag}")
    # A folder with work but no settings.json was made before work folders recorded them: it resumes as made with
    # this run's settings (as it always did), and is checked from now on.
    os.makedirs(path, exist_ok=True)
    with written(file) as f:
        json.dump(settings, f, indent=1, sort_keys=True)


def _flat(tree: Mapping, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def work_folder(path: str, flag: str = "--workdir") -> None:
    """Checks a work folder before any work: not a file, and writable (or creatable)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise BadInput(f"{flag} {path} exists and is not a folder")
    writable(path, flag)


def writable(folder: str, flag: str) -> None:
    """BadInput unless `folder` (or, where it does not exist yet, its nearest existing parent) takes a new file: a
    real probe (a temporary file, removed), since permission bits say nothing to root or about read-only mounts."""
    existing = os.path.abspath(folder)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise BadInput(f"{flag} {folder}: {existing} is a file, not a folder")
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise BadInput(f"{flag} {folder}: cannot write to {existing} ({e.strerror or type(e).__name__})") from None


def mesh_axes(text: str) -> dict[str, int]:
    """The argument type of ``--mesh AXIS=SIZE,...`` (`configs.sharding.parse_mesh`): a bad value is the parser's
    one-line error."""
    from configs import sharding

    try:
        return sharding.parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(first_line(e)) from None


def make_mesh(axes: dict[str, int]):
    """The mesh of a ``--mesh`` value over every device (of every host, after
    `configs.sharding.initialize_distributed`); sizes the devices do not fit are `BadInput`."""
    from configs import sharding

    with reported(ValueError):
        return sharding.make_mesh(**axes)


def use_compilation_cache(directory: str) -> None:
    """Keeps XLA executables in `directory` so that repeated runs skip compilation (unless the user or
    ``JAX_COMPILATION_CACHE_DIR`` already chose a folder). Every program is kept, not only those that took a second
    to compile (jax's default): a run's dozen small ones (loading, sampling set-up) cost half a second otherwise."""
    import jax

    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", directory)
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


# ---------------------------------------------------------------------------------------------------------------
# Configs: `--config NAME[:ARG]` and `--set key=value`.
# ---------------------------------------------------------------------------------------------------------------


def split_spec(spec: str) -> tuple[str, str | None]:
    """``NAME:ARG`` or ``FILE.py:ARG`` -> (NAME or FILE.py, ARG); without a colon the argument is None."""
    if ".py:" in spec:
        path, _, arg = spec.partition(".py:")
        return path + ".py", arg
    name, sep, arg = spec.partition(":")
    return name, (arg if sep else None)


def config_name(spec: str) -> str:
    """A name for the runs of a config: the module or file name, with its argument (``smollm2_eagle:answers6k`` ->
    ``smollm2_eagle_answers6k``)."""
    path, arg = split_spec(spec)
    name = os.path.splitext(os.path.basename(path))[0]
    return f"{name}_{arg}" if arg else name


def load_config(spec: str, package: str, expect: type | tuple[type, ...], overrides: Sequence[str] = ()):
    """The recipe `spec` names, validated: ``get_config()`` (``get_config(ARG)`` for ``NAME:ARG``) of a Python file
    (`spec` ends in .py) or of the module `<package>.<spec>`, a ConfigDict whose `kind` is the `KIND` of one of the
    `expect` classes (`configs.schema.Schema` dataclasses, such as `DraftRecipe`), with the ``--set`` `overrides`
    applied (`override`), built by that class's `from_config`. Anything that goes wrong is a `BadInput` naming the
    config or the key."""
    import ml_collections

    path, arg = split_spec(spec)
    if path.endswith(".py"):
        if not os.path.isfile(path):
            raise BadInput(f"config file {path} not found")
        name = f"_config_{abs(hash(os.path.abspath(path)))}"
        try:
            mod_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001  (a file that is not a config is bad input, whatever it raises)
            raise BadInput(f"cannot load config {spec}: {type(e).__name__}: {first_line(e)}") from None
    else:
        if not path.isidentifier():
            raise BadInput(f"unknown config {spec!r}: give a name in {package.replace('.', '/')}/ or a .py file")
        try:
            module = importlib.import_module(f"{package}.{path}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{path}":
                raise
            raise BadInput(f"unknown config {spec!r} (no {package.replace('.', '/')}/{path}.py)") from None
    if not callable(getattr(module, "get_config", None)):
        raise BadInput(f"config {spec!r} defines no get_config()")
    try:
        cfg = module.get_config() if arg is None else module.get_config(arg)
    except Exception as e:  # noqa: BLE001
        raise BadInput(f"config {spec!r}: get_config() failed: {type(e).__name__}: {first_line(e)}") from None
    kinds = expect if isinstance(expect, tuple) else (expect,)
    names = " or ".join(k.__name__ for k in kinds)
    is_mapping = isinstance(cfg, Mapping | ml_collections.ConfigDict)
    kind = cfg.get("kind") if is_mapping else None
    cls = next((k for k in kinds if kind is not None and k.KIND == kind), None)
    if cls is None:
        what = (type(cfg).__name__ if not is_mapping else f"a {kind!r} config" if kind is not None
                else f"a {type(cfg).__name__} without a kind")
        want = " or ".join(repr(k.KIND) for k in kinds)
        raise BadInput(f"config {spec!r} returns {what}, expected {names} (a ConfigDict of kind {want})")
    cfg = ml_collections.ConfigDict(cfg) if not isinstance(cfg, ml_collections.ConfigDict) else cfg
    try:
        out = cls.from_config(cfg)
    except (TypeError, ValueError) as e:
        raise BadInput(f"config {spec!r}: {first_line(e)}") from None
    for assignment in overrides:
        cfg = override(cfg, assignment, cls)
        try:
            out = cls.from_config(cfg)
        except (TypeError, ValueError) as e:  # a check of the dataclass (`__post_init__`)
            raise BadInput(f"--set {assignment.partition('=')[0]}: {first_line(e)}") from None
    return out


def override(config, assignment: str, cls: type):
    """A copy of the ConfigDict `config` with one field set: ``a.b.c=VALUE``, VALUE a Python literal (a bare word is
    a string), typed by the field of the dataclass `cls` it names (a group the recipe leaves out is added). Unknown
    keys and values of the wrong type are `BadInput`; `cls.from_config` checks the rest."""
    import ml_collections

    from configs import schema

    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise BadInput(f"--set expects KEY=VALUE, got {assignment!r}")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    try:
        hint = schema.field_type(cls, key)
    except ValueError as e:
        raise BadInput(first_line(e)) from None
    if schema.group_type(hint) is not None and value is not None:
        raise BadInput(f"--set {key}: a group of settings; set one of its fields ({key}.<field>=...)")
    try:
        value = schema.check(value, hint, key, text=True)
    except ValueError as e:
        raise BadInput(f"--set {first_line(e)}") from None
    out = copy.deepcopy(config)
    node = out
    *groups, last = key.split(".")
    for part in groups:
        if node.get(part) is None:
            node[part] = ml_collections.ConfigDict()
        node = node[part]
    if last in node:
        del node[last]  # a value of another type than the recipe's (an int where it wrote None, ...)
    node[last] = value
    return out
