"""The ``preemptible`` command line. Thin over the library; logging is configured here only."""

from __future__ import annotations

import importlib.util
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from . import __version__
from ._errors import PreemptibleError
from ._states import Control, QueueState

# No auto_envvar_prefix: an option reads an environment variable only where it names one
# (envvar=..., shown in --help). Automatic PREEMPTIBLE_<OPTION> names turned variables set for
# other purposes into options: PREEMPTIBLE_NOW=1 made `sweep cancel` SIGKILL, and the
# PREEMPTIBLE_RUN_ID every attempt gets made a nested `preemptible run` join its parent's run.
# Nothing destructive (--now) and nothing a supervisor sets for its attempts reads one.
CONTEXT = {"help_option_names": ["-h", "--help"]}


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, prog_name="preemptible")
@click.option("-v", "--verbose", is_flag=True, help="Log at DEBUG level, other libraries too.")
def main(verbose: bool) -> None:
    """Training runs that survive being stopped."""
    # preemptible's own lines at INFO; the libraries it loads (matplotlib for --plot and the
    # demo, psycopg, ...) only from WARNING, so their chatter ("generated new fontManager")
    # never lands among ours
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("preemptible").setLevel(logging.DEBUG if verbose else logging.INFO)


def _home_option(help_text: str) -> Callable[[Any], Any]:
    """``--home`` (``PREEMPTIBLE_HOME``), where run directories go; each command says why."""
    option: Callable[[Any], Any] = click.option(
        "--home",
        type=click.Path(file_okay=False, path_type=Path),
        default=Path(".preemptible"),
        show_default=True,
        envvar="PREEMPTIBLE_HOME",
        show_envvar=True,
        help=help_text,
    )
    return option


def _fail(message: str, code: int = 2) -> NoReturn:
    click.echo(f"preemptible: {message}", err=True)
    sys.exit(code)


