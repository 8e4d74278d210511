"""PreemptionCheckpointHandler in this process: real signals to ourselves, a recording exit_fn."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
from pathlib import Path
from types import FrameType

import numpy as np
import pytest
import torch

import preemptible
from preemptible import (
    CheckpointLoadError,
    ConfigError,
    PreemptionCheckpointHandler,
    TerminationConfig,
)
from tests.support.signals import SignalHandlers

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def sentinel(signum: int, frame: FrameType | None) -> None:
    raise AssertionError("sentinel handler called")


@pytest.fixture(autouse=True)
def sentinels(signal_handlers: SignalHandlers) -> None:
    """Install a known handler for every signal, so restoration can be checked exactly."""
    signal_handlers.install(sentinel, *SIGNALS)


def assert_restored() -> None:
    for s in SIGNALS:
        assert signal.getsignal(s) is sentinel, f"{s.name} handler not restored"


class Exits:
    def __init__(self) -> None:
        self.codes: list[int] = []

    def __call__(self, code: int) -> None:
        self.codes.append(code)


def model_state() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return {"model": model, "optimizer": opt}


def train_step(state: dict[str, object]) -> None:
    model, opt = state["model"], state["optimizer"]
    x = torch.randn(8, 4)
    loss = model(x).pow(2).mean() + random.random() * 0 + float(np.random.rand()) * 0  # type: ignore[operator]
    opt.zero_grad()  # type: ignore[attr-defined]
    loss.backward()
    opt.step()  # type: ignore[attr-defined]


def test_signal_stops_after_the_current_step_and_restores_handlers(tmp_path: Path) -> None:
    exits = Exits()
    state = model_state()
    h = PreemptionCheckpointHandler(
        tmp_path, state, termination_config=TerminationConfig(exit_fn=exits)
    )
    ran = []
    for step in h.steps(10):
        ran.append(step)
        if step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
        train_step(state)
    assert ran == [0, 1, 2, 3]
    assert exits.codes == [138]
    assert [c.step for c in h.store.committed()] == [4]
    assert_restored()


def test_resume_restores_weights_and_rng(tmp_path: Path) -> None:
    state = model_state()
    h = PreemptionCheckpointHandler(
        tmp_path, state, termination_config=TerminationConfig(exit_fn=Exits())
    )
    for step in h.steps(5):
        train_step(state)
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
    expected = (torch.rand(3), random.random(), float(np.random.rand()))
    weights = {k: v.clone() for k, v in state["model"].state_dict().items()}  # type: ignore[attr-defined]

    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    fresh = model_state()
    h2 = PreemptionCheckpointHandler(tmp_path, fresh)
    assert h2.resume() == 3
    h2.close()
    for k, v in fresh["model"].state_dict().items():  # type: ignore[attr-defined]
        assert torch.equal(v, weights[k])
    assert fresh["optimizer"].state_dict()["state"]  # type: ignore[attr-defined]
    drawn = (torch.rand(3), random.random(), float(np.random.rand()))
    assert torch.equal(drawn[0], expected[0])
    assert drawn[1:] == expected[1:]
    assert_restored()


def test_handlers_restored_when_the_loop_raises(tmp_path: Path) -> None:
    h = PreemptionCheckpointHandler(tmp_path, model_state())
    with pytest.raises(RuntimeError, match="boom"):
        for step in h.steps(10):
            if step == 2:
                raise RuntimeError("boom")
    assert_restored()


def test_handlers_restored_after_normal_end_and_with_statement(tmp_path: Path) -> None:
    h = PreemptionCheckpointHandler(tmp_path / "a", model_state())
    assert list(h.steps(3)) == [0, 1, 2]
    assert_restored()
    with PreemptionCheckpointHandler(tmp_path / "b", model_state()) as h2:
        assert signal.getsignal(signal.SIGTERM) is not sentinel
        h2.save()
    assert_restored()


def test_signal_before_the_first_step(tmp_path: Path) -> None:
    exits = Exits()
    h = PreemptionCheckpointHandler(
        tmp_path, model_state(), termination_config=TerminationConfig(exit_fn=exits)
    )
    os.kill(os.getpid(), signal.SIGINT)
    assert list(h.steps(10)) == []
    assert exits.codes == [130]
    assert [c.step for c in h.store.committed()] == [0]


def test_run_style_and_should_stop(tmp_path: Path) -> None:
    exits = Exits()
    state = model_state()
    h = PreemptionCheckpointHandler(
        tmp_path, state, termination_config=TerminationConfig(exit_fn=exits)
    )
    calls = 0

    def step_fn() -> int:
        nonlocal calls
        calls += 1
        train_step(state)
        if calls == 4:
            os.kill(os.getpid(), signal.SIGUSR2)
            assert h.should_stop, "a plain stop request is due at once"
        return calls

    results = []
    while not exits.codes:
        results.append(h.run(step_fn))
    assert results == [1, 2, 3, 4] and h.step == 4 and exits.codes == [140]
    assert [c.step for c in h.store.committed()] == [4]
    with pytest.raises(preemptible.PreemptibleError, match="already stopped"):
        h.run(train_step, state)
    assert_restored()


def test_watcher_notice_stops_with_143(tmp_path: Path) -> None:
    exits = Exits()
    fired = threading.Event()
    config = TerminationConfig(
        exit_fn=exits, termination_watcher_fn=fired.is_set, poll_interval=0.01
    )
    h = PreemptionCheckpointHandler(tmp_path, model_state(), termination_config=config)
    steps = 0
    for step in h.steps(10_000):
        steps += 1
        if step == 2:
            fired.set()
            # wait for the watcher thread to deliver it, as a real step would take time
            deadline = 200
            while not h.notices and deadline:
                threading.Event().wait(0.01)
                deadline -= 1
    assert exits.codes == [143]
    assert h.notices[0].source == "watcher"
    assert 3 <= steps <= 4


def test_periodic_saves_and_keep(tmp_path: Path) -> None:
    h = PreemptionCheckpointHandler(tmp_path, model_state(), save_every_steps=3, keep=2)
    assert list(h.steps(10)) == list(range(10))
    assert [c.step for c in h.store.committed()] == [10, 9]


def test_the_stops_save_prunes_nothing_and_the_resumed_runs_first_save_does(
    tmp_path: Path,
) -> None:
    """Pruning costs an unlink per retired checkpoint in the notice window: the stop defers it."""
    exits = Exits()
    h = PreemptionCheckpointHandler(
        tmp_path,
        model_state(),
        save_every_steps=2,
        keep=1,
        termination_config=TerminationConfig(exit_fn=exits),
    )
    for step in h.steps(10):
        if step == 4:
            signal.raise_signal(signal.SIGTERM)
    assert exits.codes == [143]
    assert [c.step for c in h.store.committed()] == [5, 4]
    resumed = PreemptionCheckpointHandler(tmp_path, model_state(), save_every_steps=2, keep=1)
    assert list(resumed.steps(10)) == list(range(5, 10))
    assert [c.step for c in resumed.store.committed()] == [10]


def test_a_finished_loop_returns_once_what_its_saves_retired_is_removed(
    tmp_path: Path, monkeypatch
) -> None:
    """Saves remove what they retire in a thread; the end of the loop waits for it, so a
    finished run's directory holds ``keep`` checkpoints and nothing else."""
    from preemptible.checkpoint import _store

    remove_path, removers = _store.remove_path, []

    def slow(path: Path) -> None:  # a slow disk: without the wait, the loop returns first
        if path.parent == tmp_path:  # not a removal some earlier test left running
            removers.append(threading.current_thread().name)
            threading.Event().wait(0.2)
        remove_path(path)

    monkeypatch.setattr(_store, "remove_path", slow)
    h = PreemptionCheckpointHandler(tmp_path, model_state(), save_every_steps=3, keep=1)
    assert list(h.steps(7)) == list(range(7))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".preemptible.lock",
        "step-0000000007.ckpt",
    ]
    assert removers and set(removers) == {"preemptible-prune"}


