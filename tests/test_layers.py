"""The import contract: layers import only downward, the two papers meet only in the shared layer (`configs`), no
library module imports a command-line module or another module's private names, and no modules import each other.

Every import is read from the source (`ast`), including those inside functions, so a lazy import is held to the
same rules as a top-level one. `violations` is checked first on small hand-made trees that break each rule, so the
contract is shown to fail, then on the project itself.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Mapping

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("configs", "cpu_kernels", "pallas_kernels", "sage_jax", "pgla_jax")

#: Layers, lowest first: a module may import its own layer and the ones below it. A module belongs to the layer of
#: its longest listed prefix. The shared layer and the kernels sit under both papers.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("configs",),
    ("cpu_kernels", "pallas_kernels"),
    # SAGE: data of its own, models, readers and writers, decoding, training, the engine, the benchmark library.
    ("sage_jax.prompts", "sage_jax.chat"),
    ("sage_jax.models",),
    ("sage_jax.io",),
    ("sage_jax.decoding",),
    ("sage_jax.training",),
    ("sage_jax.engine", "sage_jax.executables"),
    ("sage_jax.bench",),
    # PGLA: configs and victims, data and federated learning, attacks and denoisers, the experiment.
    ("pgla_jax.config", "pgla_jax.models", "pgla_jax.codec", "pgla_jax.metrics", "pgla_jax.patches"),
    ("pgla_jax.data", "pgla_jax.tfds_sources", "pgla_jax.fl", "pgla_jax.protections"),
    ("pgla_jax.inversion", "pgla_jax.denoise"),
    ("pgla_jax.experiment",),
)

#: Command-line modules (and each package's public face, `__init__`): they may import any library module, and no
#: library module may import them.
TOP = frozenset({
    "sage_jax", "sage_jax.generate", "sage_jax.convert", "sage_jax.train_draft", "sage_jax.train_vlm",
    "sage_jax.build_datastore", "sage_jax.evaluate_draft", "sage_jax.lowering", "sage_jax.bench.__main__",
    "pgla_jax", "pgla_jax.attack", "pgla_jax.train_denoiser", "pgla_jax.prepare_data",
})
CLIS = TOP - {"sage_jax", "pgla_jax"}


def project_sources(root: str = ROOT) -> dict[str, str]:
    """Module name -> source of every module of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(root, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), root)[:-3].replace(os.sep, ".")
                    with open(os.path.join(d, f), encoding="utf-8") as fh:
                        out[rel.removesuffix(".__init__")] = fh.read()
    return out


def _package(module: str, modules: Mapping[str, str]) -> str:
    """The package a module's relative imports are resolved in."""
    return module if any(m.startswith(module + ".") for m in modules) else module.rpartition(".")[0]


