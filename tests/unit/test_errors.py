"""One exception tree: every error preemptible raises on purpose is a ``PreemptibleError``,
defined in ``preemptible._errors``, exported from ``preemptible`` and drawn in the module's
docstring where it hangs."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest

import preemptible
from preemptible import _errors

SRC = Path(preemptible.__file__).parent
ERRORS = SRC / "_errors.py"


def tree_classes() -> dict[str, type[BaseException]]:
    return {
        name: obj
        for name, obj in vars(_errors).items()
        if isinstance(obj, type)
        and issubclass(obj, BaseException)
        and obj.__module__ == _errors.__name__
    }


def _base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def exception_classes_in_source() -> list[tuple[Path, str]]:
    """(file, class name) of every class in src/preemptible that derives, by name, from a
    built-in exception, from a class named ``...Error``/``...Exception`` (a library's) or
    from another exception class of the package: read with ast, so modules of optional
    extras (torch, Lightning) need not be importable."""
    classes: list[tuple[Path, str, list[str]]] = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = [b for b in (_base_name(base) for base in node.bases) if b]
                classes.append((path, node.name, bases))
    known = {
        name
        for name, obj in vars(builtins).items()
        if isinstance(obj, type) and issubclass(obj, BaseException)
    }
    found: set[tuple[Path, str]] = set()
    grew = True
    while grew:
        grew = False
        for path, name, bases in classes:
            if (path, name) not in found and any(
                base in known or base.endswith(("Error", "Exception")) for base in bases
            ):
                found.add((path, name))
                known.add(name)
                grew = True
    return sorted(found)


def test_the_source_scan_finds_the_tree() -> None:
    scanned = {name for path, name in exception_classes_in_source() if path == ERRORS}
    assert scanned == set(tree_classes())


@pytest.mark.parametrize(
    ("path", "name"),
    exception_classes_in_source(),
    ids=lambda x: x if isinstance(x, str) else str(x.relative_to(SRC)),
)
def test_every_public_exception_class_lives_in_the_tree(path: Path, name: str) -> None:
    if name.startswith("_"):
        # private control flow: it must be caught in the module that raises it
        caught = [
            node
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.ExceptHandler)
            and node.type is not None
            and name in {_base_name(n) for n in ast.walk(node.type) if isinstance(n, ast.expr)}
        ]
        assert caught, f"{name} in {path.relative_to(SRC)} is private but never caught there"
        assert name not in preemptible.__all__
        return
    assert path == ERRORS, (
        f"{name} is defined in {path.relative_to(SRC)}; define it in preemptible/_errors.py"
    )


@pytest.mark.parametrize("name", sorted(tree_classes()))
def test_every_class_of_the_tree_is_a_preemptible_error_and_exported(name: str) -> None:
    cls = tree_classes()[name]
    assert issubclass(cls, preemptible.PreemptibleError)
    assert name in preemptible.__all__
    assert getattr(preemptible, name) is cls


def test_every_exported_exception_is_in_the_tree() -> None:
    exported = {
        name
        for name in preemptible.__all__
        if isinstance(getattr(preemptible, name), type)
        and issubclass(getattr(preemptible, name), BaseException)
    }
    assert exported == set(tree_classes())


def drawing() -> dict[str, tuple[str | None, set[str]]]:
    """The docstring's drawing: each class's parent and the extra bases in parentheses."""
    doc = _errors.__doc__ or ""
    drawn: dict[str, tuple[str | None, set[str]]] = {}
    stack: list[tuple[int, str]] = []  # (column, name) of the open ancestors
    for line in doc.splitlines():
        m = re.match(r"^(?P<lead>[ │├└─]*)(?P<name>[A-Z]\w+)(?: \((?P<extra>[\w, ]+)\))?  ", line)
        if not m or not line.startswith("    "):
            continue
        column = len(m.group("lead"))
        while stack and stack[-1][0] >= column:
            stack.pop()
        parent = stack[-1][1] if stack else None
        extra = {e.strip() for e in (m.group("extra") or "").split(",") if e.strip()}
        drawn[m.group("name")] = (parent, extra)
        stack.append((column, m.group("name")))
    return drawn


def test_the_docstring_draws_every_class_where_it_hangs() -> None:
    drawn = drawing()
    classes = tree_classes()
    assert set(drawn) == set(classes)
    for name, cls in classes.items():
        parent, extra = drawn[name]
        first, *others = cls.__bases__
        if name == "PreemptibleError":
            assert parent is None and first is Exception
        else:
            assert parent == first.__name__, f"{name} is drawn under {parent}, not {first}"
        assert extra == {base.__name__ for base in others}, name


def test_the_value_errors_stay_value_errors() -> None:
    for cls in (preemptible.ConfigError, preemptible.UnreadableField, preemptible.NoticeError):
        assert issubclass(cls, ValueError)
