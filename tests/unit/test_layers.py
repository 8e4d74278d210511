"""The package's layers, read from its import graph (every import, function-local ones too).

The stop path is stacked: base modules < stop (latch, termination, controller) < notices,
trackers and the data sampler < checkpoint (store, state, savers) < distributed (group,
agreement, sharded) < the front-end kit (``preemptible.frontend``) < front ends (the handler,
Lightning, Keras, the next ones).
A module imports only its own layer's package or lower ones, and a front end only the kit's
public names (and the trackers'): what a new front end needs, the kit must offer.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from pathlib import Path

import pytest

import preemptible
import preemptible.frontend
import preemptible.trackers
from preemptible.frontend import StopSession

SRC = Path(preemptible.__file__).parent

LAYERS = {
    "_errors": 0,
    "_env": 0,
    "_files": 0,
    "_logs": 0,
    "_paths": 0,
    "_report": 0,  # what a run reports: its files in the run directory
    "_run": 0,
    "_states": 0,
    "_text": 0,
    "_torch": 0,
    "stop": 1,
    "notices": 2,
    "trackers": 2,
    "data": 2,  # the resumable sampler: torch's, beside the stop path, on the base only
    "checkpoint": 3,
    "distributed": 4,
    "frontend": 5,
    "_handler": 6,
    "lightning": 6,
    "transformers": 6,
    "accelerate": 6,
    "keras": 6,
    "tensorflow": 6,
    "jax": 6,
}
FRONT_ENDS = ("_handler", "lightning", "transformers", "accelerate", "keras", "tensorflow", "jax")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names) of every import in ``path``, relative ones resolved."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            names = [alias.name for alias in node.names]
            if node.level and not node.module:  # from . import x: modules of the package
                found += [(f"{target}.{name}", []) for name in names]
            else:
                found.append((target, names))
    return found


def top(module: str) -> str | None:
    """The layer key of a preemptible module (None for anything else)."""
    parts = module.split(".")
    if parts[0] != "preemptible" or len(parts) < 2:
        return None
    return parts[1]


def stop_path_modules() -> list[Path]:
    return [p for p in sorted(SRC.rglob("*.py")) if top(module_name(p)) in LAYERS]


@pytest.mark.parametrize("path", stop_path_modules(), ids=lambda p: module_name(p))
def test_a_module_of_the_stop_path_imports_nothing_above_its_layer(path: Path) -> None:
    own = top(module_name(path))
    assert own is not None
    for target, _names in imports(path):
        other = top(target)
        if other is None or other == own:
            continue
        assert other in LAYERS, f"{module_name(path)} imports {target}, outside the stop path"
        assert LAYERS[other] < LAYERS[own] or (LAYERS[other] == LAYERS[own] and LAYERS[own] == 0), (
            f"{module_name(path)} (layer {LAYERS[own]}) imports {target} (layer {LAYERS[other]})"
        )


@pytest.mark.parametrize(
    "path",
    [p for p in stop_path_modules() if top(module_name(p)) in FRONT_ENDS],
    ids=lambda p: module_name(p),
)
def test_a_front_end_imports_only_the_kits_public_names(path: Path) -> None:
    own = module_name(path).split(".")[:2]
    public = {
        "preemptible.frontend": set(preemptible.frontend.__all__),
        "preemptible.trackers": set(preemptible.trackers.__all__),
    }
    for target, names in imports(path):
        if top(target) is None or target.split(".")[:2] == own:
            continue
        assert target in public, f"{module_name(path)} imports {target}: use preemptible.frontend"
        assert set(names) <= public[target], (
            f"{module_name(path)} imports {sorted(set(names) - public[target])} from {target}, "
            "which it does not export"
        )


def test_the_stop_sequence_is_one_class_that_the_session_composes() -> None:
    """Save, record, acknowledge, tracker, exit: the kit's ``StopSequence``, held by the session
    (no mixin sharing its attributes); ``stop/`` (the latch, the requests, the grace policy)
    writes no run record."""
    assert StopSession.__bases__ == (object,), "StopSession composes its parts"
    for path in sorted((SRC / "stop").glob("*.py")):
        for target, _names in imports(path):
            assert target != "preemptible._run", (
                f"{module_name(path)} imports {target}: the stop's record is the stop sequence's"
            )


CHECKPOINT_WRITERS = {
    "preemptible._files",  # the atomic replacement every file of preemptible goes through
    "preemptible.checkpoint._store",  # the commit protocol
    "preemptible.checkpoint._savers",
    "preemptible.distributed._savers",
    "preemptible.distributed._staged",
}


def test_only_the_savers_open_checkpoint_temporaries_or_rename_files() -> None:
    """A checkpoint temporary (``store.temporary``), a commit (``store.commit``) or a rename
    (``os.rename``/``os.replace``) outside the savers would be a second commit protocol."""
    allowed_renames = {"preemptible.sweeps.status._timeline"}  # its plot, written whole and renamed
    for path in sorted(SRC.rglob("*.py")):
        name = module_name(path)
        if name in CHECKPOINT_WRITERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            func = node.func
            owner = func.value.id if isinstance(func.value, ast.Name) else None
            if func.attr in ("temporary", "commit") and owner != "conn":
                pytest.fail(f"{name}:{node.lineno} calls .{func.attr}(): only savers do")
            if owner == "os" and func.attr in ("rename", "replace"):
                assert name in allowed_renames, f"{name}:{node.lineno} renames with os.{func.attr}"


def test_the_kit_exports_what_it_documents() -> None:
    for name in preemptible.frontend.__all__:
        assert hasattr(preemptible.frontend, name), name
    public = {n for n in vars(preemptible.frontend) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(preemptible.frontend, n)).__name__ == "module"}
    assert public - modules - {"annotations"} == set(preemptible.frontend.__all__)


def test_no_module_of_the_stop_path_is_too_long_to_read_in_one_sitting() -> None:
    """650 lines: a file is cut by concept, and one concept may need that much (the store: its
    commit, retention, quarantine and lock); never cut to meet the number."""
    long = {
        module_name(p): n
        for p in stop_path_modules()
        if (n := len(p.read_text().splitlines())) > 650
    }
    assert long == {}, long


def _graph(key: Callable[[str], str | None]) -> dict[str, set[str]]:
    """Who imports whom among the package's modules (function-local and type-checking imports
    too), each module named by ``key``; a module's imports of its own key are left out."""
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        own = key(name)
        if own is None:
            continue
        for target, names in imports(path):
            if not target.startswith("preemptible"):
                continue
            for imported in [f"{target}.{n}" for n in names] or [target]:
                found = imported if imported in modules else target
                while found and found not in modules:
                    found = found.rpartition(".")[0]
                if not found or modules[found].name == "__init__.py":
                    continue  # a package's __init__ only gathers its modules' names
                other = key(found)
                if other is not None and other != own:
                    graph.setdefault(own, set()).add(other)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: each one a path that comes back to where it began."""
    found = []
    for start in sorted(graph):
        path, todo, seen = [start], [iter(sorted(graph[start]))], {start}
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                todo.pop()
                seen.discard(path.pop())
            elif nxt == start:
                found.append([*path, start])
            elif nxt not in seen and nxt > start:  # each circle once, from its least module
                path.append(nxt)
                seen.add(nxt)
                todo.append(iter(sorted(graph.get(nxt, ()))))
    return found


def test_no_two_modules_import_each_other_in_a_circle() -> None:
    assert _circles(_graph(lambda name: name)) == []


def test_no_two_folders_import_each_other_in_a_circle() -> None:
    assert _circles(_graph(top)) == []


def test_the_supervisor_never_imports_the_sweeps() -> None:
    """``preemptible run`` is below ``preemptible agent``: the agent runs each run under the
    supervisor, and the supervisor knows nothing of queues."""
    assert "sweeps" not in _graph(top).get("supervisor", set())


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_every_part_stops_on_the_same_signals() -> None:
    """The latch, the supervisor, the agent and the guardian (which ignores them, and as a
    script of its own spells them out) use one set of stop signals."""
    from preemptible.stop import _latch, _signals
    from preemptible.supervisor import _forwarding, _guard
    from preemptible.sweeps.agent import _agent

    assert _latch.DEFAULT_SIGNALS == _forwarding.FORWARDED == _signals.STOP_SIGNALS
    assert _agent.STOP_SIGNALS is _signals.STOP_SIGNALS
    assert tuple(_guard.IGNORED) == _signals.STOP_SIGNALS


def test_the_guardian_spells_out_the_names_it_shares_with_the_library() -> None:
    """The guardian reads the lease file and the run record beside it as a script of its own
    (the standard library only): its names and states are the library's, and it waits a
    poll of the program's own lease notice longer than that poll."""
    from preemptible import _paths, _states
    from preemptible.stop._termination import TerminationConfig
    from preemptible.supervisor import _guard

    assert _guard.RECORD_NAME == _paths.RECORD_NAME
    assert set(_guard.STOPPING_STATES) == {str(s) for s in _states.STOPPED_EARLY}
    assert TerminationConfig().poll_interval < _guard.NOTICE_SLACK