@main.command(
    context_settings={**CONTEXT, "ignore_unknown_options": True, "allow_interspersed_args": False}
)
@click.option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="PREEMPTIBLE_CHECKPOINT_DIR",
    show_envvar=True,
    help="Checkpoints of the job (default: .preemptible/runs/RUN_ID/checkpoints); "
    "each attempt gets the newest as PREEMPTIBLE_RESUME_FROM. The variable is the one "
    "attempts get, so a nested `preemptible run` keeps its parent's checkpoints.",
)
@click.option(
    "--max-failures",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    envvar="PREEMPTIBLE_MAX_FAILURES",
    show_envvar=True,
    help="Restart a FAILED or CRASHED attempt this many times.",
)
@click.option(
    "--max-preemptions",
    type=click.IntRange(min=0),
    default=None,
    envvar="PREEMPTIBLE_MAX_PREEMPTIONS",
    show_envvar=True,
    help="Restart a PREEMPTED attempt this many times [default: unlimited].",
)
@click.option(
    "--term-timeout",
    type=click.FloatRange(min=0),
    default=None,
    envvar="PREEMPTIBLE_TERM_TIMEOUT",
    show_envvar=True,
    help="Seconds from the first stop signal to SIGKILL of the job [default: "
    "PREEMPTIBLE_GRACE_PERIOD - 2; under SLURM at most 2 s before SLURM's own SIGKILL "
    "(KillWait after its SIGTERM); on Kubernetes 28; else 60].",
)
@click.option(
    "--no-forward-signals",
    is_flag=True,
    help="Do not pass INT/TERM/HUP/USR1/USR2 on to the job's process group.",
)
@click.option(
    "--pid-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the job's pid here while it runs.",
)
@click.option(
    "--run-id",
    default=None,
    help="Name of the run, its directory under --home [default: slurm-JOBID under SLURM, "
    "else derived from --checkpoint-dir, else from the working directory and the command, "
    "so that running the same command again continues the run; inside another run's "
    "attempt, also from that run's id].",
)
@click.option(
    "--restart-delay",
    type=click.FloatRange(min=0, max=86400),
    default=1.0,
    show_default=True,
    envvar="PREEMPTIBLE_RESTART_DELAY",
    show_envvar=True,
    help="Seconds before a restart; doubles per failure.",
)
@_home_option("Where run directories go.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(
    checkpoint_dir: Path | None,
    max_failures: int,
    max_preemptions: int | None,
    term_timeout: float | None,
    no_forward_signals: bool,
    pid_file: Path | None,
    run_id: str | None,
    restart_delay: float,
    home: Path,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND, pass signals on to all of it, classify every ending, restart and resume.

    Exit code, from how the last attempt ended:

    \b
      0           FINISHED   the job exited 0 and did not stop early
      128+signum  PREEMPTED  stopped by a signal or notice: 143 TERM, 130 INT, 138 USR1
      job's code  FAILED     the job exited non-zero on its own
      130         KILLED     Ctrl+C (SIGINT) that the job did not handle
      128+signum  CRASHED    died by a signal without saving (137: SIGKILL)
      2           bad usage, or another supervisor runs this run
    """
    from .supervisor import Supervisor, SupervisorConfig

    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    try:
        config = SupervisorConfig(
            command=argv,
            checkpoint_dir=checkpoint_dir,
            max_failures=max_failures,
            max_preemptions=max_preemptions,
            term_timeout=term_timeout,
            forward_signals=not no_forward_signals,
            pid_file=pid_file,
            run_id=run_id,
            restart_delay=restart_delay,
            home=home,
        )
        code = Supervisor(config).run()
    except PreemptibleError as exc:
        _fail(str(exc))
    sys.exit(code)


@main.command(context_settings=CONTEXT)
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def doctor(as_json: bool) -> None:
    """Say what would happen here on a preemption, and what to change when it is wrong."""
    import json

    from ._doctor import diagnose

    try:
        checks = diagnose()
    except PreemptibleError as exc:
        _fail(str(exc))
    if as_json:
        click.echo(json.dumps([c.as_dict() for c in checks], indent=1))
        return
    width = max(len(c.name) for c in checks)
    marks = {"ok": "ok  ", "warn": "WARN", "info": "    "}
    for c in checks:
        click.echo(f"{marks[c.status]} {c.name:<{width}}  {c.detail}")
        if c.fix and c.status == "warn":
            click.echo(f"     {'':<{width}}  fix: {c.fix}")


@main.command(context_settings=CONTEXT)
@click.option(
    "--single",
    is_flag=True,
    help="The single-run demo: train, SIGTERM at a random step, resume, compare.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=10),
    default=None,
    help="Training steps of each run, with --single [default: 200].",
)
@click.option(
    "--seed",
    type=int,
    default=None,
    help="Seed that picks the steps to interrupt at (default: random).",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the queue, runs and checkpoints go (default: a temporary directory).",
)
@click.option(
    "--serve",
    is_flag=True,
    help="Then serve the sweep's web page (status --serve) until Ctrl+C.",
)
@click.option("--port", type=int, default=None, help="--serve's port (0: any) [default: 8765].")
def demo(
    single: bool,
    steps: int | None,
    seed: int | None,
    workdir: Path | None,
    serve: bool,
    port: int | None,
) -> None:
    """Run a 6-run sweep with two agents on an SQLite queue, preempt two runs mid-way (SIGTERM
    to an agent, a stop file), let other agents resume them, and compare their final weights
    with uninterrupted runs bit for bit; --serve: then serve its web page until Ctrl+C.
    --single: one run, SIGTERM, resume, compare."""
    if steps is not None and not single:
        _fail("--steps is for --single; the sweep demo's runs have a fixed length")
    if single and serve:
        _fail("--serve is for the sweep demo, not --single")
    if port is not None and not serve:
        _fail("--port goes with --serve")
    if importlib.util.find_spec("torch") is None:  # not imported here: a bad --workdir is quick
        _fail("the demo needs PyTorch: pip install 'preemptible[torch]'")
    try:
        if workdir is None:
            workdir = Path(tempfile.mkdtemp(prefix="preemptible-demo-"))
        workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=workdir):
            pass  # writable: fail here, not in the middle of the demo
    except OSError as exc:
        where = workdir if workdir is not None else "a temporary directory"
        _fail(
            f"cannot use {where} for the demo ({exc.strerror or exc}); give --workdir a "
            "writable directory"
        )
    if not single:
        from ._sweep_demo import run_sweep_demo
        from .sweeps._web import DEFAULT_PORT, check_port

        try:
            if serve:  # a busy port: said now, not after the demo
                check_port("127.0.0.1", DEFAULT_PORT if port is None else port)
            code = run_sweep_demo(
                workdir,
                seed=seed,
                echo=click.echo,
                serve=serve,
                port=DEFAULT_PORT if port is None else port,
            )
        except PreemptibleError as exc:  # the page could not be served
            _fail(str(exc))
        sys.exit(code)
    steps = 200 if steps is None else steps
    rng = random.Random(seed)
    stop_at = rng.randrange(steps // 5, steps - steps // 5)
    cmd = [sys.executable, "-m", "preemptible._demo", "--steps", str(steps)]
    ref_out, run_out = workdir / "uninterrupted.pt", workdir / "interrupted.pt"
    ckpt = workdir / "checkpoints"

    click.echo(f"preemptible demo: a small classifier, {steps} steps, in {workdir}")
    t0 = time.monotonic()
    ref = subprocess.run(
        [*cmd, "--checkpoint-dir", str(workdir / "ref-ckpt"), "--out", str(ref_out)],
        capture_output=True,
        text=True,
    )
    if ref.returncode != 0:
        _fail(f"the uninterrupted run failed:\n{ref.stdout}{ref.stderr}", 1)
    click.echo(
        f"  1. uninterrupted run            exit {ref.returncode}  ({time.monotonic() - t0:.1f} s)"
    )

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = [*cmd, "--checkpoint-dir", str(ckpt), "--out", str(run_out)]
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    log = []
    for line in proc.stdout:
        log.append(line)
        if line.strip() == f"step {stop_at}":
            proc.send_signal(signal.SIGTERM)
    code = proc.wait()
    saved = sorted(ckpt.glob("step-*.ckpt"))
    if code != 128 + signal.SIGTERM or not saved:
        _fail(f"the interrupted run did not stop as expected (exit {code}):\n{''.join(log)}", 1)
    click.echo(
        f"  2. SIGTERM during step {stop_at:<4}    exit {code}  (checkpoint {saved[-1].name})"
    )

    resumed = subprocess.run(args, capture_output=True, text=True)
    first = resumed.stdout.splitlines()[0] if resumed.stdout else ""
    if resumed.returncode != 0:
        _fail(f"the resumed run failed:\n{resumed.stdout}{resumed.stderr}", 1)
    click.echo(f"  3. same command again           exit {resumed.returncode}  ({first})")

    import torch

    a = torch.load(ref_out, weights_only=True)
    b = torch.load(run_out, weights_only=True)
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    values = sum(t.numel() for t in a.values())
    if same:
        click.echo(
            f"  final weights of 2+3 and 1: identical, bit for bit "
            f"({len(a)} tensors, {values} values)"
        )
        return
    click.echo("  final weights of 2+3 and 1: DIFFERENT")
    sys.exit(1)


# -- sweeps ----------------------------------------------------------------------------------

DB_HELP = (
    "The sweep database: postgresql://USER:PASSWORD@HOST/DB for agents on several machines "
    "[default: an SQLite file under ./.preemptible/]."
)


def _db_option(f: Any) -> Any:
    return click.option(
        "--db", default=None, envvar="PREEMPTIBLE_DB", show_envvar=True, help=DB_HELP
    )(f)


@main.group(context_settings=CONTEXT)
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

    from .sweeps._sample import propose
    from .sweeps._spec import load_spec
    from .sweeps._store import open_store

    try:
        parsed = load_spec(spec)
        for key in parsed.ignored:
            click.echo(f"preemptible: {spec}: {key} is accepted and ignored", err=True)
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
    from .sweeps._store import open_store

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
    from .sweeps._store import open_store

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


@main.command(context_settings=CONTEXT)
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
@_home_option("Where run directories and checkpoints go (shared by agents on several machines).")
def agent(
    sweep_id: str,
    db: str | None,
    count: int | None,
    heartbeat: float,
    lease: float,
    max_consecutive_failures: int,
    home: Path,
) -> None:
    """Claim runs of SWEEP_ID and run them until the sweep has nothing left.

    \b
    Exit code: 0 nothing left (or --count runs done); 128+signum stopped by a signal (the
    running run was stopped, saved and handed back); 2 bad usage or database, or runs that
    could not start (--max-consecutive-failures); 1 runs that failed within seconds.
    """
    from .sweeps._agent import Agent, AgentConfig

    try:
        config = AgentConfig(
            sweep_id=sweep_id,
            db=db,
            count=count,
            heartbeat=heartbeat,
            lease=lease,
            home=home,
            max_consecutive_failures=max_consecutive_failures,
        )
        code = Agent(config).run()
    except PreemptibleError as exc:
        _fail(str(exc))
    sys.exit(code)


@main.command(context_settings=CONTEXT)
@_home_option("Where `preemptible run` put the run directories.")
@click.option("--json", "as_json", is_flag=True, help="Print the runs as JSON.")
def runs(home: Path, as_json: bool) -> None:
    """The runs `preemptible run` supervised here: the last attempt's state (RUNNING while a
    supervisor holds the run, LOST when it died without a word), attempts, exit code, and
    the newest checkpoint a restart would resume from."""
    import json

    from rich.console import Console

    from .supervisor._runs import list_runs, render_runs

    rows = list_runs(home)
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    Console(width=None if sys.stdout.isatty() else 200).print(render_runs(rows, time.time()))


@main.command(context_settings=CONTEXT)
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
    from .sweeps._status import show_status

    try:
        if serve:
            if sweep_id is None or as_json or watch is not None or plot is not None:
                _fail("--serve needs a SWEEP_ID, and no --json, --watch or --plot")
            from .sweeps._web import serve_status

            serve_status(db, sweep_id, host=host, port=port, home=home)
            return
        show_status(db, sweep_id, as_json=as_json, watch_every=watch, plot=plot)
    except PreemptibleError as exc:
        _fail(str(exc))
