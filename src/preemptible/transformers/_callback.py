"""``PreemptionCallback``: the Hugging Face Trainer front end of the kit.

The Trainer writes its checkpoints itself, after the step-end hook (``_maybe_log_save_evaluate``:
log, evaluate, save, ``on_save``), so this front end decides at the step's end and commits what
the Trainer wrote once it is complete:

- ``on_step_end``: the session decides (``StopSession.decide``). A stop (or an insurance
  checkpoint) asks the Trainer for its ordinary save of this step, with ``control.should_save``
  (and ``should_training_stop`` for a stop). Whenever a save of this step is coming (ours or the
  Trainer's own ``save_steps``/epoch/best), ``args.output_dir`` points for that save at a
  temporary directory of the checkpoint store (``.tmp-checkpoint-N....``), a name that neither
  ``get_last_checkpoint`` nor the Trainer's rotation matches. The Trainer's own log lines of
  that save (``Saving model checkpoint to ...``) name the ``checkpoint-N`` it is committed as
  (``_FinalPaths``): the temporary is an implementation detail a user never finds on disk.
- ``on_save``: the Trainer's ``checkpoint-N`` is complete in the temporary; the session commits
  it as ``output_dir/checkpoint-N`` (fsync, rename, fsync of the directory), then the Trainer's
  retention (``save_total_limit``, the best checkpoint kept) runs over committed ones only.
- ``on_epoch_end`` (the training loop was left): the stop is finished by the session: record,
  trackers, exit code, exit.

A stop decided at the run's last step (``max_steps``) has nothing left to stop: the Trainer
ends there anyway. It is not acted on as a stop: the last step is saved (the Trainer's save of
it, asked for when its ``save_strategy`` does not), ``train()`` returns, the run finishes and
the program's code after ``train()`` runs. Acted on as a stop, its checkpoint would be the
finished run's, and the rerun, which must not train past it, would exit before that code.

The RNG states in the checkpoint are the Trainer's own, taken at the end of the step, which is
why ``trainer.train(resume_from_checkpoint=...)`` then continues bit for bit.

``output_dir`` stays a local directory (the Trainer writes there and ``get_last_checkpoint``
reads there). ``mirror=URL`` adds a bucket: every committed ``checkpoint-N`` is uploaded to it
(in the background; a stop's before the process exits), and the callback's creation, which
comes before the script's ``get_last_checkpoint``, puts the newest one committed in the bucket
back into ``output_dir`` when that holds nothing as new: a run on a new machine resumes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

from ..frontend import (
    CheckpointSaveError,
    CheckpointStore,
    ConfigError,
    Decision,
    Notice,
    StagedSaver,
    StopSession,
    TerminationConfig,
    exit_code_of,
    is_url,
    normalize_signals,
    saving_config,
    staged_in,
    without_crc32,
)
from ..trackers import Tracker, TrackerGroup

logger = logging.getLogger("preemptible")

NAME = PREFIX_CHECKPOINT_DIR + "-{step}"
_KEEP_ALL = 2**31 - 1  # the Trainer's rotation prunes (save_total_limit), never the store
_ARGS_FILE = "training_args.bin"
_STATE_FILE = "trainer_state.json"


# the loggers of transformers that name the directory of a save as they write it
_SAVE_LOGGERS = (
    "transformers.trainer",
    "transformers.modeling_utils",
    "transformers.configuration_utils",
    "transformers.generation.configuration_utils",
    "transformers.tokenization_utils_base",
    "transformers.processing_utils",
)


class _FinalPaths(logging.Filter):
    """While the Trainer saves into a temporary of the store, its log lines name the path the
    save is committed to (``output_dir/checkpoint-N``) instead of the temporary's. A filter of
    the loggers themselves, so that it applies whatever handlers the program set up."""

    def __init__(self, temporary: str, final: str) -> None:
        super().__init__()
        self.temporary, self.final = temporary, final

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and self.temporary in record.msg:
            record.msg = record.msg.replace(self.temporary, self.final)
        return True

    def attach(self) -> None:
        for name in _SAVE_LOGGERS:
            logging.getLogger(name).addFilter(self)

    def detach(self) -> None:
        for name in _SAVE_LOGGERS:
            logging.getLogger(name).removeFilter(self)


@dataclasses.dataclass
class _Staged:
    """A save of the Trainer's that writes into a temporary of the store."""

    output_dir: str  # the user's output_dir, put back after the save
    step: int
    started: float  # time.monotonic() when the save was asked for
    paths: _FinalPaths  # the Trainer's log lines of the save name output_dir
    crc: Any  # entered: the Trainer's torch.saves (the optimizer's) skip torch's CRC32


