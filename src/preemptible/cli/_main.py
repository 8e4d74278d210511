"""The ``preemptible`` command line. Thin over the library; logging is configured here only.

Here: the group and ``run``, ``doctor``, ``demo``, ``runs``; the sweep commands (``sweep``,
``agent``, ``status``) are ``_sweep``'s, registered here in their old order."""

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
from pathlib import Path

import click

from .. import __version__
from .._errors import PreemptibleError
from ._common import CONTEXT, CheckpointLocation, _fail, _home_option
from ._sweep import agent, status, sweep


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


@main.command(
    context_settings={**CONTEXT, "ignore_unknown_options": True, "allow_interspersed_args": False}
)
@click.option(
    "--checkpoint-dir",
    type=CheckpointLocation(),
    envvar="PREEMPTIBLE_CHECKPOINT_DIR",
    show_envvar=True,
    help="A directory or a bucket's URL for the checkpoints of the job (default: "
    ".preemptible/runs/RUN_ID/checkpoints); each attempt gets the newest as "
    "PREEMPTIBLE_RESUME_FROM. A URL (s3://bucket/prefix, gs://..., az://...) keeps them "
    "in a bucket: each attempt, on this machine or a new "
    "one, resumes from the newest committed there. The variable is the one attempts get, so "
    "a nested `preemptible run` keeps its parent's checkpoints.",
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
    checkpoint_dir: Path | str | None,
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
      128+signum  PREEMPTED  stopped by a signal or notice: 143 TERM, 130 INT, 138 USR1 (a
                             signal passed on is a stop wherever it lands: start-up too)
      job's code  FAILED     the job exited non-zero on its own
      130         KILLED     Ctrl+C (SIGINT) to the job alone, that it did not handle
      128+signum  CRASHED    died by a signal nobody passed on (137: SIGKILL, OOM killer)
      2           bad usage, or another supervisor runs this run
    """
    from ..supervisor import Supervisor, SupervisorConfig

    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    try:
        source = click.get_current_context().get_parameter_source("checkpoint_dir")
        config = SupervisorConfig(
            command=argv,
            checkpoint_dir=checkpoint_dir,
            checkpoint_dir_from_env=source is click.core.ParameterSource.ENVIRONMENT,
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
@click.option(
    "--checkpoint-dir",
    envvar="PREEMPTIBLE_CHECKPOINT_DIR",
    show_envvar=True,
    default=None,
    metavar="DIR_OR_URL",
    help="Also check this checkpoint location: for a URL (s3://, gs://, az://), that its "
    "bucket answers here, with which credentials.",
)
def doctor(as_json: bool, checkpoint_dir: str | None) -> None:
    """Say what would happen here on a preemption, and what to change when it is wrong."""
    import json

    from ..doctor._doctor import diagnose

    try:
        checks = diagnose(checkpoint_dir)
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
        from ..demo._sweep import run_sweep_demo
        from ..sweeps.web._server import DEFAULT_PORT, check_port

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
    cmd = [sys.executable, "-m", "preemptible.demo._demo", "--steps", str(steps)]
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


main.add_command(sweep)
main.add_command(agent)


@main.command(context_settings=CONTEXT)
@_home_option("Where `preemptible run` put the run directories.")
@click.option("--json", "as_json", is_flag=True, help="Print the runs as JSON.")
def runs(home: Path, as_json: bool) -> None:
    """The runs `preemptible run` supervised here: the last attempt's state (RUNNING while a
    supervisor holds the run, LOST when it died without a word), attempts, exit code, and
    the newest checkpoint a restart would resume from."""
    import json

    from rich.console import Console

    from ..supervisor._runs import list_runs, render_runs

    rows = list_runs(home)
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    Console(width=None if sys.stdout.isatty() else 200).print(render_runs(rows, time.time()))


main.add_command(status)
