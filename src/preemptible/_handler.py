"""PreemptionCheckpointHandler: stop at a step boundary, checkpoint atomically, resume exactly."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from . import _run
from ._async import AsyncSaver
from ._checkpoint import _FINAL, Checkpoint, CheckpointStore
from ._controller import Decision, StopController
from ._env import env_str
from ._errors import CheckpointSaveError, ConfigError, PreemptibleError
from ._interval import SaveInterval
from ._signals import normalize_signals, patch_dataloader_workers
from ._state import apply_payload, build_payload, check_state, read_payload, write_payload
from ._termination import Durations, Notice, TerminationConfig

logger = logging.getLogger("preemptible")

R = TypeVar("R")


class PreemptionCheckpointHandler:
    """Checkpoints ``state`` in ``checkpoint_dir`` when the run is told to stop, and resumes it.

    Signal handlers are installed when the handler is created and restored by ``close()``
    (called at the end of ``steps()``, by ``with``, and before exiting on a stop)::

        handler = PreemptionCheckpointHandler("ckpt/", state={"model": m, "optimizer": opt})
        for step in handler.steps(total_steps):
            train_step(step)

    On the first signal of ``signals`` (default INT, TERM, HUP, USR1, USR2) or a notice from
    ``termination_config.termination_watcher_fn``, the current step finishes, a checkpoint
    is committed and ``exit_fn`` runs (default ``sys.exit(128 + signum)``). A second signal
    exits at once with code 1 (one within 0.5 s of the first is the same stop delivered
    twice and is not acted on).

    ``checkpoint_dir`` may be None under ``preemptible run``: the supervisor's
    ``PREEMPTIBLE_CHECKPOINT_DIR`` is used. One handler writes to a directory at a time: a
    second one (in any process) raises ``CheckpointLockError``.
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        state: Mapping[str, Any] | None = None,
        *,
        termination_config: TerminationConfig | None = None,
        signals: Iterable[int | str] | None = None,
        keep: int = 2,
        save_every_steps: int | str | None = None,
        save_every_seconds: float | None = None,
        tracker: Any | None = None,
        weights_only: bool = True,
        async_save: bool = False,
        async_policy: str = "wait",
    ) -> None:
        if termination_config is None:
            from .notices import default_config

            config = default_config()  # the detected platform's watchers and grace period
        else:
            config = termination_config
        if not isinstance(config, TerminationConfig):
            raise ConfigError(
                f"termination_config must be a TerminationConfig, not {type(config).__name__}"
            )
        self._state = check_state(state)
        if self._state and config.save_fn is not None:
            raise ConfigError(
                "pass either state (preemptible saves it) or termination_config.save_fn "
                "(you save it), not both"
            )
        if (
            save_every_steps is not None
            and save_every_steps != "auto"
            and (
                isinstance(save_every_steps, bool)
                or not isinstance(save_every_steps, int)
                or save_every_steps < 1
            )
        ):
            raise ConfigError(
                f"save_every_steps={save_every_steps!r} is not valid; use None, an integer >= 1 "
                "or 'auto'"
            )
        if save_every_seconds is not None and save_every_steps is not None:
            raise ConfigError(
                "pass save_every_steps or save_every_seconds, not both (save_every_steps='auto' "
                "chooses the interval in seconds for you)"
            )
        self._interval: SaveInterval | None = None
        if save_every_seconds is not None:
            self._interval = SaveInterval(every=save_every_seconds, platform="local")
        elif save_every_steps == "auto":
            self._interval = SaveInterval()
        chosen_signals = normalize_signals(signals)
        self.config = config
        self.store = CheckpointStore(_choose_directory(checkpoint_dir), keep=keep)
        self._locked = False
        self.tracker = tracker  # uploads the final checkpoint and is finalized once
        self._ctl = StopController(config, chosen_signals, tracker=tracker)
        if not isinstance(async_save, bool):
            raise ConfigError(f"async_save={async_save!r} is not valid; use True or False")
        if async_save and config.save_fn is not None:
            raise ConfigError(
                "async_save needs state (preemptible snapshots it); with save_fn your own code "
                "writes the checkpoint, so it cannot be taken in the background"
            )
        self._async = AsyncSaver(self.store, policy=async_policy) if async_save else None
        self.stall_times = Durations()  # what the training loop waited for each save
        self._last_save_end = time.monotonic()
        self.save_every_steps = save_every_steps
        self.weights_only = weights_only
        self.resume_path: Path | None = None

        self._step = 0
        self._resumed_step: int | None = None
        self._warned_same_step = False
        self._resumed = False
        self._stopped = False
        self._last_saved: tuple[int, Path] | None = None

        try:
            if _is_rank_zero():  # under torch.distributed, the ranks share rank 0's directory
                self.store.lock()
                self._locked = True
            self.store.clean_stale_temporaries()
            self._ctl.start()
        except BaseException:
            self.close()
            raise
        # where this attempt really saves, for the supervisor's next PREEMPTIBLE_RESUME_FROM
        _run.update_record(checkpoint_dir=str(self.store.directory.resolve()))

    # -- public API --------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        return self.store.directory

    @property
    def step(self) -> int:
        """The number of completed steps: the step a resumed run starts from.

        ``steps()`` and ``run()`` advance it; a loop of your own sets it
        (``handler.step = step + 1`` after each step) so that ``save()`` and ``stop()``
        record the right step.
        """
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"step={value!r} is not valid; use an integer >= 0")
        self._step = value

    @property
    def notices(self) -> list[Notice]:
        """Every stop request and warning received so far."""
        return self._ctl.requests.notices

    @property
    def step_times(self) -> Durations:
        """Recent step durations (the grace policy's input)."""
        return self._ctl.step_times

    @property
    def save_times(self) -> Durations:
        """Recent save durations (the grace policy's input)."""
        return self._ctl.save_times

    @property
    def should_stop(self) -> bool:
        """True once a stop was requested and the grace policy says not to start another step.

        In a loop of your own, call ``stop()`` when it is True (or ``save()`` and exit)."""
        if not self._ctl.pending:
            return False
        self._ctl.latch.log_pending()
        return self._ctl.must_stop_now()

    def resume(self) -> int:
        """Restore the newest checkpoint that loads into ``state``; return the step to start from.

        Without any checkpoint, returns 0 and leaves ``state`` as it is.
        """
        extra = self._resume_from_env()
        if self.config.save_fn is not None:
            newest = max([*extra, *self.store.committed()], key=lambda c: c.step, default=None)
            if newest is not None:
                self._step, self.resume_path = newest.step, newest.path
        else:
            found = self.store.load_newest(
                lambda p: read_payload(p, weights_only=self.weights_only), extra
            )
            if found is not None:
                ckpt, payload = found
                apply_payload(payload, self._state, ckpt.path)
                self._step, self.resume_path = payload["step"], ckpt.path
        self._resumed = True
        if self.resume_path is not None:
            self._last_saved = (self._step, self.resume_path)
            self._resumed_step = self._step
            _announce("preemptible: resumed from %s at step %d", self.resume_path, self._step)
        return self._step

    def steps(self, total: int) -> Iterator[int]:
        """Yield step numbers from the resumed step up to ``total - 1``.

        Between two steps it saves periodically and acts on stop requests; at the end it
        closes the handler (restores the signal handlers).
        """
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ConfigError(f"total={total!r} is not valid; use an integer >= 0")
        return self._steps(total)

    def _steps(self, total: int) -> Iterator[int]:
        self._begin()
        try:
            if self._at_boundary():
                return
            while self._step < total:
                started = time.monotonic()
                yield self._step
                self._finish_step(started, total)
                if self._at_boundary():
                    return
            if self._step == total:
                _run.update_record(state="finished", step=self._step)
                self._ctl.tell_tracker("finished")
        except Exception:
            self._ctl.tell_tracker("failed")
            raise
        finally:
            self.close()

    def run(self, step_fn: Callable[..., R], *args: Any, **kwargs: Any) -> R | None:
        """Run one training step (TensorFlow's style); returns what ``step_fn`` returns, or
        None when a stop was acted on before the step could start."""
        if self._stopped:
            raise PreemptibleError("this handler has already stopped the run; create a new one")
        self._begin()
        if self._at_boundary():  # a stop that arrived between two calls
            return None
        started = time.monotonic()
        result = step_fn(*args, **kwargs)
        self._finish_step(started, None)
        self._at_boundary()
        return result

    def save(self, step: int | None = None) -> Path:
        """Commit a checkpoint of the current state; return its path.

        ``step`` is the number of completed steps (where a resumed run starts); default
        ``handler.step``. Passing it also sets ``handler.step``.
        """
        if step is not None:
            self.step = step
        step = self._step
        if self._async is not None:  # commit order = step order: the one in flight goes first
            self._async.wait()
            self._collect_async()
        if (
            step == self._resumed_step
            and self._last_saved is not None
            and self._last_saved[0] == step
            and not self._warned_same_step
        ):
            self._warned_same_step = True
            logger.warning(
                "preemptible: save() at step %d, the step this run resumed from: if the loop "
                "trained since, this checkpoint claims the wrong step. In a loop of your own set "
                "handler.step = step + 1 after each step (or use steps()/run())",
                step,
            )
        started = time.monotonic()
        if self.config.save_fn is not None:
            path = self.store.save(step, self.config.save_fn)
        else:
            payload = build_payload(step, self._state)
            path = self.store.save(step, lambda tmp: write_payload(payload, tmp))
        seconds = time.monotonic() - started
        self.save_times.add(seconds)
        self.stall_times.add(seconds)
        self._last_save_end = time.monotonic()
        if self._interval is not None:
            self._interval.observe_save(seconds)
            _run.update_record(save_s=round(self._interval.save_cost()[0], 3))
        self._last_saved = (step, path)
        logger.info("preemptible: saved %s (step %d, %.2f s)", path, step, self.save_times.max())
        return path

    def stop(self) -> None:
        """Stop the run here: commit a checkpoint of ``handler.step`` (unless one exists),
        record it, acknowledge the notices and call ``exit_fn`` (default: exit with
        128 + signum, 143 for a notice). For loops of your own, when ``should_stop`` is True."""
        if self._stopped:
            raise PreemptibleError("this handler has already stopped the run; create a new one")
        self._ctl.request_stop("stop()", "handler.stop() was called")
        self._stop()

    def close(self) -> None:
        """Restore the previous signal handlers, stop the watcher and release the directory;
        safe to call twice. After a committed stop whose exit is under way, the handlers stay
        until the process is gone (a late signal then exits with the stop's code)."""
        if self._async is not None:
            self._async.wait()  # never leave a write behind (the process may exit next)
            self._collect_async()
        self._ctl.close()
        if self._locked:
            self.store.unlock()
            self._locked = False

    def __enter__(self) -> PreemptionCheckpointHandler:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, Exception):  # a stop exits with SystemExit, which is not a failure
            self._ctl.tell_tracker("failed")
        self.close()

    # -- internals ---------------------------------------------------------------------
    def _begin(self) -> None:
        if not self._resumed:
            self.resume()
            self._last_save_end = time.monotonic()  # training (re)starts here
            if self._interval is not None:
                _announce("preemptible: periodic saves %s", self._interval.describe())
        if self._ctl.latch.installed:
            patch_dataloader_workers()  # torch may have been imported after __init__

    def _finish_step(self, started: float, total: int | None) -> None:
        self.step_times.add(time.monotonic() - started)
        self._step += 1
        every = self.save_every_steps
        if isinstance(every, int):
            due = self._step % every == 0 or self._step == total
        elif self._interval is not None:
            due = self._step == total or self._interval.due(time.monotonic(), self._last_save_end)
        else:
            due = False
        if due:
            if self._async is not None and self._step != total:
                self._save_in_background()
            else:
                self.save()

    def _save_in_background(self) -> None:
        """Snapshot the state to host memory here, write it in a background thread."""
        assert self._async is not None
        self._collect_async()
        started = time.monotonic()
        step = self._step
        snapshot = self._async.snapshot.copy(build_payload(step, self._state))
        if self._async.submit(step, lambda tmp: write_payload(snapshot, tmp)):
            stall = time.monotonic() - started
            self.stall_times.add(stall)
            if self._interval is not None:
                self._interval.observe_save(stall, write=self._async.write_seconds)
            self._last_save_end = time.monotonic()

    def _collect_async(self) -> None:
        """Take what the background writer finished: the newest checkpoint, or its failure."""
        if self._async is None or self._async.in_flight is not None:
            return
        error = self._async.take_error()
        if error is not None:
            logger.error("preemptible: background checkpoint failed: %s", error)
        done = self._async.wait()
        newer = self._last_saved is None or (done is not None and done[0] >= self._last_saved[0])
        if done is not None and newer and self._last_saved != done:
            self._last_saved = done
            if self._async.write_seconds is not None:
                self.save_times.add(self._async.write_seconds)
            logger.info("preemptible: saved %s in the background (step %d)", done[1], done[0])

    def _saved_at_current_step(self) -> bool:
        return self._last_saved is not None and self._last_saved[0] == self._step

    def _at_boundary(self) -> bool:
        """Act on stop requests between two steps; True when the run stopped here."""
        if self._async is not None:
            self._collect_async()
        if not self._ctl.pending:  # the common case: one truth test per step
            return False
        decision = self._ctl.decide(saved_here=self._saved_at_current_step())
        if decision is Decision.INSURANCE:
            try:
                self.save()
            except CheckpointSaveError as exc:
                logger.error("preemptible: insurance checkpoint failed: %s", exc)
            if not self._ctl.must_stop_now():
                return False
        elif decision is Decision.CONTINUE:
            return False
        self._stop()
        return True

    def _stop(self) -> None:
        if self._async is not None:  # a save in flight of this very step is the final one
            self._async.wait()
            self._collect_async()
        saved = self._last_saved[1] if self._saved_at_current_step() else None  # type: ignore[index]
        notice, path = self._ctl.finish(step=self._step, save=self.save, saved=saved)
        code = notice.exit_code
        logger.warning(
            "preemptible: stopped at step %d on %s; checkpoint %s; exiting with %d",
            self._step,
            notice.source,
            path,
            code,
        )
        self._stopped = True
        # From here a late signal (a supervisor's escalation, a second notice, SLURM) exits
        # with ``code`` instead of killing a process that has already saved.
        self._ctl.latch.hold_for_exit(code)
        self.close()
        exit_fn = self.config.exit_fn or sys.exit
        exit_fn(code)
        # an exit_fn that returns (a notebook, a test): the run goes on without our handlers
        self._ctl.latch.restore()

    def _resume_from_env(self) -> list[Checkpoint]:
        value = os.environ.get("PREEMPTIBLE_RESUME_FROM")
        if not value:
            return []
        path = Path(value)
        match = _FINAL.match(path.name)
        if match is None or not (path.is_file() or path.is_dir()):
            logger.warning(
                "preemptible: ignoring PREEMPTIBLE_RESUME_FROM=%s (not an existing step-N.ckpt)",
                value,
            )
            return []
        return [Checkpoint(int(match.group(1)), path)]


