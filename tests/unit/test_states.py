"""One state vocabulary (``preemptible._states``): the SQL schema's ``CHECK`` constraints
hold exactly the enums' values, no module spells a state as a string literal, and the one
restart rule behaves as ``preemptible run`` and the queue both promise."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import preemptible
from preemptible._states import (
    FINAL_QUEUE_STATES,
    Control,
    Ending,
    HeartbeatState,
    LiveState,
    QueueState,
    RecordState,
    RunState,
    parse,
    spend,
)

SRC = Path(preemptible.__file__).parent
SQL = SRC / "sweeps" / "store" / "sql"
ENUMS = (RunState, QueueState, Ending, RecordState, HeartbeatState, LiveState, Control)

# Modules that speak another system's vocabulary, whose words happen to be ours.
FOREIGN = {
    "supervisor/_slurm.py": "SLURM's job states (squeue/scontrol)",
    "trackers/_mlflow.py": "MLflow's run statuses",
    "trackers/_wandb.py": "W&B's exit codes and statuses",
    "trackers/_base.py": "the tracker protocol's own statuses (finalize's argument)",
}
# a stdlib-only script that spells out the few states it reads; test_layers checks the copy
SPELLED_OUT = {"supervisor/_guard.py"}
TRACKER_CALLS = {"tell_tracker", "finalize"}  # take a tracker status, not a state


def _check_values(sql: str, column: str) -> set[str]:
    """The values of the column's newest ``CHECK (column IN (...))`` (a later migration
    replaces an earlier one's)."""
    found = re.findall(rf"CHECK \({column} IN \(([^)]*)\)\)", sql, re.S)
    assert found, f"no CHECK ({column} IN ...) found"
    return set(re.findall(r"'([^']*)'", found[-1]))


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_sql_check_constraints_are_the_enums(dialect: str) -> None:
    schema = "\n".join(p.read_text() for p in sorted((SQL / dialect).glob("0*.sql")))
    assert _check_values(schema, "state") == {s.value for s in QueueState}
    assert _check_values(schema, "control") == {c.value for c in Control}


def _literals(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants outside docstrings, enum class bodies, dict keys, ``.get`` keys and
    tracker statuses."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            skip.update(id(k) for k in node.keys if k is not None)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if name == "get" and node.args:
                skip.add(id(node.args[0]))
            if name in TRACKER_CALLS:
                skip.update(id(a) for a in node.args)
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):  # a docstring
            skip.add(id(first.value))
        if isinstance(node, ast.ClassDef) and any(
            isinstance(b, ast.Attribute | ast.Name)
            and ast.unparse(b).endswith(("Enum", "StrState"))
            for b in node.bases
        ):
            skip.update(id(n) for n in ast.walk(node))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
    ]


def test_no_state_is_spelled_as_a_string_outside_the_enums() -> None:
    names = {m.value for enum in ENUMS for m in enum}
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "_states.py" or rel in FOREIGN or rel in SPELLED_OUT:
            continue
        for line, value in _literals(ast.parse(path.read_text())):
            if value in names:
                found.append(f"{rel}:{line}: {value!r}")
    assert not found, "state names written as strings (use preemptible._states):\n" + "\n".join(
        found
    )


def test_foreign_vocabularies_exist() -> None:
    for rel in FOREIGN:
        assert (SRC / rel).is_file(), f"{rel} is gone: drop it from FOREIGN"


def test_parse_takes_only_exact_values() -> None:
    assert parse(RunState, "PREEMPTED") is RunState.PREEMPTED
    for odd in ("preempted", " PREEMPTED", None, 3, ["FINISHED"], {"a": 1}, b"FINISHED"):
        assert parse(RunState, odd) is None
    assert RunState.FINISHED == "FINISHED" and f"{RunState.FINISHED}" == "FINISHED"


def test_queue_states_are_run_states_and_the_queue_own() -> None:
    assert {s.value for s in RunState} < {s.value for s in QueueState}
    assert {s.value for s in QueueState} - {s.value for s in RunState} == {
        "PENDING",
        "RUNNING",
        "CANCELLED",
        "STOPPED",
    }
    assert {s.value for s in RunState} < {e.value for e in Ending}


def test_an_early_stopped_attempt_ends_the_run_stopped_with_no_budget_spent() -> None:
    from preemptible.sweeps.store._endings import settle

    kw = {"lost": False, "preemptions": 2, "failures": 1, "max_preemptions": 2, "max_failures": 0}
    assert settle(Ending.STOPPED, control=Control.RUNNING, **kw) == (QueueState.STOPPED, 2, 1)
    assert settle(Ending.STOPPED, control=Control.STOPPED, **kw) == (QueueState.STOPPED, 2, 1)
    cancelled = settle(Ending.STOPPED, control=Control.CANCELLED, **kw)
    assert cancelled == (QueueState.CANCELLED, 2, 1)
    assert QueueState.STOPPED in FINAL_QUEUE_STATES and QueueState.STOPPED != QueueState.CANCELLED


def test_spend_examples() -> None:
    # two preemptions allowed: the third one ends the run; failures are not touched
    counts = (0, 0)
    for again in (True, True, False):
        s = spend(preempted=True, preemptions=counts[0], failures=counts[1],
                  max_preemptions=2, max_failures=0)  # fmt: skip
        assert s.again is again and s.failures == 0 and s.preempted
        counts = (s.preemptions, s.failures)
    assert counts == (3, 0)
    # no failure allowed: the first one ends it
    assert not spend(
        preempted=False, preemptions=5, failures=0, max_preemptions=None, max_failures=0
    ).again
    # no limit on preemptions
    assert spend(
        preempted=True, preemptions=10**9, failures=0, max_preemptions=None, max_failures=0
    ).again


@given(
    preempted=st.booleans(),
    preemptions=st.integers(0, 100),
    failures=st.integers(0, 100),
    max_preemptions=st.none() | st.integers(0, 100),
    max_failures=st.integers(0, 100),
)
def test_spend_spends_exactly_one_budget(
    preempted: bool, preemptions: int, failures: int, max_preemptions: int | None, max_failures: int
) -> None:
    s = spend(
        preempted=preempted,
        preemptions=preemptions,
        failures=failures,
        max_preemptions=max_preemptions,
        max_failures=max_failures,
    )
    if preempted:
        assert (s.preemptions, s.failures) == (preemptions + 1, failures)
        assert s.again == (max_preemptions is None or preemptions < max_preemptions)
    else:
        assert (s.preemptions, s.failures) == (preemptions, failures + 1)
        assert s.again == (failures < max_failures)
