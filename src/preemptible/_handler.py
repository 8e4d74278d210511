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
from ._env import env_str
from ._errors import CheckpointLoadError, CheckpointSaveError, ConfigError, PreemptibleError
from .checkpoint._async import POLICIES, AsyncSaver
from .checkpoint._interval import SaveInterval, _seconds
from .checkpoint._state import (
    apply_payload,
    build_payload,
    capture_rng,
    check_state,
    read_payload,
    write_payload,
)
from .checkpoint._store import _FINAL, Checkpoint, CheckpointStore
from .distributed._group import (
    META_NAME,
    Agreed,
    BackgroundShards,
    Ranks,
    StopAgreement,
    Subset,
    check_sharded,
    dist_timeout,
    has_dtensor,
    hear_written,
    own_rng,
    pack,
    read_rank_rng,
    read_shards,
    remote_error,
    run_on_zero,
    save_failed,
    split_sharded,
    unpack,
    write_rank_rng,
    write_shards,
)
from .stop._controller import Decision, StopController
from .stop._latch import normalize_signals, patch_dataloader_workers
from .stop._termination import Durations, Notice, TerminationConfig

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

    Under torch.distributed (a process group of more than one rank, initialized before the
    handler is created, every rank with a handler on the same shared directory), a signal or
    notice on any rank stops every rank at the same step with the same exit code, with no
    collective per step. ``save()`` and ``stop()`` are then collective (every rank calls them).
    Rank 0 writes one checkpoint with every rank's random states; with ``sharded=True``, or
    modules with DTensor parameters (FSDP2), every rank writes its shards through
    ``torch.distributed.checkpoint`` into one directory that is committed as a whole
    (``async_save=True``: through DCP's ``async_save``, in the background).
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
            every = _seconds("save_every_seconds", save_every_seconds)
            self._interval = SaveInterval(every=every, platform="local")
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
        if async_policy not in POLICIES:
            raise ConfigError(f"async_policy={async_policy!r} is not valid; use one of wait, skip")
        if async_save and config.save_fn is not None:
            raise ConfigError(
                "async_save needs state (preemptible snapshots it); with save_fn your own code "
                "writes the checkpoint, so it cannot be taken in the background"
            )
        if not isinstance(sharded, bool):
            raise ConfigError(f"sharded={sharded!r} is not valid; use True or False")
        self._sharded = sharded or has_dtensor(self._state.mapping)
        if self._sharded and config.save_fn is not None:
            raise ConfigError(
                "sharded checkpoints are written by preemptible from state; with save_fn your "
                "own code writes the checkpoint"
            )
        self._async = AsyncSaver(self.store, policy=async_policy) if async_save else None
        self.stall_times = Durations()  # what the training loop waited for each save
        self._last_save_end = time.monotonic()
        self.save_every_steps = save_every_steps
        self.weights_only = weights_only
        self.resume_path: Path | None = None

        self._step = 0
        # a loop of one's own: the step and time of the last should_stop that saw it move
        self._boundary: tuple[int, float] | None = None
        self._resumed_step: int | None = None
        self._warned_same_step = False
        self._resumed = False
        self._stopped = False
        self._last_saved: tuple[int, Path] | None = None
        # torch.distributed: the ranks, the agreement, and the count of collective steps
        # (saves, resumes), which every rank takes in the same order
        self._ranks: Ranks | None = None
        self._agreement: StopAgreement | None = None
        self._agreed_stop: Notice | None = None
        self._want_save = False  # rank 0: a periodic save in seconds is due (agreed first)
        self._seq = 0
        self._shards: BackgroundShards | None = None  # sharded saves in the background

        try:
            self._ranks = Ranks.detect()
            if self._ranks is not None:
                self._agreement = self._ranks.agreement()
            if self._sharded and async_save:
                self._shards = BackgroundShards(dist_timeout())
            if _is_rank_zero():  # under torch.distributed, the ranks share rank 0's directory
                self.store.lock()
                self._locked = True
                self.store.clean_stale_temporaries()
            self._ctl.start()
        except BaseException:
            self.close()
            raise
        if _is_rank_zero():  # the run record has one writer
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

        In a loop of your own, call ``stop()`` when it is True (or ``save()`` and exit).
        Under torch.distributed every call is a step boundary: call it once per step on every
        rank; it turns True on every rank at the same step.

        In a loop of your own, a call after ``handler.step`` moved on is where the periodic
        saves (``save_every_steps``/``save_every_seconds``) happen, as ``steps()`` does them
        between two steps."""
        self._own_loop_boundary()
        if self._agreement is None:
            if not self._ctl.pending:
                return False
            self._ctl.latch.log_pending()
            return self._ctl.must_stop_now()
        if self._agreed_stop is not None:
            return True
        return self._agree(act=False)

    def resume(self) -> int:
        """Restore the newest checkpoint that loads into ``state``; return the step to start from.

        Without any checkpoint, returns 0 and leaves ``state`` as it is. Under torch.distributed
        it is collective: rank 0 chooses the checkpoint, every rank restores it (``steps()``
        and ``run()`` call it on every rank when you do not).
        """
        extra = self._resume_from_env()
        if self._ranks is not None or self._sharded:
            self._resume_ranks(extra)
        elif self.config.save_fn is not None:
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
        self._boundary = (self._step, time.monotonic())
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
                if _is_rank_zero():
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
        ``handler.step``. Passing it also sets ``handler.step``. Under torch.distributed it is
        collective: call it on every rank.
        """
        if step is not None:
            self.step = step
        return self._save(reuse=False)

    def _save(self, *, reuse: bool) -> Path:
        """``save()``; ``reuse``: a checkpoint of this step committed already will do (the
        multi-rank stop and insurance: only rank 0 knows of its background saves)."""
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
        if self._sharded:
            path, written = self._save_sharded(step, reuse=reuse)
            if not written:
                self._last_saved = (step, path)
                return path
        elif self._ranks is not None:
            path, written = self._save_full(step, reuse=reuse)
            if not written:
                self._last_saved = (step, path)
                return path
        elif self.config.save_fn is not None:
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
            if _is_rank_zero():
                _run.update_record(save_s=round(self._interval.save_cost()[0], 3))
        self._last_saved = (step, path)
        _log_saved("preemptible: saved %s (step %d, %.2f s)", path, step, seconds)
        return path

    def stop(self) -> None:
        """Stop the run here: commit a checkpoint of ``handler.step`` (unless one exists),
        record it, acknowledge the notices and call ``exit_fn`` (default: exit with
        128 + signum, 143 for a notice). For loops of your own, when ``should_stop`` is True."""
        if self._stopped:
            raise PreemptibleError("this handler has already stopped the run; create a new one")
        if self._agreed_stop is None:  # not the stop all ranks agreed on: this rank asks
            self._ctl.request_stop("stop()", "handler.stop() was called")
            if self._agreement is not None and not self._agree(act=False, local=Decision.STOP):
                assert self._ranks is not None
                raise PreemptibleError(
                    f"rank {self._ranks.rank}: under torch.distributed call stop() on every "
                    "rank at the same step, or when should_stop is True; another rank was "
                    "already past this step"
                )
        self._stop(self._agreed_stop)

    def close(self) -> None:
        """Restore the previous signal handlers, stop the watcher and release the directory;
        safe to call twice. After a committed stop whose exit is under way, the handlers stay
        until the process is gone (a late signal then exits with the stop's code)."""
        if self._async is not None:
            self._async.close()  # never leave a write behind; frees the staging buffers
            self._collect_async()
        if self._shards is not None:
            self._shards.close()
            self._shards = None
        self._ctl.close()
        if self._agreement is not None:
            self._agreement.close()
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

    def _own_loop_boundary(self) -> None:
        """``should_stop`` after the loop set ``handler.step`` forward: the boundary between
        two steps of a loop of one's own; time the steps and save if one is due."""
        now = time.monotonic()
        if self._boundary is None or self._step <= self._boundary[0] or self._stopped:
            if self._boundary is None or self._step < self._boundary[0]:
                self._boundary = (self._step, now)
            return
        since, done = self._boundary[0], self._step - self._boundary[0]
        self.step_times.add((now - self._boundary[1]) / done)
        self._boundary = (self._step, now)
        if self._async is not None:
            self._collect_async()
        if not self._saved_at_current_step():  # not when the loop just called save() itself
            self._save_if_due(None, since)

    def _finish_step(self, started: float, total: int | None) -> None:
        self.step_times.add(time.monotonic() - started)
        self._step += 1
        self._boundary = (self._step, time.monotonic())  # steps()/run() timed and saved it
        self._save_if_due(total, self._step - 1)

    def _save_if_due(self, total: int | None, since: int) -> None:
        """Save if a save point lies after step ``since``, up to this one (or at ``total``)."""
        every = self.save_every_steps
        if isinstance(every, int):
            due = self._step // every > since // every or self._step == total
        elif self._interval is not None:
            due = self._step == total or self._interval.due(time.monotonic(), self._last_save_end)
            if due and self._ranks is not None and self._step != total:
                # a clock is not the same on every rank: rank 0 asks, all save where agreed
                self._want_save = self._ranks.is_zero
                due = False
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
        if self._shards is not None:
            self._save_shards_in_background()
            return
        self._collect_async()
        started = time.monotonic()
        step = self._step
        payload = build_payload(step, self._state)
        if self._ranks is not None:  # every rank's random states; rank 0 writes
            rngs = self._gather_rng()
            if rngs is None:
                return
            payload.update(rng_ranks=rngs, world_size=self._ranks.world)
        if self._async.save(step, payload, write_payload):  # the copy is made in there
            self._count_stall(started)
        self._last_save_end = time.monotonic()  # skipped too: the next point is an interval away

    def _count_stall(self, started: float) -> None:
        """A background save started: what the training loop waited for it since ``started``."""
        assert self._async is not None
        stall = time.monotonic() - started
        self.stall_times.add(stall)
        if self._interval is not None:
            self._interval.observe_save(stall, write=self._async.write_seconds)

    def _save_shards_in_background(self) -> None:
        """A sharded checkpoint written in the background. Rank 0 decides whether this save
        point is taken (policy "skip" with a save in flight) and names the temporary directory;
        every rank then snapshots its shards (DCP's async_save) and goes on. In the background
        each rank waits for its shards to be written and adds its random states; rank 0 then
        waits for every rank's, adds the small state and commits, and tells the others, so that
        every rank ends its background save with the same checkpoint or the same failure."""
        assert self._async is not None and self._shards is not None
        self._collect_async()
        started = time.monotonic()
        ranks = self._ranks
        rank, world = (ranks.rank, ranks.world) if ranks is not None else (0, 1)
        step = self._step
        objects, _plain = self._state.split()
        big, _small = split_sharded(objects)
        key = self._next_key("save")
        # Rank 0 announces at once (the others wait for it on their training threads); every
        # rank then waits for its own write in flight, whose end does not need any training
        # thread, before the copy overwrites the staging buffers that write reads.
        if ranks is None or ranks.is_zero:
            go: dict[str, Any] = {"skip": True}
            if not self._async.skips(step):
                tmp = self.store.temporary(step)
                try:
                    tmp.mkdir()
                    go = {"tmp": tmp.name}
                except OSError as exc:  # a directory that refuses writes: no save this time
                    go = {"error": f"cannot create {tmp}: {exc.strerror or exc}"}
            if ranks is not None:
                ranks.announce(f"{key}/go", go)
        else:
            go = ranks.hear(f"{key}/go", f"rank 0 to start the save of step {step}")
        if "error" in go:
            logger.error(
                "preemptible: background checkpoint of step %d failed: %s; the previous "
                "checkpoints are intact",
                step,
                go["error"],
            )
        if "tmp" not in go:
            self._last_save_end = time.monotonic()  # the next save point is an interval away
            return
        self._async.wait()
        self._collect_async()
        tmp = self.store.directory / str(go["tmp"])
        meta: dict[str, Any] | None = None
        shards: Any = None
        failed: BaseException | None = None
        try:
            rng = capture_rng()
            if rank == 0:
                meta = self._async.snapshot.copy(self._sharded_meta(step, big, world))
            shards = self._shards.start(big, tmp)  # the copy to host memory is made in there
        except Exception as exc:  # reported as this save's failure, at the next boundary
            failed = exc

        def write(directory: Path) -> None:  # rank 0's, inside the store's commit
            if failed is not None:
                raise failed
            shards.result()
            write_rank_rng(directory, rank, rng)
            if ranks is not None:
                hear_written(ranks, key, directory)
            assert meta is not None  # rank 0 snapshotted it
            write_payload(meta, directory / META_NAME)

        def commit() -> Path:
            try:
                path = self.store.save(step, write, tmp=tmp)
            except BaseException as exc:
                if ranks is not None:
                    save_failed(ranks, f"{key}/done", exc)
                raise
            if ranks is not None:
                ranks.announce(f"{key}/done", {"path": path.name})
            return path

        def written() -> Path:  # the other ranks'
            assert ranks is not None
            try:
                if failed is not None:
                    raise failed
                shards.result()
                write_rank_rng(tmp, rank, rng)
            except BaseException as exc:
                ranks.announce(f"{key}/written/{rank}", {"error": f"{type(exc).__name__}: {exc}"})
                raise
            ranks.announce(f"{key}/written/{rank}", {})
            fields = ranks.hear(f"{key}/done", f"rank 0 to commit step {step}")
            path = self.store.directory / str(fields.get("path"))
            if "error" in fields:
                raise remote_error(fields, f"save step {step}", path)
            return path

        self._async.start(step, commit if rank == 0 else written)
        self._count_stall(started)
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
            _log_saved("preemptible: saved %s in the background (step %d)", done[1], done[0])

    def _saved_at_current_step(self) -> bool:
        return self._last_saved is not None and self._last_saved[0] == self._step

    def _at_boundary(self) -> bool:
        """Act on stop requests between two steps; True when the run stopped here."""
        if self._async is not None:
            self._collect_async()
        if self._agreement is not None:
            return self._agree(act=True)
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

    def _stop(self, agreed: Notice | None = None) -> None:
        """Save (unless saved here), record, exit. ``agreed``: the stop every rank agreed on;
        its code is every rank's exit code, whichever rank's signal came first."""
        if self._async is not None:  # a save in flight of this very step is the final one
            self._async.wait()
            self._collect_async()
        ranks = self._ranks
        if ranks is None:
            saved = self._last_saved[1] if self._saved_at_current_step() else None  # type: ignore[index]
            notice, path = self._ctl.finish(step=self._step, save=self.save, saved=saved)
        else:
            notice, path = self._ctl.finish(
                step=self._step,
                save=lambda: self._save(reuse=True),
                record=ranks.is_zero,
                notice=agreed,  # the record and the tracker tell the agreed stop's story
            )
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
        if ranks is not None:
            self._leave_together()
        self.close()
        exit_fn = self.config.exit_fn or sys.exit
        exit_fn(code)
        # an exit_fn that returns (a notebook, a test): the run goes on without our handlers
        self._ctl.latch.restore()

    # -- torch.distributed ---------------------------------------------------------------
    def _agree(self, *, act: bool, local: Decision | None = None) -> bool:
        """A boundary under torch.distributed: every rank saves and stops where all agree.
        ``act``: stop here when agreed (steps()/run()); else remember it (should_stop).
        ``local``: what this rank asks for regardless of its requests (stop()). True when
        the agreed stop is here."""
        ag = self._agreement
        assert ag is not None
        ctl = self._ctl
        if local is None and not ctl.pending and not self._want_save and ag.quiet():
            return False  # the common case: two attribute writes and two truth tests
        while True:
            wanted = local or Decision.CONTINUE
            if ctl.pending and wanted is Decision.CONTINUE:
                if act:
                    wanted = ctl.decide(saved_here=self._saved_at_current_step())
                else:
                    ctl.latch.log_pending()
                    wanted = Decision.STOP if ctl.must_stop_now() else Decision.CONTINUE
            periodic = wanted is Decision.CONTINUE and self._want_save
            if periodic:
                wanted = Decision.INSURANCE
            agreed: Agreed = ag.decide(wanted, ctl.requests.first_stop(), periodic=periodic)
            if agreed.decision is Decision.CONTINUE:
                return False
            if agreed.decision is Decision.INSURANCE:
                self._want_save = False  # any agreed checkpoint here is rank 0's periodic one
                try:
                    if agreed.periodic and self._async is not None:
                        self._save_in_background()  # every rank knows it is periodic
                    else:
                        self._save(reuse=not agreed.periodic)
                except CheckpointSaveError as exc:
                    logger.error("preemptible: checkpoint at the agreed step failed: %s", exc)
                continue  # the same boundary: a stop may be due right after the save
            self._agreed_stop = agreed.notice
            if act:
                self._stop(agreed.notice)
            return True

    def _next_key(self, what: str) -> str:
        self._seq += 1
        return f"{what}/{self._seq}"

    def _gather_rng(self) -> list[Any] | None:
        """Every rank's random states, on rank 0 (None elsewhere)."""
        ranks = self._ranks
        assert ranks is not None
        key = self._next_key("rng")
        got = ranks.gather(key, pack(capture_rng()), "the random states of every rank")
        return None if got is None else [unpack(b) for b in got]

    def _save_full(self, step: int, *, reuse: bool) -> tuple[Path, bool]:
        """Rank 0 writes the state with every rank's random states; the others wait for its
        commit. Returns the checkpoint and whether it was written now."""
        ranks = self._ranks
        assert ranks is not None
        key = self._next_key("save")
        save_fn = self.config.save_fn
        if save_fn is None:
            ranks.store.set(f"{key}/rng/{ranks.rank}", pack(capture_rng()))

        def write() -> dict[str, Any]:
            if reuse and self._last_saved is not None and self._last_saved[0] == step:
                return {"path": self._last_saved[1].name, "written": False}
            if save_fn is not None:
                return {"path": self.store.save(step, save_fn).name, "written": True}
            rng_keys = [f"{key}/rng/{r}" for r in range(ranks.world)]
            ranks.wait_all(rng_keys, "the random states of every rank")
            rngs = [unpack(bytes(ranks.store.get(k))) for k in rng_keys]
            payload = build_payload(step, self._state)
            payload.update(rng_ranks=rngs, world_size=ranks.world)
            return {"path": self.store.save(step, lambda t: write_payload(payload, t)).name}

        fields = run_on_zero(ranks, f"{key}/done", f"rank 0 to save step {step}", write)
        path = self.store.directory / str(fields.get("path"))
        if "error" in fields:
            raise remote_error(fields, f"save step {step}", path)
        if ranks.is_zero and save_fn is None:
            for r in range(ranks.world):
                ranks.store.delete_key(f"{key}/rng/{r}")
        return path, bool(fields.get("written", True))

    def _save_sharded(self, step: int, *, reuse: bool) -> tuple[Path, bool]:
        """Every rank writes its shards into rank 0's temporary directory; rank 0 adds the
        small state and commits the directory once every rank has written. Returns the
        checkpoint and whether it was written now (``reuse``: rank 0 has one of this step)."""
        ranks = self._ranks
        rank, world = (ranks.rank, ranks.world) if ranks is not None else (0, 1)
        objects, _plain = self._state.split()
        big, _small = split_sharded(objects)
        key = self._next_key("save")
        rng = capture_rng()

        def write(tmp: Path) -> None:
            if ranks is not None:
                ranks.announce(f"{key}/tmp", {"name": tmp.name})
            write_shards(big, tmp, rank, rng)
            if ranks is not None:
                hear_written(ranks, key, tmp)
            write_payload(self._sharded_meta(step, big, world), tmp / META_NAME)

        def reused() -> Path | None:
            if reuse and self._last_saved is not None and self._last_saved[0] == step:
                return self._last_saved[1]
            return None

        if ranks is None:
            old = reused()
            return (old, False) if old is not None else (self.store.save(step, write), True)
        if not ranks.is_zero:
            got = ranks.wait_any([f"{key}/tmp", f"{key}/done"], f"rank 0 to save step {step}")
            if got.endswith("/tmp"):
                tmp = self.store.directory / str(ranks.get_json(got)["name"])
                try:
                    write_shards(big, tmp, rank, rng)
                except BaseException as exc:
                    ranks.announce(f"{key}/written/{rank}", {"error": f"{exc}"})
                    raise
                ranks.announce(f"{key}/written/{rank}", {})

        def commit() -> dict[str, Any]:
            old = reused()
            if old is not None:
                return {"path": old.name, "written": False}
            return {"path": self.store.save(step, write).name}

        fields = run_on_zero(ranks, f"{key}/done", f"rank 0 to commit step {step}", commit)
        path = self.store.directory / str(fields.get("path"))
        if "error" in fields:
            raise remote_error(fields, f"save step {step}", path)
        return path, bool(fields.get("written", True))

    def _sharded_meta(self, step: int, big: Mapping[str, Any], world: int) -> dict[str, Any]:
        """The small part of a sharded checkpoint (rank 0 writes it): everything but the
        modules and optimizers, the step, and what was sharded."""
        meta = build_payload(step, Subset(self._state.mapping, set(big)))
        meta.update(sharded=sorted(big), world_size=world)
        return meta

    def _resume_ranks(self, extra: list[Checkpoint]) -> None:
        """Rank 0 finds the newest checkpoint that loads; every rank restores it, each with its
        own random states (a sharded one through torch.distributed.checkpoint, together)."""
        ranks = self._ranks
        rank = ranks.rank if ranks is not None else 0
        peeked: dict[str, Any] | None = None  # rank 0 reads the newest one only once

        def find() -> dict[str, Any]:
            nonlocal peeked
            newest: Checkpoint | None
            if self.config.save_fn is not None:
                newest = max([*extra, *self.store.committed()], key=lambda c: c.step, default=None)
            else:
                found = self.store.load_newest(self._peek, extra)
                newest, peeked = (None, None) if found is None else found
            if newest is None:
                return {"path": None}
            inside = newest.path.parent.resolve() == self.store.directory.resolve()
            return {"path": newest.path.name if inside else str(newest.path), "step": newest.step}

        if ranks is None:
            fields = find()
        else:
            fields = run_on_zero(ranks, self._next_key("resume"), "rank 0 to resume", find)
            if "error" in fields:
                raise CheckpointLoadError(
                    f"rank 0 could not resume: {fields['error']}", self.store.directory
                )
        if fields.get("path") is None:
            return
        path = self.store.directory / str(fields["path"])
        if self.config.save_fn is not None:
            self._step, self.resume_path = int(fields["step"]), path
            return
        try:
            payload = peeked if peeked is not None else self._peek(path)
        except Exception as exc:
            raise CheckpointLoadError(
                f"rank {rank} cannot read {path}, which rank 0 resumes from ({exc}); every "
                "rank must see the checkpoint directory (a shared file system)",
                path,
            ) from exc
        if path.is_dir():
            objects, _plain = self._state.split()
            big, _small = split_sharded(objects)
            read_shards(big, path)
            payload = dict(payload, rng=read_rank_rng(path, rank))
            apply_payload(payload, Subset(self._state.mapping, set(big)), path)
        else:
            apply_payload(own_rng(payload, rank, path), self._state, path)
        self._step, self.resume_path = payload["step"], path

    def _peek(self, path: Path) -> dict[str, Any]:
        """A checkpoint's payload: the whole file, or a sharded directory's small part."""
        if path.is_dir():
            check_sharded(path)
            return read_payload(path / META_NAME, weights_only=self.weights_only)
        return read_payload(path, weights_only=self.weights_only)

    def _leave_together(self) -> None:
        """After a committed stop: rank 0 finishes its record and tracker before any rank
        exits, so that a launcher that tears the job down when the first rank exits (torchrun)
        cannot cut rank 0 short."""
        ranks = self._ranks
        assert ranks is not None
        try:
            if ranks.is_zero:
                ranks.store.set("stop/exit", "1")
            else:
                ranks.wait_any(["stop/exit"], "rank 0 to finish its stop")
        except Exception as exc:  # the stop is committed; leaving is all that is left
            logger.warning("preemptible: leaving without rank 0: %s", exc)

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


def _log_saved(message: str, *args: Any) -> None:
    """Every rank saves together; one line of it (rank 0's) is enough at INFO."""
    logger.log(logging.INFO if _is_rank_zero() else logging.DEBUG, message, *args)


def _announce(message: str, *args: Any) -> None:
    """An INFO line a person must see even when the program configured no logging."""
    if logger.hasHandlers():
        logger.info(message, *args)
    else:
        print(message % args, file=sys.stderr, flush=True)
