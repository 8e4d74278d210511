"""Options come only from documented variables: no automatic ``PREEMPTIBLE_<OPTION>`` names,
every variable an option reads is named in its command's ``--help`` and in the table of
docs/reference/environment.md, and nothing destructive (``--now``) or set by a supervisor for
its attempts (``--run-id``, ``--pid-file``) reads one."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from preemptible.cli._main import main
from tests.conftest import ROOT
from tests.support.env import CLEAN

# Each variable an option reads, by command; a new one must be documented
# (docs/reference/environment.md) and added.
DOCUMENTED = {
    "run": {
        "--checkpoint-dir": "PREEMPTIBLE_CHECKPOINT_DIR",
        "--max-failures": "PREEMPTIBLE_MAX_FAILURES",
        "--max-preemptions": "PREEMPTIBLE_MAX_PREEMPTIONS",
        "--term-timeout": "PREEMPTIBLE_TERM_TIMEOUT",
        "--restart-delay": "PREEMPTIBLE_RESTART_DELAY",
        "--home": "PREEMPTIBLE_HOME",
    },
    "agent": {
        "--db": "PREEMPTIBLE_DB",
        "--heartbeat": "PREEMPTIBLE_HEARTBEAT",
        "--lease": "PREEMPTIBLE_LEASE",
        "--checkpoint-dir": "PREEMPTIBLE_AGENT_CHECKPOINT_DIR",
        "--home": "PREEMPTIBLE_HOME",
    },
    "doctor": {"--checkpoint-dir": "PREEMPTIBLE_CHECKPOINT_DIR"},
    "runs": {"--home": "PREEMPTIBLE_HOME"},
    "status": {"--db": "PREEMPTIBLE_DB", "--home": "PREEMPTIBLE_HOME"},
    **{f"sweep {c}": {"--db": "PREEMPTIBLE_DB"} for c in ("create", "stop", "pause", "resume")},
    "sweep cancel": {"--db": "PREEMPTIBLE_DB"},
}
NEVER = {("sweep cancel", "--now"), ("run", "--run-id"), ("run", "--pid-file")}


def commands(group: click.Group = main, prefix: str = "") -> Iterator[tuple[str, click.Command]]:
    for name, command in sorted(group.commands.items()):
        path = f"{prefix}{name}"
        if isinstance(command, click.Group):
            yield from commands(command, f"{path} ")
        else:
            yield path, command


def variables(command: click.Command) -> dict[str, str]:
    found = {}
    for param in command.params:
        if isinstance(param, click.Option) and param.envvar:
            assert isinstance(param.envvar, str), param.envvar
            found[max(param.opts, key=len)] = param.envvar
    return found


def test_no_command_maps_options_to_variables_automatically() -> None:
    for group in (main, *(c for _, c in commands() if isinstance(c, click.Group))):
        assert not group.context_settings.get("auto_envvar_prefix"), group.name
    for path, command in commands():
        assert not command.context_settings.get("auto_envvar_prefix"), path
        ctx = command.make_context(path, ["--help"], resilient_parsing=True)
        assert ctx.auto_envvar_prefix is None, path


def test_every_variable_is_the_documented_one_and_named_in_help() -> None:
    table = (ROOT / "docs" / "reference" / "environment.md").read_text()  # every variable
    runner = CliRunner()
    seen = {}
    for path, command in commands():
        found = variables(command)
        if found:
            seen[path] = found
        text = runner.invoke(main, [*path.split(), "--help"], terminal_width=200).output
        for option, var in found.items():
            assert f"env var: {var}" in text, (path, option, text)
            assert f"`{var}`" in table, (
                f"{var} ({path} {option}) is not in docs/reference/environment.md"
            )
        for never_path, option in NEVER:
            if never_path == path:
                assert option not in found, (path, option)
    assert seen == DOCUMENTED


def test_an_undocumented_variable_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every name click's automatic mapping would have read, set to a value that would show:
    each option keeps its default."""
    for path, command in commands():
        for param in command.params:
            if isinstance(param, click.Option) and not param.envvar:
                name = param.name.upper() if param.name else ""
                for prefix in ("PREEMPTIBLE", "PREEMPTIBLE_" + path.upper().replace(" ", "_")):
                    monkeypatch.setenv(f"{prefix}_{name}", "1" if param.is_flag else "7")
    cancel = dict(commands())["sweep cancel"]
    ctx = cancel.make_context("cancel", ["SWEEP"])
    assert ctx.params["now"] is False
    run = dict(commands())["run"]
    ctx = run.make_context("run", ["--", "true"])
    assert ctx.params["run_id"] is None and ctx.params["pid_file"] is None
    assert ctx.params["no_forward_signals"] is False


