"""The command-line contract of every entry point of both papers.

A mistake the user can fix (a missing file, a flag out of range, a config that is not one) is reported as one line
``error: ...`` on stderr with exit code 2, never a traceback; a real bug still raises. Entry points are written as::

    def main(argv=None) -> int:
        return cli.run(_main, argv)          # _main(argv) raises cli.BadInput for the user's mistakes

    with cli.reported(OSError, ValueError):  # library errors that are the user's input become BadInput
        model = load(path)

Configs (``--config``) are Python files or named modules of a config package, each defining ``get_config()`` that
returns a frozen dataclass; ``--set a.b=value`` overrides a field of it (`override`).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any

EXIT_BAD_INPUT = 2


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


def run(body: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """Calls `body(argv)`; a `BadInput` becomes ``error: <one line>`` on stderr and exit code 2."""
    try:
        return body(argv) or 0
    except BadInput as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT


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
    ``JAX_COMPILATION_CACHE_DIR`` already chose a folder)."""
    import jax

    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", directory)


# ---------------------------------------------------------------------------------------------------------------
# Configs: `--config NAME_OR_FILE` and `--set key=value`.
# ---------------------------------------------------------------------------------------------------------------


def load_config(spec: str, package: str, expect: type | tuple[type, ...]):
    """`get_config()` of a Python file (`spec` ends in .py) or of the module `<package>.<spec>`, checked to be an
    `expect` instance. Anything that goes wrong is a `BadInput` naming the file."""
    if spec.endswith(".py"):
        if not os.path.isfile(spec):
            raise BadInput(f"config file {spec} not found")
        name = f"_config_{abs(hash(os.path.abspath(spec)))}"
        try:
            mod_spec = importlib.util.spec_from_file_location(name, spec)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001  (a file that is not a config is bad input, whatever it raises)
            raise BadInput(f"cannot load config {spec}: {type(e).__name__}: {first_line(e)}") from None
    else:
        if not spec.isidentifier():
            raise BadInput(f"unknown config {spec!r}: give a name in {package.replace('.', '/')}/ or a .py file")
        try:
            module = importlib.import_module(f"{package}.{spec}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{spec}":
                raise
            raise BadInput(f"unknown config {spec!r} (no {package.replace('.', '/')}/{spec}.py)") from None
    if not callable(getattr(module, "get_config", None)):
        raise BadInput(f"config {spec!r} defines no get_config()")
    try:
        cfg = module.get_config()
    except Exception as e:  # noqa: BLE001
        raise BadInput(f"config {spec!r}: get_config() failed: {type(e).__name__}: {first_line(e)}") from None
    kinds = expect if isinstance(expect, tuple) else (expect,)
    if not isinstance(cfg, kinds):
        raise BadInput(f"config {spec!r} returns {type(cfg).__name__}, expected "
                       f"{' or '.join(k.__name__ for k in kinds)}")
    return cfg


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """`value` (a Python literal) as the field type `hint`; BadInput when it is not one."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arm in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arm, key)
            except BadInput:
                pass
        raise BadInput(f"--set {key}: {value!r} is not a {hint}")
    if origin is typing.Literal:
        if value not in args:
            raise BadInput(f"--set {key}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is tuple:
        if isinstance(value, str):  # a bare word list: --set kinds=eagle,lm
            value = tuple(v.strip() for v in value.split(",") if v.strip())
        elif not isinstance(value, tuple | list):
            value = (value,)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], key) for v in value)
        if len(args) != len(value):
            raise BadInput(f"--set {key}: expected {len(args)} values, got {len(value)}")
        return tuple(_coerce(v, a, key) for v, a in zip(value, args))
    if hint is float and type(value) is int:
        return float(value)
    if hint is bool and isinstance(value, str) and value.lower() in ("true", "false"):  # as a shell user writes it
        return value.lower() == "true"
    if dataclasses.is_dataclass(hint):
        raise BadInput(f"--set {key}: a group of settings; set one of its fields ({key}.<field>=...)")
    ok = type(value) is hint if hint in (int, float, str, bool) else (not isinstance(hint, type)
                                                                      or isinstance(value, hint))
    if not ok:
        raise BadInput(f"--set {key}: expected {getattr(hint, '__name__', hint)}, got {value!r}")
    return value


def override(cfg, assignment: str):
    """`cfg` (a frozen dataclass) with one field replaced: ``a.b.c=VALUE``, VALUE a Python literal (a bare word is
    a string). Unknown keys and values of the wrong type are `BadInput`."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise BadInput(f"--set expects KEY=VALUE, got {assignment!r}")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw

    def replace(node, parts: list[str]):
        if not dataclasses.is_dataclass(node):
            raise BadInput(f"unknown config key {key!r}")
        fields = {f.name: f for f in dataclasses.fields(node)}
        if parts[0] not in fields:
            raise BadInput(f"unknown config key {key!r} (no field {parts[0]!r} in {type(node).__name__})")
        if len(parts) > 1:
            new = replace(getattr(node, parts[0]), parts[1:])
        else:
            hint = typing.get_type_hints(type(node))[parts[0]]
            new = _coerce(value, hint, key)
        try:
            return dataclasses.replace(node, **{parts[0]: new})
        except (TypeError, ValueError) as e:  # a __post_init__ check of the config
            raise BadInput(f"--set {key}: {first_line(e)}") from None

    return replace(cfg, key.split("."))