def test_no_module_but_the_signal_helpers_installs_a_stop_signal_handler_in_a_loop() -> None:
    """``signal.signal`` is called in ``stop/_signals.py``, the latch (its handler put back
    where someone replaced it, and a forked child's ignore), the supervisor's SIGCHLD
    wake-up, the guardian (a script of its own) and the demo (its Ctrl+C); nowhere else."""
    allowed = {
        "preemptible.stop._signals",
        "preemptible.stop._latch",
        "preemptible.supervisor._forwarding",
        "preemptible.supervisor._guard",
        "preemptible.demo._sweep",
    }
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "signal"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "signal"
            ):
                assert module_name(path) in allowed, f"{module_name(path)}:{node.lineno}"


ATTEMPT_VARIABLES = {
    "PREEMPTIBLE_RUN_ID",
    "PREEMPTIBLE_ATTEMPT",
    "PREEMPTIBLE_RUN_DIR",
    "PREEMPTIBLE_CHECKPOINT_DIR",
    "PREEMPTIBLE_CHECKPOINT_DIR_DEFAULT",
    "PREEMPTIBLE_RESUME_FROM",
    "PREEMPTIBLE_KILL_AFTER",
}


def _environment_reads(tree: ast.AST) -> list[tuple[int, str, bool]]:
    """(line, variable, raw) of every read of an environment variable named by a literal:
    ``os.environ.get``/``os.getenv``/``os.environ[...]`` (raw) or ``_env``'s readers."""
    reads = []
    for node in ast.walk(tree):
        name = None
        raw = False
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = ast.unparse(node.func)
            if func in ("os.environ.get", "os.getenv", "environ.get"):
                name, raw = node.args[0].value, True
            elif func in ("env_str", "env_float", "env_int", "env_choice"):
                name = node.args[0].value
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and ast.unparse(node.value) in ("os.environ", "environ")
            and isinstance(node.slice, ast.Constant)
        ):
            name, raw = node.slice.value, True
        if isinstance(name, str):
            reads.append((node.lineno, name, raw))
    return reads


