"""`python -m sage_jax.train_draft --config configs/sage/<name>.py [--workdir DIR] [--set key=value ...]`

Builds self-distillation data with the target and trains the drafts of the config (an EAGLE head and/or a small
LM); see `sage_jax/draft/pipeline.py` for the work-directory layout. Rerunning resumes. Bad input: one line
`error: ...` on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import sys


class BadInput(ValueError):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sage_jax.train_draft", description=__doc__.split("\n\n")[1])
    p.add_argument("--config", required=True, help="a Python file with get_config(), or a name under configs/sage")
    p.add_argument("--workdir", default=None, help="output directory (default: runs/<config name>)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set eagle.train.steps=10 (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    return p.parse_args(argv)


def config_path(spec: str) -> str:
    if os.path.isfile(spec):
        return spec
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "sage")
    cand = os.path.join(here, spec if spec.endswith(".py") else spec + ".py")
    if os.path.isfile(cand):
        return cand
    raise BadInput(f"config {spec!r} not found (a .py file with get_config(), or a name in {here})")


def load_config(spec: str, overrides: list[str]):
    path = config_path(spec)
    mod_spec = importlib.util.spec_from_file_location(f"_sage_draft_config_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(mod)
        cfg = mod.get_config()
    except Exception as e:  # noqa: BLE001  (a broken config file is bad input)
        raise BadInput(f"cannot load config {path}: {type(e).__name__}: {e}") from None
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise BadInput(f"--set expects KEY=VALUE, got {item!r}")
        node, *_ = [cfg]
        parts = key.split(".")
        for part in parts[:-1]:
            if part not in node:
                raise BadInput(f"unknown config key {key!r}")
            node = node[part]
        if parts[-1] not in node:
            raise BadInput(f"unknown config key {key!r}")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        old = node[parts[-1]]
        if isinstance(old, bool) != isinstance(value, bool) or (
                isinstance(old, int | float) and not isinstance(value, int | float)):
            raise BadInput(f"--set {key}: expected a value like {old!r}, got {raw!r}")
        if isinstance(old, float) and isinstance(value, int):
            value = float(value)
        try:
            node[parts[-1]] = value
        except (TypeError, AttributeError) as e:
            raise BadInput(f"--set {key}: {e}") from None
    return cfg, path


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        cfg, path = load_config(args.config, args.set)
        workdir = args.workdir or os.path.join("runs", os.path.splitext(os.path.basename(path))[0])
        if os.path.exists(workdir) and not os.path.isdir(workdir):
            raise BadInput(f"--workdir {workdir} exists and is not a directory")
        import jax

        if not jax.config.jax_compilation_cache_dir:
            from sage_jax.io.load import cache_dir

            jax.config.update("jax_compilation_cache_dir", os.path.join(cache_dir(), "jax"))
        from sage_jax.draft import pipeline

        try:
            summary = pipeline.run(cfg, workdir, progress=not args.no_progress)
        except (ValueError, FileNotFoundError) as e:
            raise BadInput(str(e)) from None
        print(json.dumps(summary, default=str))
    except BadInput as e:
        print(f"error: {(str(e).splitlines() or ['bad input'])[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