def _choose_directory(given: str | os.PathLike[str] | None) -> Path:
    """The handler's own directory, else the supervisor's; warn once when they differ."""
    from_env = env_str("PREEMPTIBLE_CHECKPOINT_DIR")
    if given is None:
        if from_env is None:
            raise ConfigError(
                "no checkpoint directory: pass checkpoint_dir, or run under "
                "`preemptible run`, which sets PREEMPTIBLE_CHECKPOINT_DIR"
            )
        return Path(from_env)
    path = Path(given)
    if from_env is not None and Path(from_env).resolve() != path.resolve():
        global _warned_dirs
        defaulted = env_str("PREEMPTIBLE_CHECKPOINT_DIR_DEFAULT") == "1"
        if not defaulted and not _warned_dirs:
            _warned_dirs = True
            logger.warning(
                "preemptible: checkpoints go to %s (the handler's checkpoint_dir), not to %s "
                "(preemptible run's --checkpoint-dir); pass checkpoint_dir=None to use the "
                "supervisor's, or give both the same directory",
                path,
                from_env,
            )
    return path


_warned_dirs = False


def _is_rank_zero() -> bool:
    """Rank 0 of an initialized torch.distributed group, or not distributed at all."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()) == 0
    except Exception:  # pragma: no cover - a half-initialized group
        pass
    rank = os.environ.get("RANK")
    return not (rank and rank.isdecimal() and int(rank) != 0)


def _announce(message: str, *args: Any) -> None:
    """An INFO line a person must see even when the program configured no logging."""
    if logger.hasHandlers():
        logger.info(message, *args)
    else:
        print(message % args, file=sys.stderr, flush=True)
