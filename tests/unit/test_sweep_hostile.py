"""The sweep side under hostile input: database URLs whose passwords must never be shown,
metrics and checkpoint steps too large to store, specs that are huge, endless or ambiguous,
and text that would drive the terminal. Each problem is one line (exit 2 at the CLI), and a
bad value from one run never stops the sweep."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rich.console import Console

from preemptible import ConfigError, PreemptibleError
from preemptible.sweeps.agent import _attempt_files, _holding
from preemptible.sweeps.spec._sample import propose
from preemptible.sweeps.spec._spec import load_spec, parse_spec
from preemptible.sweeps.status._render import render, render_sweeps
from preemptible.sweeps.status._snapshot import snapshot, sweeps_snapshot
from preemptible.sweeps.store._fields import decode_object
from preemptible.sweeps.store._queue import Store, open_store
from preemptible.sweeps.store._redact import Scrubber, redact_url, url_secrets
from preemptible.sweeps.store._values import _metric

pytestmark = pytest.mark.timeout(120)

PY = sys.executable
SPEC: dict[str, Any] = {
    "program": "train.py",
    "method": "random",
    "metric": {"name": "loss", "goal": "minimize"},
    "parameters": {"lr": {"min": 0.001, "max": 0.1}},
}


def cli(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
    env["PREEMPTIBLE_DB_RETRY_TIMEOUT"] = "0"
    return subprocess.run(
        [PY, "-m", "preemptible", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_exit_2(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(f"sqlite:///{tmp_path / 'sweeps.db'}", retry_timeout=5)
    yield s
    s.close()


# -- 1. passwords in database URLs ------------------------------------------------------------
try:
    import psycopg  # noqa: F401

    HAVE_PSYCOPG = True
except ImportError:  # pragma: no cover - psycopg is a test dependency
    HAVE_PSYCOPG = False

needs_psycopg = pytest.mark.skipif(not HAVE_PSYCOPG, reason="psycopg is not installed")


def pieces(secret: str) -> list[str]:
    """The secret and every run of 3+ characters of it between separators: a URL parser that
    splits the password at '/', '?', '#', '&' or ':' may quote any of them."""
    return [secret, *[p for p in re.split(r"[/?#&:@ ']", secret) if len(p) >= 3]]


def error_of(url: str, caplog: pytest.LogCaptureFixture) -> str:
    """The message (and anything logged) when opening ``url``; it must fail."""
    with (
        caplog.at_level(logging.DEBUG, logger="preemptible"),
        pytest.raises(PreemptibleError) as info,
    ):
        open_store(url, retry_timeout=0)
    return str(info.value) + "\n" + caplog.text


# each: a --db value and the password in it (the server at 127.0.0.1:1 refuses at once)
LEAKY_URLS = [
    ("postgresql://alice:s3cr/et@127.0.0.1:1/db", "s3cr/et"),
    ("postgresql://alice:s3cr?et@127.0.0.1:1/db", "s3cr?et"),
    ("postgresql://alice:s3cr#et@127.0.0.1:1/db", "s3cr#et"),
    ("postgresql://alice:pa@ss/w0rd@127.0.0.1:1/db", "pa@ss/w0rd"),
    ("postgresql://alice:s3cret@[::1:1/db", "s3cret"),
    ("postgresql://alice:s3cret@[::1/db?sslmode=disable", "s3cret"),
    ("postgresql://alice:s3%zzcret@127.0.0.1:1/db", "s3%zzcret"),
    ("postgresql://alice@127.0.0.1:1/db?sslpassword=s3cret", "s3cret"),
    ("postgresql://alice@127.0.0.1:1/db?password=s3cret", "s3cret"),
    ("postgresql://alice@127.0.0.1:1/db?PASSWORD=s3cret&sslmode=disable", "s3cret"),
    ("postgresql://alice@127.0.0.1:1/db?pass%77ord=s3cret", "s3cret"),
    ("postgresql://alice@127.0.0.1:1/db?password=s3c%zzret", "s3c%zzret"),
    ("postgresql://alice@127.0.0.1:1/db?password=s3cr&etc=1", "s3cr&etc"),
    ("postgresql://alice@127.0.0.1:1/db?sslmode=zzz&password=s3cret", "s3cret"),
    ("postgresql://alice@127.0.0.1:1/db?sslpassword=s3c@ret", "s3c@ret"),
    ("postgresql://alice:s3c?password=ret@127.0.0.1:1/db", "s3c?password=ret"),
    ("host=x password=s3cret://127.0.0.1/db", "s3cret"),
    ("host=x password=s3cret", "s3cret"),
    ("host=x password = 's3 cret' dbname=y", "s3 cret"),
    ("host=x sslpassword=s3cret", "s3cret"),
    ("postgresql:alice:s3cret@127.0.0.1/db", "s3cret"),
    ("POSTGRESQL://alice:s3cret@127.0.0.1/db", "s3cret"),
    ("mysql://alice:s3cret@127.0.0.1/db", "s3cret"),
    ("sqlite://alice:s3cret@host/", "s3cret"),
]


@needs_psycopg
@pytest.mark.parametrize(("url", "secret"), LEAKY_URLS)
def test_no_password_is_ever_shown(url: str, secret: str, caplog: pytest.LogCaptureFixture) -> None:
    text = error_of(url, caplog)
    for piece in pieces(secret):
        assert piece not in text, text
    assert url not in text, text
    assert len(text.strip().splitlines()) == 1, text


@pytest.mark.parametrize(("url", "secret"), LEAKY_URLS)
def test_redact_url_hides_every_password(url: str, secret: str) -> None:
    shown = redact_url(url)
    for piece in pieces(secret):
        assert piece not in shown, shown
    assert "***" in shown


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://alice:s3cr/et@db:5432/sweeps", "postgresql://alice:***@db:5432/sweeps"),
        ("postgresql://al/ice:x@db/sweeps", "postgresql://***@db/sweeps"),
        ("postgresql://alice@db/sweeps?sslpassword=x", "postgresql://alice@db/sweeps?sslpassword=***"),
        ("postgresql://db/sweeps?passfile=/home/a/.pgpass", "postgresql://db/sweeps?passfile=/home/a/.pgpass"),
        ("host=db password=x", "host=db password=***"),
        ("postgresql://db/sweeps", "postgresql://db/sweeps"),
    ],
)  # fmt: skip
def test_redact_url_keeps_what_is_not_secret(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@needs_psycopg
def test_a_url_that_cannot_be_parsed_as_meant_is_refused_before_connecting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    text = error_of("postgresql://alice:s3cr/et@127.0.0.1:1/db", caplog)
    assert "contains '/'; write it as %2F" in text, text
    text = error_of("postgresql://alice:a@b#c@127.0.0.1:1/db", caplog)
    assert "contains '@' and '#'; write them as %40 and %23" in text, text


@needs_psycopg
@pytest.mark.parametrize("retry_timeout", [0.0, 0.3])
def test_the_retry_warning_names_no_password(
    caplog: pytest.LogCaptureFixture, retry_timeout: float
) -> None:
    url = "postgresql://alice@127.0.0.1:1/db?sslpassword=s3cret"
    with (
        caplog.at_level(logging.DEBUG, logger="preemptible"),
        pytest.raises(PreemptibleError) as info,
    ):
        open_store(url, retry_timeout=retry_timeout)
    assert "s3cret" not in str(info.value) + caplog.text
    assert "sslpassword=***" in str(info.value)


PASSWORD = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E) | st.sampled_from(" é€"),
    min_size=1,
    max_size=12,
).map(lambda middle: f"Q{middle}Z")

FORMS = [
    "postgresql://alice:{pw}@127.0.0.1:1/db",
    "postgresql://alice:{pw}@[::1:1/db",
    "postgresql://alice@127.0.0.1:1/db?sslpassword={pw}",
    "postgresql://alice@127.0.0.1:1/db?password={pw}",
    "host=127.0.0.1 password={pw}",
    "host=127.0.0.1 password='{pw}' port=1",
    "postgresql://127.0.0.1:1/db?user=alice&password={pw}&sslmode=zzz",
    "postgresql:alice:{pw}@127.0.0.1:1/db",
]


@needs_psycopg
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pw=PASSWORD, form=st.sampled_from(FORMS))
@example(pw="Q Z", form=FORMS[6])  # libpq quoted "Q Z" whole; once only its pieces were hidden
@example(pw="Q;x' Z", form=FORMS[6])
def test_no_generated_password_appears_in_any_error(pw: str, form: str) -> None:
    url = form.format(pw=pw)
    handler = _Collect()
    log = logging.getLogger("preemptible")
    log.addHandler(handler)
    try:
        with pytest.raises(PreemptibleError) as info:
            open_store(url, retry_timeout=0)
    finally:
        log.removeHandler(handler)
    text = str(info.value) + "\n" + "\n".join(handler.messages)
    for form_of_pw in {pw, unquote(pw)}:
        assert form_of_pw not in text, (url, text)
    assert url not in text


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@needs_psycopg
@pytest.mark.parametrize(
    "url",
    [
        "postgresql://alice:s3cr/et@127.0.0.1:1/db",
        "postgresql://alice:s3cret@[::1:1/db",
        "host=x password=s3cret",
        "postgresql://alice@127.0.0.1:1/db?sslpassword=s3cret",
    ],
)
def test_status_says_one_line_without_the_password(tmp_path: Path, url: str) -> None:
    out = cli("status", "--db", url, cwd=tmp_path)
    line = one_line_exit_2(out)
    assert "s3cr" not in line + out.stdout, line


@pytest.mark.parametrize(
    ("url", "message", "scrubbed"),
    [
        # 2-letter pieces of the password stay: "permission" is not a secret
        ("postgresql://alice:ab%2Fss@h/db", "permission denied: ab/ss", "permission denied: ***"),
        ("postgresql://alice:mission@h/db", "permission denied", "permission denied"),
        ("postgresql://alice:mission@h/db", 'password "mission" refused', 'password "***" refused'),
        ("postgresql://alice:p%40ss%20w0rd@h/db", "got p%40ss+w0rd, p@ss w0rd", "got ***, ***"),
        ("postgresql://alice@h/db?password=s3cr&etc=1", 'bad option "etc"', 'bad option "***"'),
        ("host=h password='s3 cret' dbname=x", "missing = after cret", "missing = after ***"),
        ("postgresql://alice:xy@h/db", "proxy xy refused", "proxy xy refused"),  # too short
    ],
)  # fmt: skip
def test_the_scrubber_hides_whole_secrets_and_nothing_else(
    url: str, message: str, scrubbed: str
) -> None:
    assert Scrubber(url, redact_url(url))(message) == scrubbed
    assert Scrubber(url, redact_url(url))(f"at {url}") == f"at {redact_url(url)}"


def test_no_secret_scrubbed_is_shorter_than_three_characters() -> None:
    found = url_secrets("postgresql://alice:a/b:cd/efg%2Fss@h/db?sslpassword=x&y=z")
    assert found and min(map(len, found)) >= 3, found
    assert "efg" in found and "ss" not in found and "cd" not in found


# -- 2. a metric too large for a float ---------------------------------------------------------
def test_a_huge_integer_metric_reads_as_missing() -> None:
    assert _metric({"loss": 10**400}, "loss") is None
    assert _metric({"loss": -(10**400)}, "loss") is None
    assert _metric({"loss": 2**70}, "loss") == float(2**70)
    assert _metric({"loss": 3}, "loss") == 3.0


def _run(store: Store, spec: dict[str, Any] | None = None) -> tuple[str, Any]:
    sweep = store.create_sweep(
        spec or SPEC, name=None, run_cap=None, max_failures=0, max_preemptions=5, seed=1
    )
    store.add_runs(sweep, [{"lr": 0.01}])
    claim = store.claim(sweep, agent="a", host="h", lease=60, propose=None)
    assert claim is not None
    return sweep, claim


def test_a_stored_huge_metric_breaks_neither_status_nor_claims(
    store: Store, tmp_path: Path
) -> None:
    sweep, claim = _run(store)
    store.finish(
        claim.run_id,
        agent="a",
        attempt=claim.attempt,
        ending="FINISHED",
        exit_code=0,
        duration=1.0,
        checkpoint_step=None,
        summary={"acc": 0.5},
    )
    # a value already stored by an older version (or by hand): read back as missing
    with sqlite3.connect(tmp_path / "sweeps.db") as db:
        db.execute(
            "UPDATE preemptible_runs SET summary = ? WHERE id = ?",
            ('{"loss": 1' + "0" * 400 + ', "other": 1e999}', claim.run_id),
        )
    assert [o.metric for o in store.history(sweep)] == [None]
    seen: list[Any] = []
    more = store.claim(
        sweep, agent="b", host="h", lease=60, propose=lambda h, i: seen.append(h) or {"lr": 0.02}
    )
    assert more is not None and seen[0][0].metric is None
    doc = snapshot(store, sweep)
    assert doc["runs"][0]["metric"] is None and doc["sweep"]["best"] is None
    json.dumps(doc)
    _text(render(doc))
    _text(render_sweeps(sweeps_snapshot(store)))


@pytest.mark.parametrize(
    "bad",
    [10**400, -(10**400), float("inf"), float("nan"), [1, float("inf")], {"x": 10**400}],
    ids=["1e400", "-1e400", "inf", "nan", "list-inf", "nested-1e400"],
)
def test_a_metric_that_is_not_a_finite_number_is_dropped_with_a_warning(
    store: Store, caplog: pytest.LogCaptureFixture, bad: Any
) -> None:
    _, claim = _run(store)
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        store.report(claim.run_id, {"loss": bad, "acc": 0.5})
        assert store.run(claim.run_id).summary == {"acc": 0.5}
        state = store.finish(
            claim.run_id,
            agent="a",
            attempt=claim.attempt,
            ending="FINISHED",
            exit_code=0,
            duration=1.0,
            checkpoint_step=3,
            summary={"loss": bad, "acc": 0.75},
        )
    assert state == "FINISHED"
    assert store.run(claim.run_id).summary == {"acc": 0.75}
    assert "loss" in caplog.text and claim.run_id in caplog.text


def test_a_value_dropped_again_and_again_is_logged_once(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    _, claim = _run(store)
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        for step in range(5):
            store.report(claim.run_id, {"loss": 10**400, "step": step})
    assert store.run(claim.run_id).summary == {"step": 4}
    assert caplog.text.count("reported loss") == 1


# -- 3. a checkpoint step beyond a 64-bit integer ----------------------------------------------
@pytest.mark.parametrize("step", [2**63, 10**25, -(2**63) - 1, 1.5, True])
def test_a_step_that_does_not_fit_is_recorded_as_unknown(
    store: Store, caplog: pytest.LogCaptureFixture, step: Any
) -> None:
    _, claim = _run(store)
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        state = store.finish(
            claim.run_id,
            agent="a",
            attempt=claim.attempt,
            ending="PREEMPTED",
            exit_code=143,
            duration=1.0,
            checkpoint_step=step,
            summary=None,
        )
    assert state == "PENDING"
    assert [a.checkpoint_step for a in store.attempts(claim.run_id)] == [None]
    assert "checkpoint step" in caplog.text


def test_the_largest_step_is_kept(store: Store) -> None:
    _, claim = _run(store)
    store.finish(
        claim.run_id,
        agent="a",
        attempt=claim.attempt,
        ending="PREEMPTED",
        exit_code=143,
        duration=1.0,
        checkpoint_step=2**63 - 1,
        summary=None,
    )
    assert [a.checkpoint_step for a in store.attempts(claim.run_id)] == [2**63 - 1]


def test_the_agent_reads_a_step_too_large_as_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Huge:
        step = 10**25

    class FakeStore:
        def __init__(self, directory: Path, *, create: bool = True) -> None:
            assert not create  # a read: the agent must not create the directory

        def latest(self) -> Huge:
            return Huge()

    monkeypatch.setattr(_holding, "CheckpointStore", FakeStore)
    assert _holding.newest_step(tmp_path) is None


# -- 4. spec counts beyond what the database stores ----------------------------------------
@pytest.mark.parametrize(
    ("key", "value", "low"),
    [
        ("run_cap", 2**63, 1),
        ("run_cap", 2**31, 1),
        ("max_failures", 2**63, 0),
        ("max_preemptions", 10**30, 0),
        ("max_preemptions", 2**64 + 5, 0),
    ],
)
def test_counts_too_large_for_the_database_are_one_line(key: str, value: int, low: int) -> None:
    with pytest.raises(ConfigError) as info:
        parse_spec({**SPEC, key: value})
    message = str(info.value)
    assert message.startswith(f"spec: {key}: ") and "\n" not in message
    assert f"from {low} to {2**31 - 1}" in message


def test_the_largest_counts_are_accepted_and_stored(store: Store) -> None:
    top = 2**31 - 1
    s = parse_spec({**SPEC, "run_cap": top, "max_failures": top, "max_preemptions": top})
    sweep = store.create_sweep(
        dict(s.raw), name=None, run_cap=top, max_failures=top, max_preemptions=top
    )
    row = store.sweep(sweep)
    assert (row.run_cap, row.max_failures, row.max_preemptions) == (top, top, top)


@pytest.mark.parametrize("key", ["run_cap", "max_failures", "max_preemptions"])
def test_the_store_refuses_counts_it_cannot_hold(store: Store, key: str) -> None:
    counts: dict[str, Any] = {"run_cap": None, "max_failures": 0, "max_preemptions": 0}
    counts[key] = 2**63
    with pytest.raises(ConfigError, match=rf"^{key}=9223372036854775808 is not valid"):
        store.create_sweep(SPEC, name=None, **counts)


def test_sweep_create_with_a_huge_run_cap_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**SPEC, "run_cap": 2**63}))
    line = one_line_exit_2(cli("sweep", "create", str(path), "--db", "sqlite:s.db", cwd=tmp_path))
    assert "run_cap" in line and "2147483647" in line


# -- 5. grids too large to lay out --------------------------------------------------------
def grid(parameters: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"program": "train.py", "method": "grid", "parameters": parameters, **extra}


@pytest.mark.timeout(10)
def test_a_huge_grid_is_refused_at_once_naming_its_size_and_the_cap() -> None:
    huge = {"a": {"min": 0, "max": 2**53}, "b": {"min": 0, "max": 2**53}}
    with pytest.raises(ConfigError) as info:
        parse_spec(grid(huge))
    message = str(info.value)
    assert "\n" not in message and "100000" in message.replace(",", "")
    assert str((2**53 + 1) ** 2) in message.replace(",", "")


@pytest.mark.timeout(10)
def test_many_values_lists_are_refused() -> None:
    params = {f"p{i}": {"values": list(range(10))} for i in range(6)}  # 10**6 points
    with pytest.raises(ConfigError, match=r"1,?000,?000 points") as info:
        parse_spec(grid(params))
    assert "100,000" in str(info.value) or "100000" in str(info.value)
    params = {f"p{i}": {"values": list(range(10))} for i in range(5)}  # 10**5: allowed
    assert parse_spec(grid(params)).grid_size() == 10**5


@pytest.mark.timeout(10)
def test_an_astronomic_grid_is_refused_without_computing_it_exactly() -> None:
    params = {f"p{i}": {"min": 0, "max": 2**53} for i in range(3000)}
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"about 10\^"):
        parse_spec(grid(params))
    assert time.monotonic() - started < 5


@pytest.mark.timeout(20)
def test_a_huge_grid_with_a_small_run_cap_lays_out_only_those_runs() -> None:
    huge = {"a": {"min": 0, "max": 2**53}, "b": {"min": 0, "max": 2**53}}
    s = parse_spec(grid(huge, run_cap=3))
    points = [propose(s, [], index=i, seed=0) for i in range(4)]
    assert points == [{"a": 0, "b": 0}, {"a": 0, "b": 1}, {"a": 0, "b": 2}, None]


@pytest.mark.timeout(10)
def test_a_grid_whose_runs_hold_too_many_values_in_all_is_refused() -> None:
    constants = {f"c{i}": {"value": i} for i in range(2000)}
    params = {**constants, "a": {"min": 0, "max": 9999}}  # 10 000 runs x 2001 values
    with pytest.raises(ConfigError, match=r"values in all"):
        parse_spec(grid(params))


@pytest.mark.timeout(60)
def test_sweep_create_refuses_a_huge_grid_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(
        "program: t.py\nmethod: grid\nparameters:\n  a: {min: 0, max: 9007199254740992}\n"
        "  b: {min: 0, max: 9007199254740992}\n"
    )
    started = time.monotonic()
    line = one_line_exit_2(cli("sweep", "create", str(path), "--db", "sqlite:s.db", cwd=tmp_path))
    assert "grid" in line and time.monotonic() - started < 30


# -- 6. spec files that are endless or not files -------------------------------------------
@pytest.mark.timeout(10)
def test_a_device_is_refused(tmp_path: Path) -> None:
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    with pytest.raises(ConfigError, match=r"^/dev/zero: is not a regular file"):
        load_spec("/dev/zero")


@pytest.mark.timeout(10)
def test_a_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"spec.yaml: is not a regular file"):
        load_spec(fifo)


def test_a_spec_over_one_mib_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("method: random\n" + "#" * (1 << 20) + "\n")
    with pytest.raises(ConfigError, match=r"big.yaml: is larger than 1 MiB"):
        load_spec(path)


@pytest.mark.timeout(60)
def test_sweep_create_of_dev_zero_exits_2(tmp_path: Path) -> None:
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    line = one_line_exit_2(cli("sweep", "create", "/dev/zero", "--db", "sqlite:s.db", cwd=tmp_path))
    assert "regular file" in line


# -- 7. duplicate keys: the last wins, as in PyYAML (W&B's CLI), with a warning -----------------
# (tests/unit/test_sweep_spec_as_written.py checks the warnings' words and lines)
@pytest.mark.parametrize(
    ("name", "text", "key"),
    [
        ("a.yaml", "method: grid\nmethod: random\nparameters: {x: {value: 1}}\n", "'method'"),
        (
            "b.yaml",
            "method: grid\nparameters:\n  lr:\n    values: [1]\n  lr:\n    values: [2]\n",
            "'lr'",
        ),
        ("c.yaml", "method: grid\nparameters: {x: {value: 1, value: 2}}\n", "'value'"),
        (
            "d.json",
            '{"method": "grid", "method": "random", "parameters": {"x": {"value": 1}}}',
            "'method'",
        ),
        ("e.json", '{"method": "grid", "parameters": {"x": {"value": 1, "value": 2}}}', "'value'"),
    ],
)
def test_a_duplicate_key_keeps_the_last_with_a_warning_naming_it(
    tmp_path: Path, name: str, text: str, key: str
) -> None:
    path = tmp_path / name
    path.write_text(text.replace('"method"', '"program": "t.py", "method"', 1))
    if name.endswith(".yaml"):
        path.write_text("program: t.py\n" + text)
    s = load_spec(path)
    assert [w for w in s.warnings if f"key {key} is written twice" in w], s.warnings
    if key == "'method'":
        assert s.method == "random"
    elif key == "'lr'":
        assert s.parameters["lr"].values == (2,)
    else:
        assert s.parameters["x"].value == 2


def test_a_yaml_merge_may_still_be_overridden(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text(
        "program: t.py\nmethod: grid\nparameters:\n  a: &base {values: [1, 2]}\n"
        "  b:\n    <<: *base\n    values: [3]\n"
    )
    s = load_spec(path)
    assert s.parameters["b"].values == (3,) and s.parameters["a"].values == (1, 2)


# -- 8. control characters in the table ----------------------------------------------------
def _text(renderable: Any) -> str:
    out = io.StringIO()
    Console(file=out, width=300, color_system=None, force_terminal=False).print(renderable)
    return out.getvalue()


def test_control_characters_are_shown_escaped(store: Store) -> None:
    spec = {
        "method": "grid",
        "metric": {"name": "lo\x1b[2Jss", "goal": "minimize"},
        "parameters": {"x": {"values": ["\x1b]0;pwned\x07", "a\x08b"]}},
    }
    sweep = store.create_sweep(
        spec, name="evil\x1b[31mname\u202e", run_cap=None, max_failures=0, max_preemptions=0
    )
    store.add_runs(sweep, [{"x": "\x1b]0;pwned\x07"}, {"x": "a\x08b"}])
    store.claim(sweep, agent="ag\x1bent", host="ho\x9bst", lease=60, propose=None)
    table = _text(render(snapshot(store, sweep)))
    listing = _text(render_sweeps(sweeps_snapshot(store)))
    for shown in (table, listing):
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202e]", shown), repr(shown)
        assert "\\x1b" in shown
    assert "\\x1b]0;pwned\\x07" in table and "a\\x08b" in table
    assert "ho\\x9bst" in table and "\\u202e" in listing


def test_the_agent_log_of_parameters_is_escaped() -> None:
    described = _attempt_files._describe({"x": "\x1b[2J", "y": 1})
    assert "\x1b" not in described and "\\x1b" in described


# -- 9. text that is not JSON in the queue's JSON fields ------------------------------------
@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "not JSON (Expecting value at line 1, column 1)"),
        ("{not json", "not JSON (Expecting property name enclosed in double quotes at line 1"),
        ('{"a": 1} trailing', "not JSON (Extra data at line 1, column 10)"),
        ('{"a": "\x01"}', "not JSON (Invalid control character at line 1, column 8)"),
        ("[1, 2]", "JSON but not an object (a list)"),
        ('"text"', "JSON but not an object (a text)"),
        ("null", "JSON but not an object (null)"),
        ('{"lr": NaN}', "not usable JSON (NaN, which JSON has no place for)"),
        ('{"lr": -Infinity}', "not usable JSON (-Infinity, which JSON has no place for)"),
        ('{"n": ' + "9" * 5000 + "}", "not usable JSON (a number too long)"),
        ("[" * 100_000, "nested too deeply"),
        (b"{}", "not text but bytes"),
        (7, "not text but int"),
    ],
)
def test_each_kind_of_unreadable_field_is_named_without_its_text(text: object, why: str) -> None:
    value, reason = decode_object(text)
    assert value is None and reason is not None and reason.startswith(why), reason
    assert decode_object(' {"a": [1, 2.5e3]} \n') == ({"a": [1, 2500.0]}, None)
    assert decode_object(None) == (None, None)


def plant(url: str, sql: str, *args: object) -> None:
    """Write into the queue behind the store's back (a hand edit, another tool, a bad disk)."""
    if url.startswith("sqlite:"):
        with contextlib.closing(sqlite3.connect(url.split("://", 1)[1])) as db, db:
            db.execute(sql, args)
        return
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.replace("?", "%s"), args)  # type: ignore[arg-type]