def test_save_fn_mode_commits_what_the_user_writes(tmp_path: Path) -> None:
    written = []

    def save_fn(path: Path) -> None:
        path.mkdir()
        (path / "weights.bin").write_bytes(b"w")
        written.append(path)

    exits = Exits()
    h = PreemptionCheckpointHandler(
        tmp_path, termination_config=TerminationConfig(save_fn=save_fn, exit_fn=exits)
    )
    for step in h.steps(10):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
    assert exits.codes == [143] and written[0].name.startswith(".tmp-")
    h2 = PreemptionCheckpointHandler(
        tmp_path, termination_config=TerminationConfig(save_fn=save_fn)
    )
    assert h2.resume() == 6
    assert h2.resume_path == tmp_path / "step-0000000006.ckpt"
    assert (h2.resume_path / "weights.bin").read_bytes() == b"w"
    h2.close()


def test_run_record_under_a_supervisor(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PREEMPTIBLE_RUN_DIR", str(tmp_path / "run"))
    h = PreemptionCheckpointHandler(
        tmp_path / "ckpt", model_state(), termination_config=TerminationConfig(exit_fn=Exits())
    )
    for step in h.steps(10):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    assert record["state"] == "stopped" and record["step"] == 2
    assert record["reason"] == "SIGTERM" and record["signum"] == signal.SIGTERM
    assert record["preempting"] is True
    assert record["preempting_at"] == record["stopped_at"] <= record["updated_at"]
    assert record["checkpoint"].endswith("step-0000000002.ckpt")
    assert preemptible.current_run().run_dir == tmp_path / "run"


def test_corrupt_newest_falls_back_to_older(tmp_path: Path, caplog) -> None:
    h = PreemptionCheckpointHandler(tmp_path, model_state(), save_every_steps=2, keep=3)
    list(h.steps(4))
    newest = tmp_path / "step-0000000004.ckpt"
    newest.write_bytes(newest.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        h2 = PreemptionCheckpointHandler(tmp_path, model_state())
        assert h2.resume() == 2
    h2.close()
    assert "skipping checkpoint" in caplog.text and newest.name in caplog.text


class Opaque:
    """An object that is not a tensor or a plain container."""


class HoldsObject:
    def state_dict(self) -> dict[str, object]:
        return {"obj": Opaque()}

    def load_state_dict(self, sd: dict[str, object]) -> None:
        self.loaded = sd


def test_weights_only_by_default_and_opt_out(tmp_path: Path) -> None:
    h = PreemptionCheckpointHandler(tmp_path, {"x": HoldsObject()})
    h.save()
    h.close()
    h2 = PreemptionCheckpointHandler(tmp_path, {"x": HoldsObject()})
    with pytest.raises(CheckpointLoadError, match="none of the 1 checkpoints"):
        h2.resume()
    h2.close()
    holder = HoldsObject()
    h3 = PreemptionCheckpointHandler(tmp_path, {"x": holder}, weights_only=False)
    assert h3.resume() == 0
    h3.close()
    assert isinstance(holder.loaded["obj"], Opaque)


def test_resume_from_env(tmp_path: Path, monkeypatch) -> None:
    other = PreemptionCheckpointHandler(tmp_path / "other", model_state(), save_every_steps=7)
    list(other.steps(7))
    monkeypatch.setenv("PREEMPTIBLE_RESUME_FROM", str(tmp_path / "other" / "step-0000000007.ckpt"))
    h = PreemptionCheckpointHandler(tmp_path / "mine", model_state())
    assert h.resume() == 7
    h.close()


def test_state_keys_that_differ_from_the_checkpoint_are_named(tmp_path: Path, caplog) -> None:
    h = PreemptionCheckpointHandler(tmp_path, model_state())
    h.save()
    h.close()
    sched = torch.optim.lr_scheduler.StepLR(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1), 1
    )
    before = sched.state_dict()
    extra = {**model_state(), "scheduler": sched}
    h2 = PreemptionCheckpointHandler(tmp_path, extra)
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        assert h2.resume() == 0
    h2.close()
    assert "'scheduler'" in caplog.text
    assert sched.state_dict() == before  # left as initialized


def test_off_main_thread_warns_and_still_works(tmp_path: Path, caplog) -> None:
    out: list[object] = []
    seen: list[object] = []

    def body() -> None:
        h = PreemptionCheckpointHandler(tmp_path, model_state())
        seen.append(signal.getsignal(signal.SIGTERM))  # nothing may be installed from here
        out.append(list(h.steps(2)))

    with caplog.at_level(logging.WARNING, logger="preemptible"):
        t = threading.Thread(target=body)
        t.start()
        t.join(30)
    assert out == [[0, 1]]
    assert seen == [sentinel]
    assert "off the main thread" in caplog.text
    assert_restored()


def test_close_off_the_main_thread_leaves_handlers_until_a_main_thread_close(
    tmp_path: Path, caplog
) -> None:
    h = PreemptionCheckpointHandler(tmp_path, model_state())
    assert signal.getsignal(signal.SIGTERM) is not sentinel
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        t = threading.Thread(target=lambda: list(h.steps(2)))
        t.start()
        t.join(30)
    assert "close() called off the main thread" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is not sentinel  # still ours: not restorable there
    h.close()
    assert_restored()


def test_own_loop_with_handler_step_resumes_exactly(tmp_path: Path) -> None:
    def run(directory: Path, stop_at: int | None) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        state = model_state()
        exits = Exits()
        with PreemptionCheckpointHandler(
            directory, state, termination_config=TerminationConfig(exit_fn=exits)
        ) as h:
            for step in range(h.resume(), 12):
                train_step(state)
                h.step = step + 1
                if step == stop_at:
                    os.kill(os.getpid(), signal.SIGTERM)
                if h.should_stop:
                    h.stop()
                    break
        return {k: v.clone() for k, v in state["model"].state_dict().items()}  # type: ignore[attr-defined]

    reference = run(tmp_path / "ref", None)
    run(tmp_path / "stopped", 4)
    assert sorted(p.name for p in (tmp_path / "stopped").glob("step-*.ckpt")) == [
        "step-0000000005.ckpt"
    ]
    resumed = run(tmp_path / "stopped", None)
    assert reference.keys() == resumed.keys() and reference
    for k in reference:
        assert torch.equal(reference[k], resumed[k]), k
    assert_restored()


def test_two_handlers_on_one_directory_are_refused(tmp_path: Path) -> None:
    h = PreemptionCheckpointHandler(tmp_path, model_state())
    with pytest.raises(preemptible.CheckpointLockError, match=str(tmp_path)):
        PreemptionCheckpointHandler(tmp_path, model_state())
    assert signal.getsignal(signal.SIGTERM) is not sentinel  # the first one is untouched
    h.close()
    assert_restored()
    PreemptionCheckpointHandler(tmp_path, model_state()).close()  # free again


def test_no_directory_anywhere_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.delenv("PREEMPTIBLE_CHECKPOINT_DIR", raising=False)
    with pytest.raises(ConfigError, match="no checkpoint directory"):
        PreemptionCheckpointHandler(None, model_state())
    assert_restored()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"state": {"m": object()}}, r"state\['m'\] \(object\) has no state_dict"),
        ({"state": [1]}, "state must be a mapping"),
        ({"save_every_steps": 0}, "save_every_steps=0 is not valid"),
        ({"save_every_seconds": -1}, r"^save_every_seconds=-1 is not valid; use seconds > 0"),
        ({"save_every_seconds": float("nan")}, "save_every_seconds=nan is not valid"),
        ({"signals": ["NOPE"]}, "unknown signal 'NOPE'"),
        ({"termination_config": {"grace_period": 3}}, "must be a TerminationConfig"),
        (
            {
                "state": {"m": torch.nn.Linear(1, 1)},
                "termination_config": TerminationConfig(save_fn=lambda p: None),
            },
            "either state .* or termination_config.save_fn",
        ),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PreemptionCheckpointHandler(tmp_path, **kwargs)  # type: ignore[arg-type]
    assert_restored()


