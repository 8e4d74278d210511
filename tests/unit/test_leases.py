"""The pieces of the lease that need no database: the run's own watch of ``lease.json``
(``notices._lease``), the agent's timings, and what an agent can see on its host about a
previous holder (real processes, real flocks in the kernel's lock table)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from preemptible import ConfigError, NoticeError
from preemptible.notices import sources_for
from preemptible.notices._lease import LEASE_FILE_ENV, LeaseFile, boot_id, write_lease
from preemptible.stop._termination import StopRequests
from preemptible.sweeps.agent._agent import AgentConfig
from preemptible.sweeps.agent._holding import lease_times
from preemptible.sweeps.store._local import HostView, holder_alive, process_identity
from tests.conftest import SCRIPTS, wait_for

pytestmark = pytest.mark.timeout(60)


def lease(
    path: Path, left: float, *, warn: float = 2.0, margin: float = 1.0, **doc: object
) -> None:
    write_lease(
        path,
        run_id="s-0",
        attempt=1,
        epoch=3,
        deadline=time.monotonic() + left,
        warn=warn,
        margin=margin,
    )
    if doc:
        data = json.loads(path.read_text())
        data.update(doc)
        path.write_text(json.dumps(data))


def test_no_lease_file_is_no_notice(tmp_path: Path) -> None:
    assert LeaseFile(tmp_path / "lease.json").poll() is None


def test_a_renewed_lease_is_quiet_and_one_near_its_end_is_a_stop_with_its_deadline(
    tmp_path: Path,
) -> None:
    path = tmp_path / "lease.json"
    source = LeaseFile(path)
    lease(path, 30.0, warn=2.0)
    assert source.poll() is None
    lease(path, 1.5, warn=2.0)
    notice = source.poll()
    assert notice is not None and notice.stop and notice.source == "lease"
    assert notice.deadline is not None and abs(notice.deadline - (time.time() + 1.5)) < 0.5
    assert "s-0" in notice.detail and "before another agent may take it over" in notice.detail
    # the grace policy trains on while a step, the save and the exit still fit
    requests = StopRequests()
    requests.add(notice)
    now = time.time()
    assert not requests.must_stop_now(
        now=now, save_time=0.1, step_time=0.1, safety=1.25, exit_time=0.2
    )
    assert requests.must_stop_now(
        now=now + 1.2, save_time=0.1, step_time=0.1, safety=1.25, exit_time=0.2
    )


def test_the_notice_comes_a_look_early_when_the_next_look_would_be_too_late(tmp_path: Path) -> None:
    path = tmp_path / "lease.json"
    source = LeaseFile(path)
    lease(path, 0.8, warn=0.3)  # 0.8 s left, warned at 0.3 s: but the next look is in ~1 s
    assert source.poll() is not None


def test_a_lease_written_on_another_boot_goes_by_the_wall_clock(tmp_path: Path) -> None:
    path = tmp_path / "lease.json"
    lease(
        path, 1.0, boot_id="another-boot", deadline_monotonic=-1e9, deadline_wall=time.time() + 50
    )
    assert LeaseFile(path).poll() is None  # the monotonic number of another boot means nothing
    assert boot_id()


def test_a_lease_long_past_its_end_writes_nothing_more(tmp_path: Path) -> None:
    path = tmp_path / "lease.json"
    lost: list[str] = []
    lease(path, -5.0, margin=1.0)
    assert LeaseFile(path, on_lost=lost.append).poll() is None
    assert len(lost) == 1 and "ended 5." in lost[0] and "not renewed" in lost[0]
    lease(path, -0.5, margin=1.0)  # past, but within the margin: stop now, gracefully
    notice = LeaseFile(path, on_lost=lost.append).poll()
    assert notice is not None and notice.deadline is not None and notice.deadline < time.time()
    assert len(lost) == 1


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"deadline_monotonic": "soon"}'])
def test_a_garbled_lease_file_is_a_bad_answer(tmp_path: Path, text: str) -> None:
    path = tmp_path / "lease.json"
    path.write_text(text)
    with pytest.raises(NoticeError):
        LeaseFile(path).poll()


def test_the_lease_file_is_a_source_wherever_the_agent_sets_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREEMPTIBLE_STOP_FILE", raising=False)
    monkeypatch.delenv(LEASE_FILE_ENV, raising=False)
    assert not any(isinstance(s, LeaseFile) for s in sources_for("local"))
    monkeypatch.setenv(LEASE_FILE_ENV, str(tmp_path / "lease.json"))
    for platform in ("local", "slurm", "kubernetes"):
        assert [s.display for s in sources_for(platform) if isinstance(s, LeaseFile)] == [
            str(tmp_path / "lease.json")
        ]


def test_a_run_that_finds_its_lease_long_gone_exits_at_once_without_a_checkpoint(
    tmp_path: Path,
) -> None:
    """A run thawed after its lease ended (frozen with its agent): exit 143, marked
    preempting, and no checkpoint written, whatever it was about to do."""
    run_dir, ckpt = tmp_path / "attempt-1", tmp_path / "checkpoints"
    run_dir.mkdir()
    lease(run_dir / "lease.json", -30.0, margin=1.0)
    env = {
        **os.environ,
        LEASE_FILE_ENV: str(run_dir / "lease.json"),
        "PREEMPTIBLE_RUN_DIR": str(run_dir),
        "PREEMPTIBLE_CHECKPOINT_DIR": str(ckpt),
        "PREEMPTIBLE_RUN_ID": "s-0",
    }
    child = subprocess.run(
        [sys.executable, str(SCRIPTS / "lease_train.py"), "--steps", "100000"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 143, child.stderr
    assert "exiting at once without a checkpoint" in child.stderr
    assert not list(ckpt.glob("step-*"))
    record = json.loads((run_dir / "record.json").read_text())
    assert record["preempting"] is True and record["lease_lost"] is True


# -- the agent's timings -----------------------------------------------------------------------
def test_lease_times() -> None:
    assert lease_times(60, 10) == (48.0, 23.0)  # the defaults: warned 25 s after a renewal
    assert lease_times(4, 0.5) == pytest.approx((3.2, 1.6))  # half the way to the deadline
    assert lease_times(3600, 10) == (2880.0, 1440.0)  # a long lease rides out long outages
    assert lease_times(30, 10) == (24.0, 0.0)  # no time to warn: stop at the deadline


def test_a_lease_must_outlast_three_heartbeats() -> None:
    AgentConfig(sweep_id="s", heartbeat=10, lease=30)
    with pytest.raises(ConfigError, match=r"--lease 29 is not valid; use at least 3 times"):
        AgentConfig(sweep_id="s", heartbeat=10, lease=29)
    with pytest.raises(ConfigError, match="--max-consecutive-failures -1 is not valid"):
        AgentConfig(sweep_id="s", max_consecutive_failures=-1)


# -- what the host shows ---------------------------------------------------------------------
@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_holder_is_alive_while_its_process_lives_and_not_when_its_pid_is_reused(
    sleeper: subprocess.Popen[bytes],
) -> None:
    me = process_identity()
    assert holder_alive(me) is True
    identity = process_identity(sleeper.pid)
    assert holder_alive(identity) is True
    boot, ns, pid, start = identity.split("/")
    assert holder_alive(f"{boot}/{ns}/{pid}/{int(start) + 1}") is False  # another process
    assert holder_alive(f"another-boot/{ns}/{pid}/{start}") is None  # another host
    assert holder_alive(f"{boot}/1/{pid}/{start}") is None  # another pid namespace
    assert holder_alive(None) is None and holder_alive("garbage") is None
    os.kill(sleeper.pid, 9)
    wait_for(lambda: holder_alive(identity) is False, 10, "a zombie to count as dead")
    sleeper.wait()
    assert holder_alive(identity) is False


def hold_lock(path: Path) -> subprocess.Popen[str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    code = (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
        "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


@pytest.mark.parametrize("lock", ["supervisor.lock", "checkpoints/.preemptible.lock"])
def test_a_run_whose_lock_a_process_holds_here_is_blocked_and_the_lock_is_never_taken(
    tmp_path: Path, lock: str
) -> None:
    view = HostView(tmp_path)
    run_dir = tmp_path / "runs" / "s-0"
    assert view.blocked("s-0") is None
    holder = hold_lock(run_dir / lock)
    try:
        reason = view.blocked("s-0")
        assert reason is not None and lock.split("/")[-1] in reason
        # looked up, not taken: the holder's own lock stays its, and a newcomer still fails
        with open(run_dir / lock) as fh, pytest.raises(BlockingIOError):
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder.kill()
        holder.wait()
    assert view.blocked("s-0") is None
    assert view.blocked("../../etc") is None  # not a run id: refused elsewhere, untouched here
