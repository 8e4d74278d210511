"""The sweep commands of the ``preemptible`` command line: ``sweep`` (create, stop, pause,
resume, cancel), ``agent`` and ``status``. ``preemptible.cli._main`` registers them on its group."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from .._errors import PreemptibleError
from .._states import Control, QueueState
from ._common import CONTEXT, CheckpointLocation, _fail, _home_option

DB_HELP = (
    "The sweep database: postgresql://USER:PASSWORD@HOST/DB for agents on several machines "
    "[default: an SQLite file under ./.preemptible/]."
)


def _db_option(f: Any) -> Any:
    return click.option(
        "--db", default=None, envvar="PREEMPTIBLE_DB", show_envvar=True, help=DB_HELP
    )(f)


@click.group(context_settings=CONTEXT)
def sweep() -> None:
    """Create and control sweeps: many runs of one program, run by agents from a queue."""


@sweep.command("create", context_settings=CONTEXT)
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--name", default=None, help="A name to show in status [default: the spec's name].")
@_db_option
def sweep_create(spec: Path, name: str | None, db: str | None) -> None:
    """Create a sweep from SPEC (YAML, W&B's sweep format); print its id (last)."""
    import json
    import secrets

    from ..sweeps.spec._sample import propose
    from ..sweeps.spec._spec import load_spec
    from ..sweeps.store._queue import open_store

    try:
        parsed = load_spec(spec)
        for key in parsed.ignored:
            click.echo(f"preemptible: {spec}: {key} is accepted and ignored", err=True)
        for warning in parsed.warnings:
            click.echo(f"preemptible: {spec}: warning: {warning}", err=True)
        with open_store(db) as store:
            seed = secrets.randbelow(2**31)
            sweep_id = store.create_sweep(
                json.loads(json.dumps(parsed.raw)),
                name=name or parsed.name,
                run_cap=parsed.run_cap,
                max_failures=parsed.max_failures,
                max_preemptions=parsed.max_preemptions,
                seed=seed,
            )
            if parsed.method == "grid":  # the whole grid is known: queue it, status shows it
                size = parsed.grid_size() or 0
                if parsed.run_cap is not None:
                    size = min(size, parsed.run_cap)
                points = [propose(parsed, [], index=i, seed=seed) for i in range(size)]
                store.add_runs(sweep_id, [p for p in points if p is not None])
            where = store.display
    except PreemptibleError as exc:
        _fail(str(exc))
    click.echo(f"created sweep in {where}; start agents with: preemptible agent {sweep_id}")
    click.echo(sweep_id)


def _control(sweep_id: str, db: str | None, control: Control, *, now: bool = False) -> None:
    from ..sweeps.store._queue import open_store

    try:
        with open_store(db, create=False) as store:
            store.set_control(sweep_id, control, now=now)
    except PreemptibleError as exc:
        _fail(str(exc))
    click.echo(f"sweep {sweep_id}: {control}{' (now)' if now else ''}")


@sweep.command("stop", context_settings=CONTEXT)
@click.argument("sweep_id")
@_db_option
def sweep_stop(sweep_id: str, db: str | None) -> None:
    """No new runs are claimed; running runs finish."""
    _control(sweep_id, db, Control.STOPPED)


@sweep.command("pause", context_settings=CONTEXT)
@click.argument("sweep_id")
@_db_option
def sweep_pause(sweep_id: str, db: str | None) -> None:
    """No new runs are claimed until `sweep resume`; agents wait."""
    _control(sweep_id, db, Control.PAUSED)


@sweep.command("resume", context_settings=CONTEXT)
@click.argument("sweep_id")
@click.option(
    "--run",
    "run_id",
    default=None,
    metavar="RUN_ID",
    help="Put back this one run that early termination STOPPED (it continues from its "
    "checkpoint and is not stopped early again); the sweep's own state is left as it is.",
)
@_db_option
def sweep_resume(sweep_id: str, run_id: str | None, db: str | None) -> None:
    """Claims start again after `sweep pause` or `sweep stop`; with --run, one run that early
    termination stopped goes back to the queue instead."""
    if run_id is None:
        _control(sweep_id, db, Control.RUNNING)
        return
    from ..sweeps.store._queue import open_store

    try:
        with open_store(db, create=False) as store:
            store.resume_stopped(sweep_id, run_id)
    except PreemptibleError as exc:
        _fail(str(exc))
    click.echo(f"run {run_id}: {QueueState.PENDING}; the next agent resumes it from its checkpoint")


@sweep.command("cancel", context_settings=CONTEXT)
@click.argument("sweep_id")
@click.option(
    "--now",
    is_flag=True,
    help="SIGKILL running runs at once (no save). Never read from the environment.",
)
@_db_option
def sweep_cancel(sweep_id: str, now: bool, db: str | None) -> None:
    """Running runs get SIGTERM (they save), then SIGKILL after the term timeout; pending
    runs are cancelled."""
    _control(sweep_id, db, Control.CANCELLED, now=now)


@click.command(context_settings=CONTEXT)
@click.argument("sweep_id")
@_db_option
@click.option(
    "--count",
    type=click.IntRange(min=1),
    default=None,
    help="Run at most N runs.",
)
@click.option(
    "--heartbeat",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    envvar="PREEMPTIBLE_HEARTBEAT",
    show_envvar=True,
    help="Seconds between lease renewals (and looks at the sweep's control).",
)
@click.option(
    "--lease",
    type=click.FloatRange(min=0, min_open=True),
    default=60.0,
    show_default=True,
    envvar="PREEMPTIBLE_LEASE",
    show_envvar=True,
    help="Seconds a run stays this agent's without a renewal (at least 3 heartbeats). The "
    "run stops itself (saves) 20 % of the lease before it ends unless renewed; another agent "
    "may take it over 20 % of the lease after.",
)
@click.option(
    "--max-consecutive-failures",
    type=click.IntRange(min=0),
    default=5,
    show_default=True,
    help="Exit after this many runs in a row that could not start or failed within 10 s "
    "(0: never).",
)
@click.option(
    "--checkpoint-dir",
    type=CheckpointLocation(),
    default=None,
    envvar="PREEMPTIBLE_AGENT_CHECKPOINT_DIR",
    show_envvar=True,
    help="Keep each run's checkpoints under DIR_OR_URL/RUN_ID [default: the run's directory "
    "under --home]. A bucket's URL (s3://bucket/prefix, gs://..., az://...) needs no disk "
    "shared by agents on several machines; a run preempted on one resumes on another.",
)
@_home_option(
    "Where run directories and checkpoints go (without a --checkpoint-dir URL: "
    "shared by agents on several machines)."
)
def agent(
    sweep_id: str,
    db: str | None,
    count: int | None,
    heartbeat: float,
    lease: float,
    max_consecutive_failures: int,
    checkpoint_dir: Path | str | None,
    home: Path,
) -> None:
    """Claim runs of SWEEP_ID and run them until the sweep has nothing left.

    \b
    Exit code: 0 nothing left (or --count runs done); 128+signum stopped by a signal (the
    running run was stopped, saved and handed back); 2 bad usage or database, or runs that
    could not start (--max-consecutive-failures); 1 runs that failed within seconds.
    """
    from ..sweeps.agent._agent import Agent, AgentConfig

    try:
        config = AgentConfig(
            sweep_id=sweep_id,
            db=db,
            count=count,
            heartbeat=heartbeat,
            lease=lease,
            home=home,
            max_consecutive_failures=max_consecutive_failures,
            checkpoint_dir=checkpoint_dir,
        )
        code = Agent(config).run()
    except PreemptibleError as exc:
        _fail(str(exc))
    sys.exit(code)


@click.command(context_settings=CONTEXT)
@click.argument("sweep_id", required=False)
@_db_option
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.option(
    "--watch",
    "watch",
    type=click.FloatRange(min=0.2),
    default=None,
    is_flag=False,
    flag_value=2.0,
    help="Refresh every N seconds (default 2) until Ctrl+C.",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Draw the sweep's timeline (a bar per attempt) into this picture (PNG, SVG, PDF).",
)
@click.option("--serve", is_flag=True, help="Serve the sweep as a live web page until Ctrl+C.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address --serve binds.")
@click.option("--port", type=int, default=8765, show_default=True, help="--serve's port (0: any).")
@_home_option("With --serve: the agents' --home, where a run's page reads its journal and records.")
def status(
    sweep_id: str | None,
    db: str | None,
    as_json: bool,
    watch: float | None,
    plot: Path | None,
    serve: bool,
    host: str,
    port: int,
    home: Path,
) -> None:
    """The sweeps in the database, or one sweep's runs (state, attempts, checkpoint step,
    metric, agent@host, heartbeat age, duration); --serve: as a web page."""
    from ..sweeps.status._status import show_status

    try:
        if serve:
            if sweep_id is None or as_json or watch is not None or plot is not None:
                _fail("--serve needs a SWEEP_ID, and no --json, --watch or --plot")
            from ..sweeps.web._server import serve_status

            serve_status(db, sweep_id, host=host, port=port, home=home)
            return
        show_status(db, sweep_id, as_json=as_json, watch_every=watch, plot=plot)
    except PreemptibleError as exc:
        _fail(str(exc))
