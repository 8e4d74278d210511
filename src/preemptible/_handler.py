"""PreemptionCheckpointHandler: stop at a step boundary, checkpoint atomically, resume exactly.

A front end of the kit (``preemptible.frontend``): the handler's boundaries are the steps of
``steps()``/``run()`` or of a loop of one's own (``handler.step`` moved on, then
``should_stop``), and it saves ``state`` through a ``StateSaver``. The stop itself (signals,
notices, grace policy, periodic and background saves, ranks, record, tracker, exit) is the
kit's ``StopSession``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from .frontend import (
    ConfigError,
    Durations,
    Notice,
    Periodic,
    PreemptibleError,
    StateSaver,
    StopSession,
    TerminationConfig,
    checkpoint_directory,
    termination_config_of,
)

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
    ``PREEMPTIBLE_CHECKPOINT_DIR`` is used. It may be a bucket's URL (``s3://bucket/prefix``,
    ``gs://``, ``az://``): checkpoints are then committed in a local staging directory (the
    ``checkpoint_dir`` property) and uploaded; creating the handler brings the newest one
    committed in the bucket there (a new machine), and a stop's is uploaded before the exit.
    One handler writes to a directory at a time: a second one (in any process) raises
    ``CheckpointLockError``.

    Under torch.distributed (a process group of more than one rank, initialized before the
    handler is created, every rank with a handler on the same shared directory), a signal or
    notice on any rank stops every rank at the same step with the same exit code, with no
    collective per step. ``save()`` and ``stop()`` are then collective (every rank calls them).
    Rank 0 writes one checkpoint with every rank's random states; with ``sharded=True``, or
    modules with DTensor parameters (FSDP2), every rank writes its shards through
    ``torch.distributed.checkpoint`` into one directory that is committed as a whole
    (``async_save=True``: through DCP's ``async_save``, in the background).

    When ``steps()`` reaches its last step, that step is committed unless a checkpoint of it
    exists: a stop that lands after the loop (the program writing its results, an export,
    with the handler closed) ends the attempt as preempted, and the next attempt, like running
    the same command again, trains no step and runs the code after the loop again.
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
        sharded: bool = False,
    ) -> None:
        config = termination_config_of(termination_config)
        periodic = Periodic.of(save_every_steps, save_every_seconds)
        saver = StateSaver(
            checkpoint_directory(checkpoint_dir),
            state,
            save_fn=config.save_fn,
            keep=keep,
            weights_only=weights_only,
            background=async_save,
            policy=async_policy,
            sharded=sharded,
        )
        self.config = config
        self.store = saver.store
        self.tracker = tracker  # uploads the final checkpoint and is finalized once
        self.save_every_steps = save_every_steps
        self.weights_only = weights_only
        self._session = StopSession(
            saver, termination_config=config, signals=signals, tracker=tracker, periodic=periodic
        )
        self._session.start()

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
        return self._session.step

    @step.setter
    def step(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"step={value!r} is not valid; use an integer >= 0")
        self._session.step = value

    @property
    def resume_path(self) -> Path | None:
        """The checkpoint this run resumed from (load it yourself with ``save_fn``)."""
        return self._session.resume_path

    @property
    def notices(self) -> list[Notice]:
        """Every stop request and warning received so far."""
        return self._session.notices

    @property
    def step_times(self) -> Durations:
        """Recent step durations (the grace policy's input)."""
        return self._session.step_times

    @property
    def save_times(self) -> Durations:
        """Recent save durations (the grace policy's input)."""
        return self._session.save_times

    @property
    def stall_times(self) -> Durations:
        """What the training loop waited for each save (a background save: the copy)."""
        return self._session.stall_times

    @property
    def should_stop(self) -> bool:
        """True once a stop was requested and the grace policy says not to start another step.

        In a loop of your own, call ``stop()`` when it is True (or ``save()`` and exit).
        Under torch.distributed every call is a step boundary: call it once per step on every
        rank; it turns True on every rank at the same step.

        In a loop of your own, a call after ``handler.step`` moved on is where the periodic
        saves (``save_every_steps``/``save_every_seconds``) happen, as ``steps()`` does them
        between two steps."""
        return self._session.should_stop()

    def resume(self) -> int:
        """Restore the newest checkpoint that loads into ``state``; return the step to start from.

        Without any checkpoint, returns 0 and leaves ``state`` as it is. Under torch.distributed
        it is collective: rank 0 chooses the checkpoint, every rank restores it (``steps()``
        and ``run()`` call it on every rank when you do not).
        """
        return self._session.resume()

    def steps(self, total: int) -> Iterator[int]:
        """Yield step numbers from the resumed step up to ``total - 1``.

        Between two steps it saves periodically and acts on stop requests; at the end it
        commits the last step (unless a checkpoint of it exists) and closes the handler
        (restores the signal handlers).
        """
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ConfigError(f"total={total!r} is not valid; use an integer >= 0")
        return self._steps(total)

    def _steps(self, total: int) -> Iterator[int]:
        session = self._session
        session.begin()
        try:
            if session.at_boundary():
                return
            while session.step < total:
                yield session.step
                if session.at_boundary(step=session.step + 1, total=total):
                    return
            if session.step == total:
                session.finished(always=True)  # a stop after the loop retrains nothing
        except Exception:
            session.failed()
            raise
        finally:
            self.close()

    def run(self, step_fn: Callable[..., R], *args: Any, **kwargs: Any) -> R | None:
        """Run one training step (TensorFlow's style); returns what ``step_fn`` returns, or
        None when a stop was acted on before the step could start."""
        session = self._session
        if session.stopped:
            raise PreemptibleError("this handler has already stopped the run; create a new one")
        session.begin()
        if session.at_boundary():  # a stop that arrived between two calls
            return None
        result = step_fn(*args, **kwargs)
        session.at_boundary(step=session.step + 1)
        return result

    def save(self, step: int | None = None) -> Path:
        """Commit a checkpoint of the current state; return its path.

        ``step`` is the number of completed steps (where a resumed run starts); default
        ``handler.step``. Passing it also sets ``handler.step``. Under torch.distributed it is
        collective: call it on every rank.
        """
        if step is not None:
            self.step = step
        return self._session.save()

    def stop(self) -> None:
        """Stop the run here: commit a checkpoint of ``handler.step`` (unless one exists),
        record it, acknowledge the notices and call ``exit_fn`` (default: exit with
        128 + signum, 143 for a notice). For loops of your own, when ``should_stop`` is True."""
        if self._session.stopped:
            raise PreemptibleError("this handler has already stopped the run; create a new one")
        self._session.stop(detail="handler.stop() was called")

    def close(self) -> None:
        """Restore the previous signal handlers, stop the watcher and release the directory;
        safe to call twice. After a committed stop whose exit is under way, the handlers stay
        until the process is gone (a late signal then exits with the stop's code)."""
        self._session.close()

    def __enter__(self) -> PreemptionCheckpointHandler:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, Exception):  # a stop exits with SystemExit, which is not a failure
            self._session.failed()
        self.close()
