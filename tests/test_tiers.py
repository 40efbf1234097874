"""The test tiers say what they are (tests/README.md): a test that starts one of the project's command lines in a
subprocess (`python -m sage_jax.…` / `python -m pgla_jax.…`) is an end-to-end run and is marked `integration` (or
`slow`), never left in the default tier. Read from the test files' syntax trees, without importing them."""

import ast
import pathlib
import tomllib

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent
PACKAGES = ("sage_jax.", "pgla_jax.")
TIERS = {"integration", "slow"}


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _calls_subprocess(node: ast.AST) -> bool:
    """A call of `subprocess.<anything>` (run, Popen, check_output, ...) somewhere under `node`."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
               and n.func.value.id == "subprocess" for n in ast.walk(node))


def _spawns_cli(fn: ast.FunctionDef, helpers: set[str]) -> bool:
    """`fn` (its decorators included: the module may come from a parametrize list) runs `python -m <our module>`
    itself, or calls a helper of its file that does."""
    strings = _strings(fn)
    if _calls_subprocess(fn) and "-m" in strings and any(s.startswith(PACKAGES) for s in strings):
        return True
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in helpers
               for n in ast.walk(fn))


def _marks(decorators: list[ast.expr]) -> set[str]:
    """The names of `pytest.mark.NAME` (called or not) among `decorators`, or in a `pytestmark` value."""
    out = set()
    for d in decorators:
        for n in ast.walk(d):
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"
                    and isinstance(n.value.value, ast.Name) and n.value.value.id == "pytest"):
                out.add(n.attr)
    return out


def cli_tests(path: pathlib.Path) -> dict[str, set[str]]:
    """{test name: its marks (the module's `pytestmark` included)} for the tests of `path` that spawn a CLI."""
    tree = ast.parse(path.read_text(), str(path))
    module_marks = _marks([n.value for n in tree.body if isinstance(n, ast.Assign)
                           and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)])
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    helpers: set[str] = set()
    for _ in range(3):  # a helper may call another helper
        helpers |= {f.name for f in funcs if not f.name.startswith("test") and _spawns_cli(f, helpers)}
    return {f.name: module_marks | _marks(f.decorator_list) for f in funcs
            if f.name.startswith("test") and _spawns_cli(f, helpers)}


def test_tests_that_spawn_a_cli_are_not_in_the_default_tier():
    found, unmarked = 0, []
    for path in sorted(TESTS.rglob("test_*.py")):
        for name, marks in cli_tests(path).items():
            found += 1
            if not marks & TIERS:
                unmarked.append(f"{path.relative_to(ROOT)}::{name}")
    assert found >= 10, f"found only {found} tests that spawn a CLI: the search itself is broken"
    assert not unmarked, "spawns a CLI in a subprocess; mark it @pytest.mark.integration:\n" + "\n".join(unmarked)


def test_the_finder_sees_helpers_parametrized_modules_and_module_marks(tmp_path):
    src = '''
import subprocess, sys
import pytest
def _cli(*a):
    return subprocess.run([sys.executable, "-m", "sage_jax.generate", *a])
def _twice(*a):
    return _cli(*a), _cli(*a)
def test_helper():
    _twice("--json")
@pytest.mark.integration
def test_marked():
    _cli()
@pytest.mark.parametrize("module", ["pgla_jax.attack"])
def test_param(module):
    subprocess.run([sys.executable, "-m", module])
def test_script():
    subprocess.run([sys.executable, "-c", "import sage_jax.generate"])
def test_in_process():
    from sage_jax import generate
    generate.main(["--json"])
'''
    path = tmp_path / "test_x.py"
    path.write_text(src)
    assert cli_tests(path) == {"test_helper": set(), "test_marked": {"integration"}, "test_param": {"parametrize"}}
    path.write_text(src.replace("import pytest\n", "import pytest\npytestmark = [pytest.mark.integration]\n"))
    assert all("integration" in m for m in cli_tests(path).values())


def test_the_default_tier_leaves_out_slow_and_integration():
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "-m 'not slow and not integration'" in ini["addopts"]
    assert {m.split(":")[0] for m in ini["markers"]} >= TIERS
    assert (TESTS / "README.md").is_file()


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_the_tiers_are_documented(tier):
    text = (TESTS / "README.md").read_text()
    assert f"-m {tier}" in text
