"""Each public name has one home and is exported from one place (trio's
``test_core_is_properly_reexported`` is the model): a public package's ``__all__`` imports each
name from the module that defines it, an object is exported by one public package (the kit's
documented names aside), and no private module re-exports another's names (``X as X``)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import preemptible

SRC = Path(preemptible.__file__).parent

PUBLIC = [
    "preemptible",
    "preemptible.lightning",
    "preemptible.transformers",
    "preemptible.accelerate",
    "preemptible.keras",
    "preemptible.frontend",
    "preemptible.trackers",
    "preemptible.notices",
    "preemptible.data",
    "preemptible.supervisor",
    "preemptible.cli",
    "preemptible.doctor",
    "preemptible.demo",
    "preemptible.sweeps.spec",
    "preemptible.sweeps.store",
    "preemptible.sweeps.agent",
    "preemptible.sweeps.status",
    "preemptible.sweeps.web",
]

# The kit offers a front end every name it needs (DESIGN.md): these are also preemptible's own.
KIT_SHARES = {
    "Checkpoint",
    "CheckpointError",
    "CheckpointLoadError",
    "CheckpointLockError",
    "CheckpointSaveError",
    "CheckpointStore",
    "ConfigError",
    "Notice",
    "PreemptibleError",
    "TerminationConfig",
}

# Left for the work that is changing these folders now (the stop orchestrator, the save path).
ALIASES_LEFT: dict[str, set[str]] = {}


def _init(package: str) -> Path:
    folder = SRC.parent.joinpath(*package.split("."))
    return folder / "__init__.py" if folder.is_dir() else folder.with_suffix(".py")


def _bindings(package: str) -> dict[str, str]:
    """name -> the module ``package``'s ``__init__`` imports it from (itself if defined there)."""
    found: dict[str, str] = {}
    parts = package.split(".")
    for node in ast.parse(_init(package).read_text()).body:
        if isinstance(node, ast.ImportFrom):
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            for alias in node.names:
                found[alias.asname or alias.name] = module
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = package
    return found


@pytest.mark.parametrize("package", PUBLIC)
def test_a_public_package_imports_each_name_from_its_home(package: str) -> None:
    module = importlib.import_module(package)
    bindings = _bindings(package)
    assert len(set(module.__all__)) == len(module.__all__), f"{package}.__all__ repeats a name"
    for name in module.__all__:
        obj = getattr(module, name)
        home = getattr(obj, "__module__", None)
        if home is None or not home.startswith("preemptible") or not callable(obj):
            continue
        if name not in bindings and "__getattr__" in bindings:
            continue  # imported on first use (a tracker's library), from its home
        if name in ALIASES_LEFT.get(bindings.get(name, ""), set()):
            continue  # through an alias left for the stop's own work
        assert bindings.get(name) == home, (
            f"{package} takes {name} from {bindings.get(name)}, not from its home {home}"
        )


def test_each_public_object_is_exported_from_one_package() -> None:
    exporters: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for package in PUBLIC:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, (str, int, float, tuple, frozenset)):
                continue  # constants: equal values are not one object's second home
            exporters.setdefault(id(obj), []).append(package)
            names[id(obj)] = name
    twice = {names[key]: where for key, where in exporters.items() if len(where) > 1}
    shared = {key: ["preemptible", "preemptible.frontend"] for key in KIT_SHARES}
    shared["detect_platform"] = ["preemptible", "preemptible.notices"]  # the platforms' own
    assert twice == shared


def test_no_private_module_re_exports_a_name() -> None:
    alias = re.compile(r"^\s*from \S+ import ([A-Za-z_]\w*) as \1\b", re.M)
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        names = set(alias.findall(path.read_text()))
        if names:
            parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
            found[".".join(parts)] = names
    assert found == ALIASES_LEFT