def garbage_sweep(url: str, params_text: str, summary_text: str) -> tuple[str, list[str]]:
    """Three runs, finished with a metric; run 1's params and run 2's summary are garbage."""
    with open_store(url, retry_timeout=5) as s:
        sweep = s.create_sweep(SPEC, name="g", run_cap=None, max_failures=0, max_preemptions=1)
        ids = s.add_runs(sweep, [{"lr": 0.01}, {"lr": 0.02}, {"lr": 0.03}])
        for loss in (0.5, 0.25, 0.125):
            c = s.claim(sweep, agent="a", host="h", lease=60, propose=None)
            assert c is not None
            s.finish(c.run_id, agent="a", attempt=c.attempt, ending="FINISHED", exit_code=0,
                     duration=1.0, checkpoint_step=3, summary={"loss": loss})  # fmt: skip
    plant(url, "UPDATE preemptible_runs SET params = ? WHERE id = ?", params_text, ids[1])
    plant(url, "UPDATE preemptible_runs SET summary = ? WHERE id = ?", summary_text, ids[2])
    return sweep, ids


def warnings_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "unreadable" in line]


def test_a_field_that_is_not_json_is_shown_unreadable_by_every_status(
    store_url: str, tmp_path: Path
) -> None:
    sweep, ids = garbage_sweep(store_url, "[1, 2]", "{not json")
    table = cli("status", sweep, "--db", store_url, cwd=tmp_path)
    assert table.returncode == 0 and "Traceback" not in table.stderr, table.stderr
    assert len(warnings_of(table.stderr)) == 2, table.stderr  # one line per field
    for run, field, why in ((ids[1], "params", "JSON but not"), (ids[2], "summary", "not JSON")):
        (line,) = [w for w in warnings_of(table.stderr) if f"run {run}: its {field}" in w]
        assert why in line and "[1, 2]" not in line and "not json" not in line, line
    rows = {c[0]: c for c in (ln.split("│") for ln in table.stdout.splitlines()) if len(c) > 5}
    assert "(unreadable)" in rows[f"{ids[1]} "][1] and "?" in rows[f"{ids[2]} "][5]
    assert "lr=0.01" in rows[f"{ids[0]} "][1]  # the others as usual
    assert f"best {ids[1]} loss=0.25" in table.stdout  # its summary is fine: still the best

    out = cli("status", sweep, "--db", store_url, "--json", cwd=tmp_path)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    doc = json.loads(out.stdout)
    got = [(r["params"], r["unreadable"], r["metric"]) for r in doc["runs"]]
    assert got == [
        ({"lr": 0.01}, [], 0.5),
        (None, ["params"], 0.25),
        ({"lr": 0.03}, ["summary"], None),
    ]
    assert len(warnings_of(out.stderr)) == 2, out.stderr

    listing = cli("status", "--db", store_url, cwd=tmp_path)
    assert listing.returncode == 0 and sweep in listing.stdout, listing.stderr
    assert "Traceback" not in listing.stderr