def test_a_documented_variable_is_read(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PREEMPTIBLE_MAX_FAILURES", "4")
    monkeypatch.setenv("PREEMPTIBLE_CHECKPOINT_DIR", str(tmp_path))
    run = dict(commands())["run"]
    ctx = run.make_context("run", ["--", "true"])
    assert ctx.params["max_failures"] == 4 and ctx.params["checkpoint_dir"] == tmp_path


# a bad value of each variable an attempt inherits and preemptible reads in it
BAD_JOB_VARIABLES = [
    ("PREEMPTIBLE_GRACE_PERIOD", "abc", "use seconds >= 0"),
    ("PREEMPTIBLE_PLATFORM", "aws", "use one of slurm, gce, ec2, azure, kubernetes, local"),
    ("PREEMPTIBLE_POLL_INTERVAL", "0", "use seconds > 0"),
    ("PREEMPTIBLE_GCE_NOTICE_SECONDS", "soon", "use seconds >= 0"),
    ("PREEMPTIBLE_MTBF", "-1", "use seconds > 0"),
    ("PREEMPTIBLE_DIST_TIMEOUT", "x", "use seconds > 0"),
    ("PREEMPTIBLE_DIST_POLL", "0", "use seconds > 0"),
    ("GCE_METADATA_HOST", "a b", "use host[:port] or an http(s):// URL"),
    ("PREEMPTIBLE_STOP_FILE", "/", "it is a directory; name a file"),
]


@pytest.mark.parametrize(("name", "value", "valid"), BAD_JOB_VARIABLES)
def test_run_refuses_a_bad_variable_of_its_job_before_the_job_starts(
    name: str, value: str, valid: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The job would fail at its handler with a traceback, a FAILED attempt (exit 1), after
    the supervisor warned "ignoring it" (the grace period) or said nothing: one line, exit 2,
    and no job started, as docs/reference/environment.md says."""
    for var in (n for n, _, _ in BAD_JOB_VARIABLES):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(name, value)
    started = tmp_path / "started"
    job = ["--", sys.executable, "-c", f"open({str(started)!r}, 'w')"]
    done = CliRunner().invoke(main, ["run", "--home", str(tmp_path / "home"), *job])
    line = done.output.strip()
    assert done.exit_code == 2, done.output
    assert line.startswith(f"preemptible: {name}={value!r} is not valid") and valid in line, line
    assert "\n" not in line and not started.exists()
    assert not (tmp_path / "home" / "runs").exists()


@pytest.mark.timeout(60)
def test_a_bad_grace_period_is_one_line_from_the_command(tmp_path: Path) -> None:
    """The report's case, through the real command: no "ignoring it", no traceback."""
    env = {**os.environ, **CLEAN, "PREEMPTIBLE_GRACE_PERIOD": "abc"}
    proc = subprocess.run(
        [sys.executable, "-m", "preemptible", "run", "--", sys.executable, "-c", "pass"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "preemptible: PREEMPTIBLE_GRACE_PERIOD='abc' is not valid; use seconds >= 0, e.g. 30"
    )


@pytest.mark.parametrize("path", ["run", "agent", "doctor"])
def test_checkpoint_dir_says_a_url_is_valid(path: str) -> None:
    """``--checkpoint-dir DIRECTORY`` read as if a bucket's URL were not taken."""
    args = [*path.split(), "--help"]
    done = CliRunner().invoke(main, args, terminal_width=100)
    assert done.exit_code == 0, done.output
    assert "--checkpoint-dir DIR_OR_URL" in done.output
    assert "checkpoint-dir DIRECTORY" not in done.output
    assert "checkpoint-dir TEXT" not in done.output
    option = next(p for p in dict(commands())[path].params if p.name == "checkpoint_dir")
    assert "URL" in (option.help or "")


def test_a_run_s_checkpoint_directory_under_a_file_is_one_line(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    started = tmp_path / "started"
    done = CliRunner().invoke(
        main,
        [
            "run",
            "--home",
            str(tmp_path / "home"),
            "--checkpoint-dir",
            str(afile / "ckpt"),
            "--",
            sys.executable,
            "-c",
            f"open({str(started)!r}, 'w')",
        ],
    )
    assert done.exit_code == 2, done.output
    line = done.output.strip().splitlines()[-1]
    assert line == (
        f"preemptible: checkpoint directory: {afile / 'ckpt'} cannot be a directory: {afile} "
        "is a file, not a directory; give --checkpoint-dir (PREEMPTIBLE_CHECKPOINT_DIR) a "
        "directory"
    )
    assert not started.exists()
