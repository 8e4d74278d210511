"""The sweep demo's parts: the ``preemptible agent`` processes it starts and follows
(``_Agent``), and the uninterrupted reference runs whose final weights it compares, bit for
bit, with those of the runs it preempted (``train_reference``, ``wait_reference``,
``compare_weights``). The story itself, what happens when, is ``_sweep_demo.py``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any


class _Agent:
    """One ``preemptible agent`` process; its output goes to a log file and, line by line, to
    the demo's event queue (``None`` when it ends)."""

    def __init__(
        self,
        number: int,
        argv: list[str],
        *,
        cwd: Path,
        env: dict[str, str],
        stop_file: Path,
        events: queue.Queue[tuple[_Agent, str | None]],
    ) -> None:
        self.number = number
        self.stop_file = stop_file
        self.log = cwd / f"agent-{number}.log"
        self.code: int | None = None
        self._out: IO[str] = self.log.open("w", encoding="utf-8")
        self.proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env={**env, "PREEMPTIBLE_STOP_FILE": str(stop_file)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a Ctrl+C of the demo is the demo's to pass on
        )
        self._events = events
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._out.write(line)
            self._out.flush()
            self._events.put((self, line.rstrip("\n")))
        self._events.put((self, None))

    def ended(self) -> int:
        self.code = self.proc.wait()
        self._reader.join(timeout=5)
        self._out.close()
        return self.code

    def stop(self) -> None:
        """End the agent and its run: SIGTERM (the run saves), then SIGKILL of its group."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(timeout=5)
        self._out.close()


def train_reference(
    spec: dict[str, Any], params: dict[str, Any], *, workdir: Path, env: dict[str, str]
) -> tuple[subprocess.Popen[str], Path]:
    """Start the run's configuration, uninterrupted, outside the queue: the argv the agent
    built, in a fresh checkpoint directory. The process, and where its final weights go."""
    from ..sweeps.spec._command import build_command
    from ..sweeps.spec._spec import parse_spec

    name = "-".join(f"{k}{v}" for k, v in sorted(params.items()))
    where = workdir / "reference" / name
    argv = build_command(
        parse_spec(spec),
        params,
        interpreter=sys.executable,
        params_file=where / "params.json",
    )
    (where / "run").mkdir(parents=True, exist_ok=True)
    env = {
        **env,
        "PREEMPTIBLE_CHECKPOINT_DIR": str(where / "checkpoints"),
        "PREEMPTIBLE_RUN_DIR": str(where / "run"),  # its reports: history.jsonl, to compare
    }
    proc = subprocess.Popen(
        argv,
        cwd=workdir,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, where / "final.pt"


def wait_reference(
    proc: subprocess.Popen[str], params: dict[str, Any], *, timeout: float
) -> str | None:
    """Wait for a reference run to end, up to ``timeout`` seconds: None when it succeeded,
    else what went wrong, in one line."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return f"the uninterrupted run of {params} did not end in time"
    if proc.returncode != 0:
        return f"the uninterrupted run of {params} failed: {_last_line(err)}"
    return None


def compare_weights(reference: Path, resumed: Path) -> tuple[bool, str]:
    """Whether two saved state dicts are the same, bit for bit, and the verdict in words."""
    import torch

    a = torch.load(reference, weights_only=True)
    b = torch.load(resumed, weights_only=True)
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    values = sum(t.numel() for t in a.values())
    verdict = f"identical, bit for bit ({len(a)} tensors, {values} values)" if same else "DIFFERENT"
    return same, verdict


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "(no output)"