def test_only_current_run_reads_what_a_supervisor_tells_its_attempts() -> None:
    for path in sorted(SRC.rglob("*.py")):
        if module_name(path) == "preemptible._run":
            continue
        for line, name, _raw in _environment_reads(ast.parse(path.read_text())):
            assert name not in ATTEMPT_VARIABLES, (
                f"{module_name(path)}:{line} reads {name}: use preemptible.current_run()"
            )


def test_preemptible_and_platform_variables_are_read_through_the_env_readers() -> None:
    """A raw read skips the checks the readers make (empty means unset, a number is a number)."""
    for path in sorted(SRC.rglob("*.py")):
        if module_name(path) == "preemptible._env":
            continue
        for line, name, raw in _environment_reads(ast.parse(path.read_text())):
            assert not (raw and name.startswith(("PREEMPTIBLE_", "SLURM_", "KUBERNETES_"))), (
                f"{module_name(path)}:{line} reads {name} raw: use preemptible._env"
            )


def test_the_environment_read_finder_finds_reads() -> None:
    tree = ast.parse("import os\nos.environ.get('A')\nos.environ['B']\nenv_str('C')\n")
    assert _environment_reads(tree) == [(2, "A", True), (3, "B", True), (4, "C", False)]


SWEEP_PARTS = {"spec": 0, "store": 1, "agent": 2, "status": 2, "web": 3}
TOOLS = {"__main__": 3, "cli": 2, "doctor": 1, "demo": 1}  # the command line: the doctor, the demo


def _part(module: str, package: str) -> str | None:
    """The part of ``package`` (``preemptible.sweeps``) that ``module`` belongs to."""
    if not module.startswith(package + "."):
        return None
    return module[len(package) + 1 :].split(".")[0]


@pytest.mark.parametrize(
    "path",
    sorted((SRC / "sweeps").rglob("*.py")),
    ids=lambda p: module_name(p),
)
def test_a_sweep_part_imports_only_lower_parts_and_their_public_names(path: Path) -> None:
    """spec < store < agent, status < web: a part imports a lower part's ``__all__`` only."""
    own = _part(module_name(path), "preemptible.sweeps")
    if own not in SWEEP_PARTS:
        return
    for target, names in imports(path):
        other = _part(target, "preemptible.sweeps")
        if other is None or other == own:
            continue
        assert other in SWEEP_PARTS, f"{module_name(path)} imports {target}"
        assert SWEEP_PARTS[other] < SWEEP_PARTS[own], (
            f"{module_name(path)} ({own}) imports {target} ({other}): not below it"
        )
        exported = set(importlib.import_module(f"preemptible.sweeps.{other}").__all__)
        assert set(names) <= exported, (
            f"{module_name(path)} imports {sorted(set(names) - exported)} from {target}, "
            f"which preemptible.sweeps.{other} does not export"
        )


def test_the_sweep_parts_cover_the_sweeps_and_nothing_below_imports_them() -> None:
    parts = {p.name for p in (SRC / "sweeps").iterdir() if (p / "__init__.py").exists()}
    assert parts == set(SWEEP_PARTS)
    assert [p.name for p in (SRC / "sweeps").glob("*.py")] == ["__init__.py"]


def test_no_library_module_imports_the_tools() -> None:
    """The command line, the doctor and the demo sit on top: the library never imports them,
    and among them only the command line imports the others."""
    for path in sorted(SRC.rglob("*.py")):
        own = top(module_name(path))
        for target, _names in imports(path):
            other = top(target)
            if other not in TOOLS or other == own:
                continue
            assert own in TOOLS and TOOLS[other] < TOOLS[own], (
                f"{module_name(path)} imports {target}: a tool"
            )
