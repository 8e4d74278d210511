"""``preemptible demo``: a 6-run sweep, two agents, two preemptions, exact resumes.

Everything the demo shows is real: the sweep is created with ``preemptible sweep create`` on
an SQLite queue in the work directory, agents are ``preemptible agent`` processes, agent 1 is
stopped with SIGTERM while its run is mid-way (the run saves, the agent hands it back and
exits 143) and a stop file stops another run mid-way (``PREEMPTIBLE_STOP_FILE``), and
whichever agent takes each of them next resumes it from its checkpoint. At the end the
preempted runs' final weights are compared bit for bit with the same configurations trained
uninterrupted, by the same program with the same arguments.

Which runs are preempted is fixed (agent 1 is started alone, so its first run is run 0; the
stop file waits for run 3), so the story and the status table have the same shape every time;
``--seed`` picks the steps at which the stops land.

With ``--serve`` the demo ends by serving its sweep's web page (``status --serve``: the runs
table, each run's curves with its preemption and resume marked) until Ctrl+C; without it,
it prints the command that serves the page, which works during the demo and after it.

Each agent has a stop file of its own (``PREEMPTIBLE_STOP_FILE`` in its environment, passed
on to its runs): touching it stops exactly the run that agent is running, never another
agent's, and the run removes it when it takes the request, so the resumed run goes on.

The agent processes and the reference runs are in ``_sweep_parts.py``.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import queue
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from .._errors import PreemptibleError
from .._states import Ending, QueueState
from ._sweep_parts import (
    _Agent,
    _last_line,
    compare_weights,
    train_reference,
    wait_reference,
)

if TYPE_CHECKING:
    from ..sweeps.store._queue import Store
    from ..sweeps.store._rows import AttemptRow

STEPS = 60
GRID: dict[str, list[Any]] = {"lr": [0.01, 0.03, 0.1], "hidden": [8, 32]}
HEARTBEAT = 0.5
LEASE = 5.0
SIGTERM_RUN = 0  # agent 1's first run: it starts alone, so it claims run 0
STOP_FILE_RUN = 3  # claimed later, always as a first attempt
POLL_INTERVAL = 0.2  # how often each run looks at its stop file (the default is 1 s)
DEADLINE = 240.0  # seconds the whole demo may take before it gives up
TABLE_WIDTH = 140  # the status table's width when the output is not a terminal
_STEP_LINE = re.compile(r"^(\S+) step (\d+)$")


class _DemoFailed(PreemptibleError):
    """A check failed; the message says which, in one line."""


class _Demo:
    def __init__(self, workdir: Path, seed: int | None, echo: Callable[[str], None]) -> None:
        self.workdir = workdir.absolute()
        self.echo = echo
        rng = random.Random(seed)
        self.sigterm_at = rng.randrange(STEPS // 3, 2 * STEPS // 3)
        self.stop_file_at = rng.randrange(STEPS // 3, 2 * STEPS // 3)
        self.db = f"sqlite:///{self.workdir / 'queue.db'}"
        self.home = self.workdir / ".preemptible"
        self.events: queue.Queue[tuple[_Agent, str | None]] = queue.Queue()
        self.agents: list[_Agent] = []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
        self.env.update(PYTHONUNBUFFERED="1", PREEMPTIBLE_POLL_INTERVAL=str(POLL_INTERVAL))
        self.spec: dict[str, Any] = {
            "name": "demo",
            "method": "grid",
            "metric": {"name": "loss", "goal": "minimize"},
            "command": [
                *("${interpreter}", "-m", "preemptible.demo._train"),
                *(f"--steps={STEPS}", "${args}"),
            ],
            "parameters": {name: {"values": values} for name, values in GRID.items()},
        }
        self.sweep_id = ""
        self.started = time.monotonic()
        self.deadline = self.started + DEADLINE
        self._store: Store | None = None

    # -- pieces ------------------------------------------------------------------------------
    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "preemptible", *args]

    def _create(self) -> str:
        import yaml

        path = self.workdir / "sweep.yaml"
        path.write_text(yaml.safe_dump(self.spec, sort_keys=False), encoding="utf-8")
        done = subprocess.run(
            self._cli("sweep", "create", str(path), "--db", self.db),
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0 or not done.stdout.strip():
            raise _DemoFailed(f"preemptible sweep create failed: {_last_line(done.stderr)}")
        return done.stdout.split()[-1]

    def _start_agent(self) -> _Agent:
        number = len(self.agents) + 1
        agent = _Agent(
            number,
            self._cli(
                *("agent", self.sweep_id, "--db", self.db),
                *("--heartbeat", f"{HEARTBEAT:g}", "--lease", f"{LEASE:g}"),
            ),
            cwd=self.workdir,
            env=self.env,
            stop_file=self.workdir / f"stop-agent-{number}",
            events=self.events,
        )
        self.agents.append(agent)
        return agent

    def _next_event(self) -> tuple[_Agent, str | None] | None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _DemoFailed(
                f"not done after {DEADLINE:.0f} s; the agents' logs are in {self.workdir}"
            )
        try:
            return self.events.get(timeout=min(left, 0.1))
        except queue.Empty:
            return None

    def _run_id(self, index: int) -> str:
        return f"{self.sweep_id}-{index}"

    @property
    def store(self) -> Store:
        from ..sweeps.store._queue import open_store

        if self._store is None:
            self._store = open_store(self.db)
        return self._store

    def _attempts(self, index: int) -> list[AttemptRow]:
        return list(self.store.attempts(self._run_id(index)))

    def _agent_of(self, agent_id: str) -> str:
        """``agent N`` for the id of one of this demo's agents (an id holds the agent's pid)."""
        for agent in self.agents:
            if re.search(rf"(?<!\d){agent.proc.pid}(?!\d)", agent_id):
                return f"agent {agent.number}"
        return f"agent {agent_id}"

    def _preempted(self, index: int, how: str) -> int:
        """Check that the first attempt of run ``index`` ended PREEMPTED with a checkpoint and
        the run went back to the queue; the checkpoint's step."""
        first = self._attempts(index)[0]
        if first.ending != Ending.PREEMPTED or first.checkpoint_step is None:
            raise _DemoFailed(
                f"run {self._run_id(index)} was not preempted by {how} as expected (it ended "
                f"{first.ending}, exit {first.exit_code}); see the agents' logs in {self.workdir}"
            )
        return int(first.checkpoint_step)

    # -- the story ---------------------------------------------------------------------------
    def run(self) -> int:
        grid = " x ".join(GRID)
        size = math.prod(len(values) for values in GRID.values())
        self.echo(
            f"preemptible demo: a {size}-run sweep of a small classifier, 2 agents at a time, "
            f"in {self.workdir}"
        )
        self.sweep_id = self._create()
        self.echo(
            f"  1. sweep {self.sweep_id} created: grid {grid}, {size} runs of {STEPS} steps, "
            f"queue {self.workdir / 'queue.db'}"
        )
        self.echo(  # the page reads the queue only: open it now or after the demo
            f"     live web page: preemptible status {self.sweep_id} --db {shlex.quote(self.db)} "
            f"--home {shlex.quote(str(self.home))} --serve (then open http://127.0.0.1:8765/)"
        )
        self._start_agent()
        self._wait_for_claim()  # alone, agent 1 claims run 0
        self._start_agent()
        self.echo(
            f"  2. agents 1 and 2 started: preemptible agent {self.sweep_id} "
            f"--heartbeat {HEARTBEAT:g} --lease {LEASE:g}"
        )
        self._watch()
        return self._finish()

    def _wait_for_claim(self) -> None:
        while self.store.runs(self.sweep_id)[SIGTERM_RUN].state != QueueState.RUNNING:
            event = self._next_event()
            if event is not None and event[1] is None:
                who = event[0]
                raise _DemoFailed(f"agent {who.number} exited {who.ended()}; see {who.log}")

    def _watch(self) -> None:
        """Follow the agents' output until every agent has exited: SIGTERM agent 1 mid-run,
        start agent 3 when agent 1 is gone, touch the stop file of whichever agent runs
        run 3 when it is mid-way."""
        sigtermed = False
        touched: _Agent | None = None
        stop_file_done = False
        next_look = 0.0
        while any(a.code is None for a in self.agents):
            event = self._next_event()
            if event is not None:
                agent, line = event
                if line is None:
                    self._ended(agent)
                    continue
                match = _STEP_LINE.match(line)
                if not match:
                    continue
                run_id, step = match.group(1), int(match.group(2))
                if (
                    not sigtermed
                    and agent.number == 1
                    and run_id == self._run_id(SIGTERM_RUN)
                    and step == self.sigterm_at
                ):
                    agent.proc.send_signal(signal.SIGTERM)
                    sigtermed = True
                elif (
                    touched is None
                    and run_id == self._run_id(STOP_FILE_RUN)
                    and step == self.stop_file_at
                ):
                    agent.stop_file.touch()
                    touched = agent
            if touched is not None and not stop_file_done and time.monotonic() >= next_look:
                next_look = time.monotonic() + 0.1
                attempts = self._attempts(STOP_FILE_RUN)
                if attempts and attempts[0].ending is not None:
                    stop_file_done = True
                    taken = not touched.stop_file.exists()
                    with contextlib.suppress(FileNotFoundError):
                        touched.stop_file.unlink()  # not taken: it must not stop another run
                    step = self._preempted(STOP_FILE_RUN, "the stop file")
                    if not taken:
                        raise _DemoFailed("the run did not take the stop file")
                    self.echo(
                        f"  5. stop file touched during step {self.stop_file_at} of run "
                        f"{self._run_id(STOP_FILE_RUN)} ({self._agent_of(attempts[0].agent)}): "
                        f"run PREEMPTED at step {step}, back in the queue"
                    )
        if not sigtermed:
            raise _DemoFailed(f"agent 1's run never reached step {self.sigterm_at}")
        if not stop_file_done:
            raise _DemoFailed(
                f"run {self._run_id(STOP_FILE_RUN)} never reached step {self.stop_file_at}"
            )

    def _ended(self, agent: _Agent) -> None:
        code = agent.ended()
        if agent.number == 1:
            if code != 128 + signal.SIGTERM:
                raise _DemoFailed(f"agent 1 exited {code}, not 143; see {agent.log}")
            step = self._preempted(SIGTERM_RUN, "SIGTERM")
            self.echo(
                f"  3. SIGTERM to agent 1 during step {self.sigterm_at} of run "
                f"{self._run_id(SIGTERM_RUN)}: agent exit {code}, run PREEMPTED at step {step}, "
                "back in the queue"
            )
            self._start_agent()
            self.echo("  4. agent 3 started, so that two agents keep working")
        elif code != 0:
            raise _DemoFailed(f"agent {agent.number} exited {code}; see {agent.log}")

    def _finish(self) -> int:
        from ..sweeps.status._snapshot import snapshot

        codes = ", ".join(f"{a.number}: exit {a.code}" for a in self.agents[1:])
        self.echo(
            f"  6. agents done ({codes}): nothing left to run "
            f"({time.monotonic() - self.started:.1f} s)"
        )
        runs = self.store.runs(self.sweep_id)
        doc = snapshot(self.store, self.sweep_id)
        not_finished = [f"{r.id} {r.state}" for r in runs if r.state != QueueState.FINISHED]
        if len(runs) != len(doc["runs"]) or not_finished:
            raise _DemoFailed(f"runs not FINISHED: {', '.join(not_finished)}")
        resumed = []
        for index in (SIGTERM_RUN, STOP_FILE_RUN):
            attempts = self._attempts(index)
            endings = [a.ending for a in attempts]
            if endings != [Ending.PREEMPTED, Ending.FINISHED]:
                raise _DemoFailed(f"run {self._run_id(index)}: attempts ended {endings}")
            resumed.append(
                f"{self._run_id(index)} by {self._agent_of(attempts[1].agent)} "
                f"from step {attempts[0].checkpoint_step}"
            )
        self.echo(f"  7. all {len(runs)} runs FINISHED; resumed: {', '.join(resumed)}")

        # the uninterrupted runs train while the status is drawn
        indexes = (SIGTERM_RUN, STOP_FILE_RUN)
        references = [self._train_reference(runs[index].params) for index in indexes]
        self._show_status(doc)
        same = [
            self._compare(number, index, runs[index].params, *reference)
            for number, index, reference in zip((9, 10), indexes, references, strict=True)
        ]
        return 0 if all(same) else 1

    def _show_status(self, doc: dict[str, Any]) -> None:
        from rich.console import Console

        from .._errors import ConfigError
        from ..sweeps.status._render import render
        from ..sweeps.status._timeline import plot_timeline

        for run in doc["runs"]:  # the demo's names for its agents, on this machine
            if run.get("agent"):
                run["agent"] = self._agent_of(run["agent"]).replace(" ", "")
                run["host"] = "localhost"
        tty = sys.stdout.isatty()
        width = shutil.get_terminal_size((TABLE_WIDTH, 24)).columns if tty else TABLE_WIDTH
        buffer = io.StringIO()
        Console(file=buffer, width=width, force_terminal=tty, no_color=not tty).print(render(doc))
        for line in buffer.getvalue().rstrip("\n").splitlines():
            self.echo(line.rstrip())
        path = self.workdir / "timeline.png"
        try:
            plot_timeline(doc, path)
            self.echo(f"  8. timeline of the attempts: {path}")
        except ConfigError as exc:
            self.echo(f"  8. no timeline: {exc}")

    def _train_reference(self, params: dict[str, Any]) -> tuple[subprocess.Popen[str], Path]:
        """Start the run's configuration, uninterrupted, outside the queue."""
        return train_reference(self.spec, params, workdir=self.workdir, env=self.env)

    def _compare(
        self,
        number: int,
        index: int,
        params: dict[str, Any],
        proc: subprocess.Popen[str],
        reference: Path,
    ) -> bool:
        from ..sweeps.status._render import format_params

        failure = wait_reference(proc, params, timeout=max(self.deadline - time.monotonic(), 1.0))
        if failure is not None:
            raise _DemoFailed(failure)
        resumed = self.home / "runs" / self._run_id(index) / "final.pt"
        same, verdict = compare_weights(reference, resumed)
        self.echo(
            f" {number:>2}. run {self._run_id(index)} ({format_params(params)}) and the same "
            f"run uninterrupted: {verdict}"
        )
        return same

    def cleanup(self) -> None:
        for agent in self.agents:
            agent.stop()
        if self._store is not None:
            self._store.close()


def run_sweep_demo(
    workdir: Path,
    *,
    seed: int | None,
    echo: Callable[[str], None],
    serve: bool = False,
    port: int = 8765,
) -> int:
    """Run the sweep demo in ``workdir`` (which must exist and be writable); 0 when every
    check passed, 1 otherwise (the reason is echoed). ``serve``: then serve the sweep's web
    page on ``port`` (``status --serve``) until Ctrl+C, SIGTERM or SIGHUP, whatever the
    outcome, once the sweep exists (its agents are stopped by then)."""
    demo = _Demo(workdir, seed, echo)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        # stopped itself (kill, a closed terminal): stop the agents too, as Ctrl+C does
        for stop in (signal.SIGTERM, signal.SIGHUP):
            previous[stop] = signal.signal(stop, _interrupt)
    try:
        code = demo.run()
    except _DemoFailed as exc:
        echo(f"  FAILED: {exc}")
        code = 1
    finally:
        demo.cleanup()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if serve and demo.sweep_id:
        from ..sweeps.web._server import serve_status

        serve_status(demo.db, demo.sweep_id, port=port, home=demo.home, echo=echo)
    return code


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)