def test_a_spec_that_is_not_json_is_one_line_for_the_agent_and_unreadable_in_status(
    store_url: str, tmp_path: Path
) -> None:
    sweep, _ = garbage_sweep(store_url, '{"lr": 0.02}', '{"loss": 0.125}')
    plant(store_url, "UPDATE preemptible_sweeps SET spec = ? WHERE id = ?", "{oops", sweep)
    line = one_line_exit_2(cli("agent", sweep, "--db", store_url, cwd=tmp_path))
    assert f"sweep {sweep}: its spec in the sweep database is not JSON" in line, line
    outs = [cli(*a, "--db", store_url, cwd=tmp_path) for a in (["status", sweep], ["status"])]
    outs.append(cli("status", sweep, "--db", store_url, "--json", cwd=tmp_path))
    for out in outs:
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        assert [w for w in warnings_of(out.stderr) if f"sweep {sweep}: its spec" in w], out.stderr
    assert "spec (unreadable)" in outs[0].stdout and "(unreadable)" in outs[1].stdout
    doc = json.loads(outs[2].stdout)
    assert doc["sweep"]["unreadable"] == ["spec"] and doc["sweep"]["metric"] is None


def test_a_claim_fails_the_run_whose_params_are_not_json_and_takes_the_next(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with open_store(store_url, retry_timeout=5) as s:
        sweep = s.create_sweep(SPEC, name=None, run_cap=None, max_failures=3, max_preemptions=1)
        ids = s.add_runs(sweep, [{"lr": 0.01}, {"lr": 0.02}, {"lr": 0.03}])
        plant(store_url, "UPDATE preemptible_runs SET params = ? WHERE id = ?", "[oops", ids[0])
        plant(store_url, "UPDATE preemptible_runs SET params = ? WHERE id = ?", "7", ids[1])
        with caplog.at_level(logging.ERROR, logger="preemptible"):
            c = s.claim(sweep, agent="a", host="h", lease=60, propose=None)
        assert c is not None and (c.run_id, c.params) == (ids[2], {"lr": 0.03})
        assert [(r.state, r.attempt, r.unreadable) for r in s.runs(sweep)] == [
            ("FAILED", 0, ("params",)),
            ("FAILED", 0, ("params",)),
            ("RUNNING", 1, ()),
        ]  # failed at once (a retry cannot help), with no attempt: it never ran
        assert [o.params for o in s.history(sweep)] == [{"lr": 0.03}]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert f"run {ids[0]}: its params in the sweep database are not JSON" in lines[0]
    assert f"run {ids[1]}: its params in the sweep database are JSON but not an object" in lines[1]
    assert all("oops" not in line and "it cannot run: FAILED" in line for line in lines)


def test_the_agent_skips_a_run_whose_params_are_not_json(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("pass\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text("program: ok.py\nmethod: grid\nparameters:\n  x: {values: [1, 2, 3]}\n")
    db = f"sqlite://{tmp_path}/s.db"
    created = cli("sweep", "create", str(spec), "--db", db, cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    sweep = created.stdout.split()[-1]
    plant(db, "UPDATE preemptible_runs SET params = ? WHERE id = ?", "{x: 2", f"{sweep}-1")
    out = cli("agent", sweep, "--db", db, "--heartbeat", "0.2", "--lease", "5", cwd=tmp_path)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert f"run {sweep}-1: its params in the sweep database are not JSON" in out.stderr
    with open_store(db) as s:
        assert [r.state for r in s.runs(sweep)] == ["FINISHED", "FAILED", "FINISHED"]


# -- 10. a spec path that names another file --------------------------------------------------
SECRET_FILES = {
    "shadow": "root:$6$S3CRETsalt$S3CRETHASH:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n",
    "shadow-twice": "root:S3CRET:1:::\nroot:S3CRET:1:::\n",  # a duplicate key, to YAML
    "env": "AWS_SECRET_ACCESS_KEY=S3CRETS3CRET\n",
    "ini": "password: S3CRET\ntoken: S3CRET\n",
    "pem": "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbS3CRET\n-----END OPENSSH PRIVATE KEY-----\n",
    "number": "4242424242\n",
    "alias": "x: *S3CRETalias\n",
    "tag": "x: !S3CRETtag 1\n",
    "handle": "x: !S3CRET!y 1\n",
    "escape": 'x: "S3CRET\\q"\n',
    "anchors": "x: &S3CRET 1\ny: &S3CRET 2\n",
    "control": "S3CRET\x01\n",
    "list": "- S3CRET\n- S3CRET2\n",
    "dup.json": '{"S3CRET": 1, "S3CRET": 2}',
    "bad.json": '{"S3CRET": S3CRET}',
    "list.json": '["S3CRET"]',
}


@pytest.mark.parametrize("name", list(SECRET_FILES))
def test_a_spec_that_is_another_file_is_never_quoted(tmp_path: Path, name: str) -> None:
    secret = tmp_path / "private" / name
    secret.parent.mkdir()
    secret.write_text(SECRET_FILES[name])
    link = tmp_path / ("spec.json" if name.endswith(".json") else "spec.yaml")
    link.symlink_to(secret)
    with pytest.raises(ConfigError) as info:
        load_spec(link)
    message = str(info.value)
    assert message.startswith(f"{link}: ") and "\n" not in message, message
    said = message[len(f"{link}: ") :]
    for piece in ("S3CRET", "4242", "root", "AWS", "password", "BEGIN"):
        assert piece not in said, message


def test_sweep_create_of_a_link_to_a_private_file_names_only_the_file(tmp_path: Path) -> None:
    (tmp_path / "shadow").write_text(SECRET_FILES["shadow"])
    (tmp_path / "s.yaml").symlink_to(tmp_path / "shadow")
    line = one_line_exit_2(cli("sweep", "create", "s.yaml", "--db", "sqlite:s.db", cwd=tmp_path))
    assert line.startswith("preemptible: s.yaml: a spec is a mapping of keys"), line
    assert "none of them" in line and "S3CRET" not in line and "root:" not in line


def test_a_spec_with_mistakes_is_still_quoted(tmp_path: Path) -> None:
    """A document with a key of a spec is the user's spec: its keys and values are named."""
    cases = {
        "method: grid\nmethod: randoms\nparameters: {x: {value: 1}}\n": "'randoms' is not valid",
        "method: hyperband\nparameters: {x: {value: 1}}\n": "method: 'hyperband' is not valid",
        "method: grid\nrun_caps: 3\n": "run_caps: not a sweep key",
        "method: grid\nparameters: {x: *nope}\n": "found undefined alias (line 2",
    }
    for text, expected in cases.items():
        path = tmp_path / "s.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(expected)):
            load_spec(path)
