"""The test suite's own layout: what tests share lives in tests/support (or tests/conftest.py),
and no test module imports from another one.

Importing a ``test_*.py`` module from another runs its module-level code twice under two
names, makes pytest collect the imported fixtures as if they were the importer's, and ties a
test file's helpers to another file's tests. Shared fixtures are registered once, through
``pytest_plugins`` in tests/conftest.py, and never defined again in a test module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tests.conftest
from tests.conftest import ROOT

TESTS = ROOT / "tests"
SUPPORT = TESTS / "support"


def _python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _imported(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every module (and ``from M import name``) a file imports."""
    package = module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..support import y
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _is_test_module(name: str) -> bool:
    return name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_")


def test_no_test_module_imports_another_test_module() -> None:
    offenders = []
    for path in _python_files():
        module = _module_name(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in _imported(tree, module):
            if _is_test_module(name) and name != module:
                offenders.append(f"{path.relative_to(ROOT)}:{line}: imports {name}")
    assert not offenders, (
        "a test module imports another; move what they share to tests/support:\n"
        + "\n".join(offenders)
    )


def test_the_check_sees_every_way_of_importing_a_test_module() -> None:
    source = (
        "import tests.unit.test_a\n"
        "from tests.integration.test_b import helper\n"
        "from tests.integration import test_c\n"
        "from .test_d import fixture\n"
        "def f():\n    from tests.unit import test_e\n"
        "from tests.support.metadata import MetadataServer\n"
        "from tests.conftest import wait_for\n"
    )
    names = _imported(ast.parse(source), "tests.integration.test_x")
    flagged = sorted({name for _, name in names if _is_test_module(name)})
    assert flagged == [
        "tests.integration.test_b",
        "tests.integration.test_c",
        "tests.integration.test_d",
        "tests.unit.test_a",
        "tests.unit.test_e",
    ]


def _fixtures(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if ast.unparse(target) in ("pytest.fixture", "fixture"):
                    out.append((node.lineno, node.name))
    return out


def test_the_shared_fixtures_are_registered_once_and_defined_once() -> None:
    support = sorted(p for p in SUPPORT.glob("*.py") if p.name != "__init__.py")
    shared = {name: p for p in support for _, name in _fixtures(ast.parse(p.read_text()))}
    assert {"metadata_server", "clean_platform_env", "signal_handlers", "sbatch", "pg_server"} <= (
        set(shared)
    )
    registered = set(tests.conftest.pytest_plugins)
    with_fixtures = {_module_name(shared[name]) for name in shared}
    assert with_fixtures <= registered, f"not in pytest_plugins: {with_fixtures - registered}"
    again = []
    for path in _python_files():
        if path.parent == SUPPORT:
            continue
        for line, name in _fixtures(ast.parse(path.read_text())):
            if name in shared:
                again.append(f"{path.relative_to(ROOT)}:{line}: fixture {name} (shared: use it)")
    assert not again, "\n".join(again)


def _helpers(tree: ast.Module) -> dict[str, str]:
    """A test module's own helpers (its functions and classes other than tests and fixtures),
    each by the text of its signature and body, its name and docstring left out."""
    found = {}
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if node.name.startswith(("test_", "Test")) or any(
            "fixture" in ast.dump(d) for d in getattr(node, "decorator_list", [])
        ):
            continue  # a fixture binds its own module's names (its REFERENCE, its class)
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        args = "" if isinstance(node, ast.ClassDef) else ast.dump(node.args)
        found[node.name] = args + "".join(ast.dump(statement) for statement in body)
    return found


def test_no_helper_is_defined_in_two_test_modules() -> None:
    """A helper two test modules need lives in tests/support: a copy drifts from its original."""
    seen: dict[str, str] = {}
    copies = []
    for path in _python_files():
        if not path.name.startswith("test_"):
            continue
        for name, text in _helpers(ast.parse(path.read_text())).items():
            where = f"{path.relative_to(ROOT)}::{name}"
            if text in seen:
                copies.append(f"{where} repeats {seen[text]}")
            seen.setdefault(text, where)
    assert not copies, "\n".join(copies)


def test_the_copy_finder_finds_a_copy_under_another_name() -> None:
    one = _helpers(ast.parse("def a(x: int) -> int:\n    '''A.'''\n    return x + 1\n"))
    two = _helpers(ast.parse("def b(x: int) -> int:\n    return x + 1\n"))
    assert one["a"] == two["b"]
