"""The ``preemptible`` command line. Thin over the library; logging is configured here only."""

from __future__ import annotations

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

from . import __version__

CONTEXT = {"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "PREEMPTIBLE"}


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, prog_name="preemptible")
@click.option("-v", "--verbose", is_flag=True, help="Log at DEBUG level.")
def main(verbose: bool) -> None:
    """Training runs that survive being stopped."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )


def _fail(message: str, code: int = 2) -> None:
    click.echo(f"preemptible: {message}", err=True)
    sys.exit(code)


@main.command(context_settings=CONTEXT)
@click.option(
    "--steps",
    type=click.IntRange(min=10),
    default=200,
    show_default=True,
    show_envvar=True,
    help="Training steps of each run.",
)
@click.option(
    "--seed",
    type=int,
    default=None,
    show_envvar=True,
    help="Seed that picks the step to interrupt (default: random).",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    show_envvar=True,
    help="Where checkpoints go (default: a temporary directory).",
)
def demo(steps: int, seed: int | None, workdir: Path | None) -> None:
    """Train a small model, SIGTERM it at a random step, resume it, compare with an
    uninterrupted run bit for bit."""
    try:
        import torch
    except ImportError:
        _fail("the demo needs PyTorch: pip install 'preemptible[torch]'")
    if workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="preemptible-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
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
