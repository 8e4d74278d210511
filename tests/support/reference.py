"""Uninterrupted reference runs, one per distinct command for the whole session.

Many integration tests stop a run, resume it, and compare how it ends with a run never
stopped, bit for bit. That run depends only on its command and environment, so one run of
each serves every test (in any module) that compares with it. A test starts its reference
with ``reference_runs.start(...)`` as it begins: it runs in the background beside the test's own
runs (which mostly wait on sleeps and signals), and ``reference_runs.result(...)`` waits for it
where the test compares. A reference never outlives the test that first asks for it: that
test waits for it before it ends, unless it fails first (the session kills what is left).

A command names the reference's own directory as ``DIR`` (``f"{DIR}/o.pt"``, or
``Path(DIR) / "o.pt"``), and a free TCP port as ``PORT``; both are filled in when it starts
and are no part of its identity. ``ranks=N`` starts N processes as torch.distributed ranks
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, one OpenMP
thread each), as tests/integration/test_distributed.py launches its jobs, and ``RANK_PORTS``:
a free port for each rank, for a framework whose every process listens (TensorFlow's workers,
tests/scripts/tf_loop.py).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from tests.conftest import Child

DIR = "{dir}"
PORT = "{port}"

Key = tuple[tuple[str, ...], tuple[tuple[str, str], ...], int]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, port: str) -> dict[str, str]:
    """The environment of one of ``world`` processes started as torchrun starts its ranks."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "OMP_NUM_THREADS": "1",
    }


class _Run:
    def __init__(self, directory: Path, children: list[Child]) -> None:
        self.directory = directory
        self.children = children
        self.failure: str | None = None
        self.done = False


class References:
    """The session's reference runs, keyed by (command, environment, ranks)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.runs: dict[Key, _Run] = {}

    @staticmethod
    def key(args: Sequence[str], env: Mapping[str, str] | None, ranks: int) -> Key:
        return (tuple(str(a) for a in args), tuple(sorted((env or {}).items())), ranks)

    def start(
        self, args: Sequence[str], env: Mapping[str, str] | None = None, *, ranks: int = 1
    ) -> None:
        """Start the reference of this command unless it has been started already."""
        key = self.key(args, env, ranks)
        if key in self.runs:
            return
        directory = self.base / f"ref-{len(self.runs)}"
        directory.mkdir(parents=True)
        port = str(free_port())

        def fill(value: str) -> str:
            return value.replace(DIR, str(directory)).replace(PORT, port)

        command = [fill(a) for a in key[0]]
        common = {k: fill(v) for k, v in key[1]}
        if ranks == 1:
            children = [Child(command, env=common)]
        else:
            rank_port = str(free_port())
            rank_ports = ",".join(str(free_port()) for _ in range(ranks))
            children = [
                Child(
                    command,
                    env={**rank_env(r, ranks, rank_port), "RANK_PORTS": rank_ports, **common},
                )
                for r in range(ranks)
            ]
        self.runs[key] = _Run(directory, children)

    def result(
        self,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        ranks: int = 1,
        timeout: float = 240.0,
    ) -> Path:
        """The reference's directory, once each of its processes has exited with 0."""
        self.start(args, env, ranks=ranks)
        run = self.runs[self.key(args, env, ranks)]
        if not run.done:
            try:
                codes = [child.wait(timeout) for child in run.children]
                if codes != [0] * len(codes):
                    run.failure = f"exit codes {codes}:\n" + "\n".join(
                        child.output for child in run.children
                    )
            except AssertionError as exc:  # still running after the timeout
                run.failure = str(exc)
            finally:
                for child in run.children:
                    child.kill()
            run.done = True
        if run.failure is not None:
            raise AssertionError(f"reference run {list(args)} failed: {run.failure}")
        return run.directory

    def close(self) -> None:
        for run in self.runs.values():
            for child in run.children:
                child.kill()


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[References]:
    refs = References(tmp_path_factory.mktemp("references"))
    yield refs
    refs.close()
