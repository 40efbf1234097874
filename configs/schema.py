"""Frozen dataclasses as the schema of recipes that are plain data.

A recipe under `configs/` is data, as in big_vision: `get_config()` returns an `ml_collections.ConfigDict` of
numbers, strings, tuples and nested ConfigDicts, with a `kind` field naming what it describes. The package that
consumes it owns the schema: a frozen dataclass deriving from `Schema` (its `KIND` is the recipe's `kind`), built by
`Cls.from_config(config)`. A group may give only some of its fields; the others keep the value of the field's
default group (or the dataclass's defaults). Unknown keys, values of the wrong type, floats that are not finite and
numbers outside a field's `Range` (``steps: Annotated[int, Range(1)] = 100``) are a one-line `ValueError` naming the
key; the dataclass's own checks (`__post_init__`) run as usual.

    recipe = DraftRecipe.from_config(tiny.get_config())

`configs.cli.load_config` does the same for ``--config NAME[:ARG]`` and applies ``--set key=value`` on the way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar

import ml_collections


@dataclasses.dataclass(frozen=True)
class Range:
    """Bounds (inclusive; None: unbounded) of a numeric config field, as `Annotated` metadata:
    ``steps: Annotated[int, Range(1)] = 100``. Also the command line's check for numeric flags (`configs.cli`)."""

    lo: float | None = None
    hi: float | None = None

    def check(self, value: float, key: str) -> None:
        """`ValueError` naming `key` unless lo ≤ value ≤ hi."""
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            bounds = (f"between {self.lo:g} and {self.hi:g}" if self.lo is not None and self.hi is not None
                      else f"≥ {self.lo:g}" if self.lo is not None else f"≤ {self.hi:g}")
            raise ValueError(f"{key} must be {bounds}, got {value!r}")


#: The common ranges: counts that may be zero (a feature off), and counts that may not.
COUNT = Range(0)
POSITIVE = Range(1)


class Schema:
    """Mixin of a frozen dataclass that recipes describe: `KIND` is their `kind` field."""

    KIND: ClassVar[str] = ""

    @classmethod
    def from_config(cls, config: Mapping | ml_collections.ConfigDict):
        """The dataclass a recipe's ConfigDict (or a plain dict) describes; `ValueError` naming the bad key."""
        return build(cls, config)


def build(cls: type, config: Any, *, key: str = "", base: Any = None):
    """`cls` (a dataclass) from the mapping `config`: its fields, each checked against its type hint; fields it
    does not give are `base`'s (a default instance) or the class's defaults. At the top level (`key` empty) a `kind`
    key must be `cls.KIND`."""
    if not _is_mapping(config):
        raise ValueError(f"{key or cls.__name__}: expected a group of settings ({cls.__name__}), got {config!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = _hints(cls)
    kwargs = {}
    for name, value in config.items():
        path = f"{key}.{name}" if key else name
        if name == "kind" and not key and "kind" not in fields:
            if value != getattr(cls, "KIND", None):
                raise ValueError(f"kind: {value!r} is not {getattr(cls, 'KIND', None)!r} ({cls.__name__})")
            continue
        if name not in fields:
            raise ValueError(f"unknown config key {path!r} (no field {name!r} in {cls.__name__})")
        kwargs[name] = check(value, hints[name], path, base=_default(fields[name], base))
    for name, f in fields.items():
        if name in kwargs:
            continue
        if base is not None:
            kwargs[name] = getattr(base, name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            path = f"{key}.{name}" if key else name
            raise ValueError(f"missing config key {path!r} ({cls.__name__} has no default for it)")
    return cls(**kwargs)


def check(value: Any, hint: Any, key: str, *, base: Any = None, text: bool = False) -> Any:
    """`value` as the type `hint` (an int where a float is expected becomes a float, a list where a tuple is, a
    tuple); a group (a mapping) becomes its dataclass over `base`. `text`: also the command line's spellings, a
    comma-separated word list for a tuple and true / false for a bool. `ValueError` naming `key` otherwise."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        value = check(value, args[0], key, base=base, text=text)
        for meta in args[1:]:
            if isinstance(meta, Range) and value is not None:
                meta.check(value, key)
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arm in (a for a in args if a is not type(None)):
            try:
                return check(value, arm, key, base=base if dataclasses.is_dataclass(arm) else None, text=text)
            except ValueError:
                pass
        raise ValueError(f"{key}: {value!r} is not a {_name(hint)}")
    if origin is typing.Literal:
        if not any(value == a and type(value) is type(a) for a in args):
            raise ValueError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is tuple:
        if text and isinstance(value, str):  # a bare word list: --set kinds=eagle,lm
            value = tuple(v.strip() for v in value.split(",") if v.strip())
        elif text and not isinstance(value, tuple | list):
            value = (value,)
        if not isinstance(value, tuple | list):
            raise ValueError(f"{key}: expected a tuple, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(check(v, args[0], key, text=text) for v in value)
        if len(args) != len(value):
            raise ValueError(f"{key}: expected {len(args)} values, got {len(value)}")
        return tuple(check(v, a, key, text=text) for v, a in zip(value, args, strict=True))
    if origin is dict:
        if not _is_mapping(value):
            raise ValueError(f"{key}: expected a mapping, got {value!r}")
        return {check(k, args[0], key, text=text): check(v, args[1], f"{key}.{k}", text=text)
                for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        return build(hint, value, key=key, base=base)
    if hint is float and type(value) is int:
        return float(value)
    if hint is bool and text and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(hint, type):  # Any, or a hint this schema does not read: the dataclass checks it, if at all
        return value
    ok = type(value) is hint if hint in (int, float, str, bool) else isinstance(value, hint)
    if not ok:
        raise ValueError(f"{key}: expected {_name(hint)}, got {value!r}")
    if hint is float and not math.isfinite(value):  # no setting means NaN or ∞; they only poison what follows
        raise ValueError(f"{key}: expected a finite number, got {value!r}")
    return value


def field_type(cls: type, key: str) -> Any:
    """The type hint of the dotted field `key` of the dataclass `cls` (through nested groups); `ValueError` for a
    key that names no field."""
    node: Any = cls
    for part in key.split("."):
        group = group_type(node)
        if group is None:
            raise ValueError(f"unknown config key {key!r}")
        names = {f.name for f in dataclasses.fields(group) if f.init}
        if part not in names:
            raise ValueError(f"unknown config key {key!r} (no field {part!r} in {group.__name__})")
        node = _hints(group)[part]
    return node


def group_type(hint: Any) -> type | None:
    """The dataclass of a group's type hint (also of `Group | None`), else None."""
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        return arms[0] if len(arms) == 1 else None
    return None


def to_config(obj: Any) -> ml_collections.ConfigDict:
    """The ConfigDict of a dataclass instance (every field; `kind` from its `KIND`): `from_config` gives it back."""
    out = ml_collections.ConfigDict()
    if getattr(obj, "KIND", ""):
        out.kind = obj.KIND
    for f in dataclasses.fields(obj):
        if f.init:
            out[f.name] = _plain(getattr(obj, f.name))
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _is_mapping(value: Any) -> bool:
    return isinstance(value, Mapping | ml_collections.ConfigDict)


def _default(f: dataclasses.Field, base: Any) -> Any:
    """The value a group field starts from: `base`'s, else the field's default."""
    if base is not None:
        return getattr(base, f.name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) if isinstance(hint, type) else str(hint)