def test_steps_total_validation(tmp_path: Path) -> None:
    h = PreemptionCheckpointHandler(tmp_path)
    with pytest.raises(ConfigError, match="total=-1 is not valid"):
        h.steps(-1)
    h.close()


@pytest.mark.parametrize(
    ("sig", "status"), [(signal.SIGTERM, "preempted"), (signal.SIGINT, "killed")]
)
def test_the_handlers_tracker_gets_the_checkpoint_and_one_final_status(
    tmp_path: Path, sig: int, status: str
) -> None:
    from preemptible.trackers import LocalTracker

    tracker = LocalTracker(tmp_path / "events.jsonl")
    h = PreemptionCheckpointHandler(
        tmp_path / "ckpt",
        model_state(),
        tracker=tracker,
        termination_config=TerminationConfig(exit_fn=Exits()),
    )
    for step in h.steps(10):
        if step == 2:
            os.kill(os.getpid(), sig)
    tracker.finalize("finished")  # the classic `finally: finalize("finished")` is ignored
    events = [(e["event"], e.get("status") or Path(e["path"]).name) for e in tracker.events()]
    assert events == [("checkpoint", "step-0000000003.ckpt"), ("finalize", status)]
    assert_restored()


def test_the_handlers_tracker_is_finished_or_failed_with_the_loop(tmp_path: Path) -> None:
    from preemptible.trackers import LocalTracker

    done = LocalTracker(tmp_path / "done.jsonl")
    assert list(PreemptionCheckpointHandler(tmp_path / "a", tracker=done).steps(3)) == [0, 1, 2]
    assert [(e["event"], e["status"]) for e in done.events()] == [("finalize", "finished")]
    failed = LocalTracker(tmp_path / "failed.jsonl")
    with (
        pytest.raises(RuntimeError),
        PreemptionCheckpointHandler(tmp_path / "b", tracker=failed) as h,
    ):
        for _ in h.steps(3):
            raise RuntimeError("boom")
    assert [(e["event"], e["status"]) for e in failed.events()] == [("finalize", "failed")]
    assert_restored()