class PreemptionCallback(TrainerCallback):
    """Stop a ``Trainer`` cleanly on a signal or a platform notice, as a committed
    ``checkpoint-N`` that ``trainer.train(resume_from_checkpoint=...)`` resumes bit for bit.

    ``termination_config``, ``signals``: as for ``PreemptionCheckpointHandler``. ``tracker``:
    told the true status once; ``"auto"`` (the default) follows ``report_to``: the MLflow and
    W&B runs the Trainer's integrations opened (``None``: no tracker). ``exit``: after the stop
    the process exits 128 + signum (143 for a notice), so no code after ``train()`` runs;
    ``exit=False``: ``train()`` returns and ``callback.stopped``/``callback.exit_code`` say
    what happened. ``exit_code``: a fixed code for every stop instead.

    With the callback, every ``checkpoint-N`` the Trainer saves (``save_steps``, epochs, the
    best one) is committed atomically: a kill during any save leaves the previous checkpoints
    and no half-written one for ``get_last_checkpoint`` to pick.

    ``mirror``: a bucket's URL (``s3://bucket/prefix``, ``gs://``, ``az://``) each committed
    ``checkpoint-N`` is uploaded to; with it, ``output_dir`` (the Trainer's
    ``args.output_dir``) is where the newest one in the bucket is put back, as the callback is
    created, so that ``get_last_checkpoint(output_dir)`` finds it on a new machine.
    """

    def __init__(
        self,
        *,
        termination_config: TerminationConfig | None = None,
        signals: Iterable[int | str] | None = None,
        tracker: Tracker | Literal["auto"] | None = "auto",
        exit: bool = True,
        exit_code: int | None = None,
        mirror: str | None = None,
        output_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        config = saving_config(termination_config, "PreemptionCallback (the Trainer saves)")
        self.store: CheckpointStore | None = None  # with mirror: output_dir's, with its bucket
        if mirror is not None:
            if not isinstance(mirror, str) or not is_url(mirror):
                raise ConfigError(
                    f"mirror={mirror!r} is not valid; use a bucket's URL (s3://bucket/prefix, "
                    "gs://bucket/prefix, az://container/prefix), or None"
                )
            if output_dir is None:
                raise ConfigError(
                    "mirror= needs output_dir=, the Trainer's args.output_dir: the newest "
                    "checkpoint in the bucket is put back there before get_last_checkpoint"
                )
            self.store = CheckpointStore(staged_in(mirror, output_dir), keep=_KEEP_ALL)
        elif output_dir is not None:
            raise ConfigError("output_dir= is only for mirror=; leave it None without a mirror")
        self.signals = normalize_signals(signals)
        if not (tracker is None or tracker == "auto" or isinstance(tracker, Tracker)):
            raise ConfigError(
                f"tracker={tracker!r} is not valid; use 'auto', None or a preemptible tracker"
            )
        if not isinstance(exit, bool):
            raise ConfigError(f"exit={exit!r} is not valid; use True or False")
        self.tracker = tracker
        self.fixed_code = exit_code_of(exit_code)
        self.exit_code: int | None = None  # the code the stop exits (or would exit) with
        self.stopped: Notice | None = None  # what stopped training (exit=False: read it)
        self.checkpoint: Path | None = None  # the newest committed checkpoint-N
        self._config = config
        if not exit:
            self._config = dataclasses.replace(config, exit_fn=self._returned)
        self.session: StopSession | None = None
        self.saver: StagedSaver | None = None
        self._staged: _Staged | None = None
        self._stopping = False
        self._stop_on_save = False
        self._ending = False  # a stop came at the last step: training ends as it would
        self._auto_tracker = False
        self._warned_unstaged = False

    # -- life cycle ------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session is not None:  # a second train() with the same callback
            self.session.close()
        if getattr(args, "enable_jit_checkpoint", False):
            logger.warning(
                "preemptible: enable_jit_checkpoint=True is overridden by PreemptionCallback: "
                "its signal handler is replaced, and the stop checkpoint is the callback's "
                "(at the step boundary, committed atomically)"
            )
        # the Trainer's own rotation (save_total_limit, the best one kept) prunes, after commits
        store = self.store
        if store is not None and not _same_dir(store.directory, args.output_dir):
            raise ConfigError(
                f"PreemptionCallback(output_dir={str(store.directory)!r}) is not the Trainer's "
                f"output_dir ({args.output_dir!r}); give it args.output_dir"
            )
        self.saver = saver = StagedSaver(store if store is not None else args.output_dir, NAME)
        self._auto_tracker = self.tracker == "auto"
        tracker = _trackers_of(args) if self._auto_tracker else self.tracker
        self.session = session = StopSession(
            saver,
            termination_config=self._config,
            signals=self.signals,
            tracker=tracker if state.is_world_process_zero else None,
            exit_code=self.fixed_code,
        )
        self._stopping = self._stop_on_save = self._ending = False
        self.stopped = self.exit_code = None
        session.start()
        session.begin()
        if state.global_step > 0:  # the Trainer resumed from a checkpoint of this step
            found = saver.target(state.global_step)
            session.note_saved(
                found if found.is_dir() else found.parent, step=state.global_step, resumed=True
            )
            if state.max_steps and state.global_step >= state.max_steps:
                self._finished_already(found, state)
        elif newest := _newest_checkpoint(saver):
            logger.warning(
                "preemptible: training starts at step 0, but %s holds %s: to go on from it, "
                "pass resume_from_checkpoint=get_last_checkpoint(output_dir) to train()",
                args.output_dir,
                newest,
            )

    def _finished_already(self, found: Path, state: Any) -> None:
        """The checkpoint resumed is the run's last step: a rerun of a finished run trains
        nothing. The Trainer would train one step past ``max_steps`` (its loop checks for the
        end only after a step), save it and return a one-step run, whose metrics the program
        then writes over its results (``train_results.json``); no callback can skip that
        step, so the run ends here, as a run that finished (exit 0), and the program's code
        after ``train()`` does not run: its results are the finished run's. With
        ``exit=False`` (``train()`` must return) only the warning is left."""
        session = self.session
        assert session is not None
        if self._config.exit_fn == self._returned:
            logger.warning(
                "preemptible: %s is of a finished run (step %d of %d); the Trainer trains one "
                "step past it when resumed, as exit=False lets train() go on: load the model "
                "from it instead",
                found.name,
                state.global_step,
                state.max_steps,
            )
            return
        session.finished(step=state.global_step, tell_tracker=not self._auto_tracker, commit=False)
        session.close()
        logger.warning(
            "preemptible: step %d of %d is trained already: exiting 0 before train() trains "
            "past it (the code after train() does not run; the run's results stay as they are)",
            state.global_step,
            state.max_steps,
        )
        self.exit_code = 0
        exit_fn = self._config.exit_fn or sys.exit
        exit_fn(0)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._unstage(args)  # a save that was possible (the best one) and did not come

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        session = self.session
        if session is None or session.stopped:
            return
        self._ask(session.decide(step=state.global_step), state, control)
        self._stage_if_saving(args, state, control)

    def _ask(self, decision: Decision, state: Any, control: Any) -> bool:
        """Ask the Trainer for what the session decided; True for a stop."""
        if decision is Decision.STOP and _last_step(state):
            self._end_instead(state, control)
            return False
        if decision is Decision.STOP:
            self._stopping = True
            control.should_save = control.should_training_stop = True
            return True
        if decision is Decision.INSURANCE:
            control.should_save = True
            logger.warning(
                "preemptible: insurance checkpoint at step %d; training goes on", state.global_step
            )
        return False

    def _end_instead(self, state: Any, control: Any) -> None:
        """A stop decided at the run's last step: training ends as it would have (see the
        module docstring), with the last step saved."""
        if self._ending:
            return
        self._ending = True
        session = self.session
        assert session is not None
        control.should_save = control.should_save or not session.saved_here
        first = session.sequence.agreed or session.controller.requests.first_stop()
        logger.warning(
            "preemptible: %s came at step %d, the run's last: nothing is left to stop; "
            "training ends as it would, and the code after train() runs",
            first.source if first is not None else "the stop",
            state.global_step,
        )

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        session = self.session
        if session is None or session.stopped:
            return
        if self._stopping:
            # the stop's checkpoint is committed: no second save or evaluation of this step
            control.should_save = control.should_evaluate = False
            self._unstage(args)
            self._stopping = False
            session.stop(step=state.global_step)  # record, trackers, exit
            control.should_training_stop = True  # exit=False: train() returns
            return
        if self._ending:
            if session.saved_here:  # no second save of the last step
                control.should_save = False
            self._stage_if_saving(args, state, control)
            return
        # a stop that came after the epoch's last step: the Trainer's epoch-end save is it
        if self._ask(session.decide(step=state.global_step), state, control):
            self._stop_on_save = True
        self._stage_if_saving(args, state, control)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        session, staged = self.session, self._staged
        if session is None or session.stopped:
            return
        self._unstage(args, discard=False)
        if staged is None or staged.step != state.global_step:
            if not self._warned_unstaged:
                self._warned_unstaged = True
                logger.warning(
                    "preemptible: the Trainer saved step %d in place (a callback after "
                    "PreemptionCallback asked for it): put PreemptionCallback last in callbacks",
                    state.global_step,
                )
            return
        written = self._saver().staged
        if session.is_zero and written is not None and written.is_dir():
            _repoint(written, Path(args.output_dir) / written.name, args, state)
        try:
            path = session.save(step=state.global_step, started=staged.started)
        except CheckpointSaveError as exc:
            if not self._stopping:
                raise
            logger.error("preemptible: %s", exc)  # the stop's own save path reports it
            return
        self.checkpoint = path
        if args.should_save and args.save_total_limit:
            rotate_checkpoints(
                output_dir=args.output_dir,
                save_total_limit=args.save_total_limit,
                best_model_checkpoint=state.best_model_checkpoint,
                use_mtime=False,
            )
        if (
            not (self._stopping or self._ending)
            and session.decide(step=state.global_step) is Decision.STOP
        ):
            if _last_step(state):
                self._end_instead(state, control)  # this save is the last step's
            else:
                self._stop_on_save = True  # it came during this save, which is the stop's then
        if self._stop_on_save:  # nothing of training is left to finish first
            self._stop_on_save = self._stopping = False
            control.should_save = control.should_evaluate = False
            control.should_training_stop = True  # exit=False: train() returns
            session.stop(step=state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        session = self.session
        if session is None:
            return
        self._unstage(args)
        try:
            if not session.stopped:
                # the Trainer's integrations finished their runs already (a tracker of one's
                # own is told here); its own checkpoints are what a rerun resumes: no end save
                session.finished(
                    step=state.global_step, tell_tracker=not self._auto_tracker, commit=False
                )
        finally:
            session.close()

    # -- saving ------------------------------------------------------------------------------
    def _stage_if_saving(self, args: Any, state: Any, control: Any) -> None:
        """A save of this step is coming (or may: the best one is decided after evaluating):
        the Trainer writes it into a temporary of the store."""
        best = args.save_strategy == SaveStrategy.BEST and control.should_evaluate
        if not (control.should_save or best) or self._staged is not None:
            return
        parent = self._saver().stage(state.global_step)
        paths = _FinalPaths(str(parent), args.output_dir)
        # the optimizer's state, twice the weights with Adam, is the Trainer's torch.save: its
        # CRC32 is CPU time of the save that nothing reads (see ``without_crc32``)
        crc = without_crc32()
        self._staged = _Staged(args.output_dir, state.global_step, time.monotonic(), paths, crc)
        args.output_dir = str(parent)
        paths.attach()
        crc.__enter__()

    def _unstage(self, args: Any, *, discard: bool = True) -> None:
        """Put ``output_dir`` back; ``discard``: the save did not come, drop its temporary."""
        staged, self._staged = self._staged, None
        if staged is None:
            return
        args.output_dir = staged.output_dir
        staged.paths.detach()
        staged.crc.__exit__(None, None, None)
        if discard:
            self._saver().discard()

    def _saver(self) -> StagedSaver:
        assert self.saver is not None, "on_train_begin makes the saver"
        return self.saver

    def _returned(self, code: int) -> None:
        """``exit=False``: the stop is over and ``train()`` returns."""
        session = self.session
        self.exit_code = code
        if session is not None:
            first = session.controller.requests.first_stop()
            self.stopped = first


def _last_step(state: Any) -> bool:
    """Whether the step just trained is the run's last (``max_steps``)."""
    return bool(state.max_steps) and state.global_step >= state.max_steps


def _same_dir(a: Path, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _newest_checkpoint(saver: StagedSaver) -> str | None:
    """The name of the highest-numbered committed ``checkpoint-N`` (as the Trainer finds it)."""
    found = saver.store.committed(saver.pattern)
    return max(found, key=lambda c: c.step).path.name if found else None


def _repoint(written: Path, final: Path, args: Any, state: Any) -> None:
    """What the Trainer recorded of the temporary's path names the committed one."""
    best = state.best_model_checkpoint
    if isinstance(best, str) and Path(best).name == written.name and Path(best) != final:
        state.best_model_checkpoint = str(final)
        if (written / _STATE_FILE).is_file():
            state.save_to_json(str(written / _STATE_FILE))
    if (written / _ARGS_FILE).is_file():
        import torch

        torch.save(args, written / _ARGS_FILE)  # output_dir is the user's again


def _trackers_of(args: Any) -> Tracker | None:
    """The MLflow and W&B runs the Trainer's integrations opened (``report_to``)."""
    report_to = args.report_to if isinstance(args.report_to, list) else [args.report_to]
    found: list[Tracker] = []
    if "mlflow" in report_to:
        try:
            import mlflow

            if mlflow.active_run() is not None:
                from ..trackers import MLflowTracker

                found.append(MLflowTracker())
        except ImportError:
            pass
    if "wandb" in report_to:
        try:
            import wandb

            if wandb.run is not None:
                from ..trackers import WandbTracker

                found.append(WandbTracker())
        except ImportError:
            pass
    if not found:
        return None
    return TrackerGroup(found, upload=False)