def imports(module: str, source: str, modules: Mapping[str, str]) -> list[tuple[str, str | None, int]]:
    """(imported module, the private name taken from it or None, line) for every import of a project module, and
    every `alias._name` attribute read through a module bound by an import."""
    tree = ast.parse(source)
    out: list[tuple[str, str | None, int]] = []
    bound: dict[str, str] = {}  # local name -> project module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES:
                    out.append((a.name, None, node.lineno))
                    if a.asname:
                        bound[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = _package(module, modules).split(".")
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            if base.split(".")[0] not in PACKAGES:
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in modules:  # `from pkg import submodule`
                    out.append((sub, None, node.lineno))
                    bound[a.asname or a.name] = sub
                else:
                    private = a.name if a.name.startswith("_") and not a.name.startswith("__") else None
                    out.append((base, private, node.lineno))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            out.append((bound[node.value.id], node.attr, node.lineno))
    return out


def layer_of(module: str) -> int | None:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


def _paper(module: str) -> str | None:
    top = module.split(".")[0]
    return top if top in ("sage_jax", "pgla_jax") else None


def violations(modules: Mapping[str, str]) -> list[str]:
    """Every broken rule, one line each (empty when the tree keeps the contract)."""
    out = []
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for m, src in sorted(modules.items()):
        for target, private, line in imports(m, src, modules):
            if target not in modules:
                # `from pkg import name` of a name defined in pkg/__init__, or a module outside this tree
                target = next((p for p in _prefixes(target) if p in modules), target)
            where = f"{m}:{line}"
            if private and target != m:
                out.append(f"{where} takes the private name {private} of {target}")
            if target == m or target not in modules:
                continue
            edges[m].add(target)
            if m.split(".")[0] == "configs" and target.split(".")[0] != "configs":
                out.append(f"{where} imports {target}: the shared layer imports no package above it")
            if _paper(m) and _paper(target) and _paper(m) != _paper(target):
                out.append(f"{where} imports {target}: the two papers meet only in the shared layer")
            if target in CLIS:
                out.append(f"{where} imports the command-line module {target}")
            if m in TOP:
                continue
            lm, lt = layer_of(m), layer_of(target)
            if target in TOP:
                continue  # reported above (a CLI) or a package's public face: never imported from below
            if lm is not None and lt is not None and lt > lm and _paper(m) == _paper(target):
                out.append(f"{where} imports {target}, a higher layer ({LAYERS[lt][0]} above {LAYERS[lm][0]})")
            if lm is not None and lt is not None and lt > lm and _paper(target) and not _paper(m) and \
                    m.split(".")[0] != "configs":
                out.append(f"{where} imports {target}: the kernels import no paper")
    for a in sorted(edges):
        for b in sorted(edges[a]):
            if a < b and a in edges.get(b, ()):
                out.append(f"{a} and {b} import each other")
    return list(dict.fromkeys(out))


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def test_every_module_has_a_layer():
    modules = project_sources()
    assert len(modules) > 100
    missing = sorted(m for m in modules if layer_of(m) is None and m not in TOP)
    assert not missing, f"modules outside every layer: {missing}"


BASE = {
    "configs": "", "configs.sharding": "import jax\n",
    "sage_jax": "from sage_jax.engine import Engine\n",
    "sage_jax.models": "", "sage_jax.models.decoder": "from configs import sharding\n",
    "sage_jax.io": "", "sage_jax.io.loader": "from sage_jax.models import decoder\n",
    "sage_jax.decoding": "", "sage_jax.decoding.tree": "",
    "sage_jax.engine": "from sage_jax.io import loader\nfrom sage_jax.decoding import tree\n",
    "sage_jax.generate": "from sage_jax.engine import Engine\n",
    "pgla_jax": "", "pgla_jax.data": "from configs import sharding\n",
}


@pytest.mark.parametrize("module, source, needle", [
    ("sage_jax.models.decoder", "from sage_jax.io import loader\n", "a higher layer"),
    ("sage_jax.models.decoder", "def f():\n    from sage_jax.engine import Engine\n", "a higher layer"),
    ("sage_jax.io.loader", "from sage_jax.generate import main\n", "command-line module"),
    ("sage_jax.decoding.tree", "from pgla_jax import data\n", "the two papers"),
    ("configs.sharding", "from sage_jax.models import decoder\n", "shared layer imports no package"),
    ("sage_jax.io.loader", "from sage_jax.models.decoder import _private\n", "private name _private"),
    ("sage_jax.io.loader", "from sage_jax.models import decoder as d\nx = d._helper\n", "private name _helper"),
    ("sage_jax.decoding.tree", "from sage_jax.engine import Engine\n", "a higher layer"),
    ("sage_jax.models.decoder", "from . import layers\n", "import each other"),
])
def test_the_contract_fails_on_a_bad_import(module, source, needle):
    modules = dict(BASE)
    assert violations(modules) == []
    modules[module] = source
    if needle == "import each other":  # decoder -> layers -> decoder
        modules["sage_jax.models.layers"] = "from sage_jax.models import decoder\n"
    found = violations(modules)
    assert any(needle in v for v in found), found


def test_the_project_keeps_the_contract():
    found = violations(project_sources())
    assert not found, "\n" + "\n".join(found)