def test_save_every_seconds_saves_by_wall_clock(tmp_path: Path) -> None:
    h = PreemptionCheckpointHandler(tmp_path, model_state(), save_every_seconds=0.1, keep=50)
    for _ in h.steps(20):
        threading.Event().wait(0.02)  # a step of 20 ms (stands in for training)
    steps = sorted(c.step for c in h.store.committed())
    # ~every 5th step and the last; a save at every step (20) would be by steps, not seconds
    assert steps[-1] == 20 and 2 <= len(steps) <= 12, steps


def test_save_every_auto_says_what_it_chose(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("PREEMPTIBLE_MTBF", "3600")
    monkeypatch.setenv("PREEMPTIBLE_PLATFORM", "local")
    h = PreemptionCheckpointHandler(tmp_path, model_state(), save_every_steps="auto")
    with caplog.at_level(logging.INFO, logger="preemptible"):
        assert list(h.steps(3)) == [0, 1, 2]
    said = caplog.text
    assert "preemptible: periodic saves every" in said and "PREEMPTIBLE_MTBF" in said, said
    with pytest.raises(ConfigError, match="not both"):
        PreemptionCheckpointHandler(
            tmp_path / "x", model_state(), save_every_steps=5, save_every_seconds=10
        )
    monkeypatch.setenv("PREEMPTIBLE_MTBF", "soon")
    with pytest.raises(ConfigError, match="PREEMPTIBLE_MTBF='soon' is not valid"):
        PreemptionCheckpointHandler(tmp_path / "y", model_state(), save_every_steps="auto")
    assert_restored()


@pytest.mark.parametrize(("rank", "shown"), [("0", True), ("1", False)])
def test_only_rank_zero_says_saved_at_info(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog, rank: str, shown: bool
) -> None:
    """Every rank of a job saves together: one "saved" line per save, not one per rank."""
    monkeypatch.setenv("RANK", rank)
    h = PreemptionCheckpointHandler(tmp_path, model_state())
    with caplog.at_level(logging.DEBUG, logger="preemptible"):
        h.save(3)
    h.close()
    [record] = [r for r in caplog.records if r.getMessage().startswith("preemptible: saved")]
    assert record.levelno == (logging.INFO if shown else logging.DEBUG)
    assert record.getMessage().endswith(" s)") and "(step 3, " in record.getMessage()


def saved_lines(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("preemptible: saved")
    ]


@pytest.mark.parametrize(("check_every", "expected"), [(1, [5, 10]), (3, [6, 12])])
def test_periodic_saves_in_a_loop_of_ones_own(
    tmp_path: Path, caplog, check_every: int, expected: list[int]
) -> None:
    """The README's own loop: ``handler.step = step + 1`` then ``should_stop``; that check is
    the boundary where save_every_steps saves (at the first check past each multiple)."""
    state = model_state()
    with (
        caplog.at_level(logging.INFO, logger="preemptible"),
        PreemptionCheckpointHandler(tmp_path, state, save_every_steps=5, keep=10) as h,
    ):
        for step in range(h.resume(), 12):
            train_step(state)
            h.step = step + 1
            if h.step % check_every == 0 and h.should_stop:
                h.stop()
    assert sorted(c.step for c in h.store.committed()) == expected
    assert len(saved_lines(caplog)) == len(expected)
    assert len(h.step_times) > 0  # the grace policy learns how long a step takes


def test_an_own_loop_that_saves_itself_is_not_saved_twice(tmp_path: Path, caplog) -> None:
    state = model_state()
    with (
        caplog.at_level(logging.INFO, logger="preemptible"),
        PreemptionCheckpointHandler(tmp_path, state, save_every_steps=5) as h,
    ):
        for step in range(h.resume(), 6):
            h.step = step + 1
            if h.step == 5:
                h.save()
            assert not h.should_stop
    assert [c.step for c in h.store.committed()] == [5]
    assert len(saved_lines(caplog)) == 1


def test_should_stop_inside_steps_adds_no_save(tmp_path: Path, caplog) -> None:
    state = model_state()
    h = PreemptionCheckpointHandler(tmp_path, state, save_every_steps=5, keep=10)
    with caplog.at_level(logging.INFO, logger="preemptible"):
        for _ in h.steps(10):
            train_step(state)
            assert not h.should_stop
    assert sorted(c.step for c in h.store.committed()) == [5, 10]
    assert len(saved_lines(caplog)) == 2


def test_periodic_saves_in_seconds_in_a_loop_of_ones_own(tmp_path: Path) -> None:
    state = model_state()
    with PreemptionCheckpointHandler(tmp_path, state, save_every_seconds=0.05, keep=50) as h:
        for step in range(h.resume(), 10):
            threading.Event().wait(0.03)
            h.step = step + 1
            assert not h.should_stop
    assert 2 <= len(h.store.committed()) <= 10


def test_a_finished_resumed_run_run_again_trains_nothing_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The stop's checkpoint must not outlive the run's end: the resumed run commits its last
    step, so the same command run once more trains no step (and says why)."""
    config = TerminationConfig(exit_fn=Exits())
    state = model_state()
    for step in PreemptionCheckpointHandler(tmp_path, state, termination_config=config).steps(8):
        train_step(state)
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
    resumed = PreemptionCheckpointHandler(tmp_path, model_state(), termination_config=config)
    assert list(resumed.steps(8)) == [3, 4, 5, 6, 7]
    assert [c.step for c in resumed.store.committed()] == [8, 3]
    again = PreemptionCheckpointHandler(tmp_path, model_state(), termination_config=config)
    with caplog.at_level(logging.INFO, logger="preemptible"):
        assert list(again.steps(8)) == []
    assert "step-0000000008.ckpt is of a finished run; nothing left to train" in caplog.text
    assert_restored()


def test_a_save_at_the_resumed_step_after_training_warns_once(tmp_path: Path, caplog) -> None:
    """A loop of one's own that never moves handler.step on would save every checkpoint as
    the step it resumed from: said once, not at every save."""
    h = PreemptionCheckpointHandler(tmp_path, model_state(), termination_config=TerminationConfig())
    h.save(step=5)
    h.close()
    again = PreemptionCheckpointHandler(
        tmp_path, model_state(), termination_config=TerminationConfig()
    )
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        assert again.resume() == 5
        again.save()
        again.save()
    again.close()
    assert caplog.text.count("the step this run resumed from") == 1


def test_steps_commits_the_last_step_of_a_run_that_never_saved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stop after the loop (results being written, an export) finds the handler gone and
    ends the attempt: the last step is committed as the loop ends, or the next attempt would
    train every step again. A commit that fails is said, and the run still finishes."""
    h = PreemptionCheckpointHandler(tmp_path / "a", model_state())
    assert list(h.steps(3)) == [0, 1, 2]
    assert [c.step for c in h.store.committed()] == [3]
    assert list(PreemptionCheckpointHandler(tmp_path / "a", model_state()).steps(3)) == []
    nothing = PreemptionCheckpointHandler(tmp_path / "b", model_state())
    assert list(nothing.steps(0)) == [] and nothing.store.committed() == []  # nothing trained

    def full(path: Path) -> None:
        raise OSError(28, "No space left on device")

    config = TerminationConfig(save_fn=full)
    broken = PreemptionCheckpointHandler(tmp_path / "c", None, termination_config=config)
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        assert list(broken.steps(2)) == [0, 1]
    assert "the last step (2) could not be committed" in caplog.text
    assert broken.store.committed() == []
    assert_restored()
