"""The signal latch with real signals delivered to this process and to a forked child."""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType

import pytest

from preemptible import ConfigError, Notice
from preemptible.stop._latch import SignalLatch, normalize_signals
from tests.support.signals import SignalHandlers


def previous_handler(signum: int, frame: FrameType | None) -> None:
    raise AssertionError("the previous handler must not run while the latch is installed")


@pytest.fixture
def usr1_previous(signal_handlers: SignalHandlers) -> None:
    signal_handlers.install(previous_handler, signal.SIGUSR1)


def test_first_signal_notifies_and_restore_puts_back_previous(usr1_previous, caplog) -> None:
    seen: list[Notice] = []
    latch = SignalLatch([signal.SIGUSR1], seen.append)
    assert latch.install()
    with caplog.at_level(logging.DEBUG, logger="preemptible"):
        os.kill(os.getpid(), signal.SIGUSR1)
        assert len(seen) == 1 and seen[0].signum == signal.SIGUSR1
        assert seen[0].source == "SIGUSR1"
        assert caplog.text == "", "the signal handler itself must not log"
        latch.log_pending()
    assert "received SIGUSR1" in caplog.text
    latch.restore()
    assert signal.getsignal(signal.SIGUSR1) is previous_handler
    latch.restore()  # twice is fine
    assert signal.getsignal(signal.SIGUSR1) is previous_handler


def test_restore_leaves_a_handler_installed_over_ours(usr1_previous) -> None:
    latch = SignalLatch([signal.SIGUSR1], lambda n: None)
    latch.install()

    def theirs(signum: int, frame: FrameType | None) -> None:
        pass

    signal.signal(signal.SIGUSR1, theirs)
    latch.restore()
    assert signal.getsignal(signal.SIGUSR1) is theirs


def test_off_main_thread_warns_and_does_not_crash(caplog) -> None:
    result: list[bool] = []
    latch = SignalLatch([signal.SIGUSR2], lambda n: None)
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        t = threading.Thread(target=lambda: result.append(latch.install()))
        t.start()
        t.join(10)
    assert result == [False]
    assert "off the main thread" in caplog.text
    assert not latch.installed


@pytest.mark.timeout(30)
def test_forked_child_ignores_the_inherited_handler() -> None:
    seen: list[Notice] = []
    latch = SignalLatch([signal.SIGUSR1], seen.append)
    latch.install()
    try:
        pid = os.fork()
        if pid == 0:  # the child: the inherited handler must neither stop nor kill it
            try:
                os.kill(os.getpid(), signal.SIGUSR1)
                os.kill(os.getpid(), signal.SIGUSR1)  # a second one would os._exit(1) in the owner
                os._exit(0 if not seen else 3)
            finally:
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert seen == []
    finally:
        latch.restore()


def test_normalize_signals() -> None:
    assert normalize_signals(None) == (
        signal.SIGINT,
        signal.SIGTERM,
        signal.SIGHUP,
        signal.SIGUSR1,
        signal.SIGUSR2,
    )
    assert normalize_signals(["term", "SIGUSR1", 12, signal.SIGTERM]) == (
        signal.SIGTERM,
        signal.SIGUSR1,
        signal.SIGUSR2,
    )
    with pytest.raises(ConfigError, match="unknown signal 'BOGUS'"):
        normalize_signals(["BOGUS"])
    with pytest.raises(ConfigError, match="SIGKILL cannot be caught"):
        normalize_signals([signal.SIGKILL])
    with pytest.raises(ConfigError, match="signals is empty"):
        normalize_signals([])


def test_an_inherited_ignored_sighup_stays_ignored(caplog, signal_handlers: SignalHandlers) -> None:
    signal_handlers.install(signal.SIG_IGN, signal.SIGHUP)
    seen: list[Notice] = []
    latch = SignalLatch([signal.SIGHUP, signal.SIGUSR1], seen.append)
    with caplog.at_level(logging.INFO, logger="preemptible"):
        assert latch.install()
    assert latch.kept_ignored == (signal.SIGHUP,)
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    assert "SIGHUP ignored since this process started" in caplog.text
    os.kill(os.getpid(), signal.SIGHUP)
    assert seen == []
    latch.restore()
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


def test_a_repeat_within_the_window_is_recorded_not_acted_on(usr1_previous, caplog) -> None:
    seen: list[Notice] = []
    latch = SignalLatch([signal.SIGUSR1], seen.append)
    latch.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # the process would os._exit(1) were it a second stop
        assert len(seen) == 1 and len(latch.received) == 2
        with caplog.at_level(logging.WARNING, logger="preemptible"):
            latch.log_pending()
        assert "the same stop delivered twice" in caplog.text
    finally:
        latch.restore()


class _SecondSignalDuringAppend(list[object]):
    """The latch's list of received signals, which delivers a second ``sig`` to this process
    from inside the first handler's ``append``: the moment a second SIGTERM of two sent at
    once (systemd's control-group kill: the trainer's own and the supervisor's copy) can land.
    Python runs the second handler inside the first one, at its next call."""

    def __init__(self, sig: int, after: bool) -> None:
        super().__init__()
        self.sig, self.after, self.armed = sig, after, True

    def append(self, item: object) -> None:
        if not self.after:
            self._second()
        super().append(item)
        if self.after:
            self._second()

    def _second(self) -> None:
        if self.armed:
            self.armed = False
            os.kill(os.getpid(), self.sig)


@pytest.mark.parametrize("after", [False, True], ids=["before-append", "after-append"])
def test_a_second_signal_inside_the_first_handler_is_one_stop(usr1_previous, after) -> None:
    seen: list[Notice] = []
    latch = SignalLatch([signal.SIGUSR1], seen.append)
    latch._received = _SecondSignalDuringAppend(signal.SIGUSR1, after)
    latch.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert len(latch.received) == 2, "both deliveries ran the handler"
        assert len(seen) == 1, "two signals at once must ask for exactly one stop"
        assert seen[0].signum == signal.SIGUSR1
    finally:
        latch.restore()


REENTRANT = """
import logging, os, signal, sys, threading, time
import preemptible
handler_log = logging.StreamHandler(sys.stdout)  # a pipe to the parent
logging.basicConfig(level=logging.INFO, handlers=[handler_log])
log = logging.getLogger("train")
h = preemptible.PreemptionCheckpointHandler(sys.argv[1], termination_config=preemptible.\
TerminationConfig(save_fn=lambda p: open(p, "w").write("x")))
print("ready", flush=True)
for step in h.steps(10**9):
    for i in range(200):
        log.info("step %d line %d %s", step, i, "x" * 200)
"""


@pytest.mark.timeout(60)
def test_signals_while_the_main_thread_logs_never_raise_nor_get_lost(tmp_path) -> None:
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-c", REENTRANT, str(tmp_path / "ckpt")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"ready"
        proc.stdout.readline()  # logging is under way
        start = time.monotonic()
        while time.monotonic() - start < 0.3:  # a burst inside the duplicate window
            os.kill(proc.pid, signal.SIGTERM)
            time.sleep(0.005)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err.decode()[-2000:]
    assert b"reentrant" not in err and b"Traceback" not in err, err.decode()[-2000:]
    assert list((tmp_path / "ckpt").glob("step-*.ckpt"))
