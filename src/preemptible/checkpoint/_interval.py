"""How often to save: the Young/Daly interval, from a measured save cost and the interruption rate.

A periodic checkpoint is insurance against the interruptions nothing announces in time (a
SIGKILL, a lost machine, a notice shorter than a save): each one throws away the work since
the last checkpoint. Saving stalls training for ``C`` seconds; interruptions that lose work
arrive at random with mean ``M`` between them. Saving every ``τ`` seconds of training wastes
about ``C/τ + τ/(2M)`` of the time; Young (1974) minimized this to ``τ = sqrt(2CM)`` and Daly
(2006) added the higher-order terms used here (``daly_interval``). The waste is flat near the
optimum: an interval off by 2x (an MTBF off by 4x) wastes about 25 % more than the optimum.

Where the inputs come from:

- ``C``: the median of the last saves' stalls as the training loop saw them (for an async
  save, the stall, not the background write). Before the first save: the cost the previous
  attempt measured (``save_s`` in its run record), else an assumed 1 s, which makes the first
  save come early and measure the real cost.
- the mean time between interruptions: ``mtbf=`` or ``PREEMPTIBLE_MTBF`` pin it. Otherwise it
  is a gamma-exponential posterior: the platform's prior counts as one interruption seen in
  one prior MTBF of uptime, and this run's own history (the attempts journal of
  ``preemptible run``, plus the uptime of this attempt so far) is added to it:
  ``(1 + interruptions) / (prior MTBF + uptime)``. With no history this is the prior; after a
  few interruptions the run's own rate dominates. Reasoning: priors are guesses (no cloud
  publishes a per-VM rate), so they must be weak, but one short attempt must not swing the
  interval either.
- notices: an interruption announced with a window long enough for a save loses nothing, so
  only the others count: ``M_loss = M / share_unannounced``. The share starts at the
  platform's value (worth two interruptions) and is updated by the run's history (an attempt
  that was PREEMPTED with a committed final checkpoint was covered; a CRASHED one, a
  PREEMPTED one without a final checkpoint, or one whose supervisor vanished was not). When
  the notice window is too short for a save (``1.25 * C + 5 s >= window``), every
  interruption loses work and the share is 1.

Only the standard library is imported here: the handler imports this module at import time.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .._env import env_float
from .._errors import ConfigError
from .._run import current_run
from ._history import History, read_history

HOUR = 3600.0
DEFAULT_SAVE_COST = 1.0  # assumed before the first save: small, so the first save comes early
PRIOR_WEIGHT = 1.0  # the platform's MTBF counts as this many interruptions seen
SHARE_WEIGHT = 2.0  # the platform's unannounced share counts as this many interruptions
SAVES_KEPT = 5  # the save cost is the median of this many recent saves
NOTICE_SAFETY = 1.25  # TerminationConfig.safety_factor's default
EXIT_MARGIN = 5.0  # notices.EXIT_MARGIN: the handler aims to be done this long before the kill


@dataclass(frozen=True)
class Prior:
    """What a platform tells us before the run has any history of its own."""

    mtbf: float  # seconds between interruptions of any kind
    window: float  # seconds from a notice to the hard stop (inf: a stop waits for the save)
    unannounced: float  # share of interruptions that come without a usable notice
    source: str


# No cloud publishes a per-VM interruption rate, so the MTBFs are deliberately pessimistic
# (shorter MTBF: more saves, which costs little) and weak (see PRIOR_WEIGHT); the run's own
# history replaces them. The unannounced shares are assumptions, not published numbers.
PRIORS = {
    "gce": Prior(
        24 * HOUR,
        30.0,
        0.1,
        "GCE preemptible VMs stop after at most 24 h; Spot VMs get 30 s from ACPI soft off "
        "to hard off",
    ),
    "ec2": Prior(
        24 * HOUR,
        120.0,
        0.1,
        "EC2 Spot: a 2-minute notice, issued best effort; the Spot Instance Advisor gives only "
        "monthly buckets (the top one is >20 %)",
    ),
    "azure": Prior(
        24 * HOUR, 30.0, 0.1, "Azure Spot: evicted with 30 s notice (Scheduled Events); no rate"
    ),
    "slurm": Prior(
        24 * HOUR,
        30.0,
        0.25,
        "SLURM preemption: SIGTERM, then SIGKILL KillWait (default 30 s) later; node failures "
        "come unannounced",
    ),
    "kubernetes": Prior(
        24 * HOUR,
        30.0,
        0.25,
        "Kubernetes: terminationGracePeriodSeconds (default 30 s); node loss and OOM kills "
        "come unannounced",
    ),
    "local": Prior(
        7 * 24 * HOUR,
        math.inf,
        1.0,
        "a local machine: a signal waits for the save; what remains are crashes, OOM kills, "
        "reboots",
    ),
}


def daly_interval(save_cost: float, mtbf: float) -> float:
    """Seconds of training between the end of one save and the start of the next that
    minimize the expected waste (Daly 2006, the higher-order Young formula)."""
    if math.isinf(mtbf):
        return math.inf
    if save_cost <= 0:
        return 0.0
    if save_cost >= 2 * mtbf:
        return mtbf
    x = math.sqrt(save_cost / (2 * mtbf))
    return math.sqrt(2 * save_cost * mtbf) * (1 + x / 3 + x * x / 9) - save_cost


class SaveInterval:
    """When the next periodic save is due: every ``seconds()`` of training.

    ``due(now, last_save_at)`` is the per-step check (one subtraction and one comparison);
    ``observe_save`` feeds each save's measured stall and recomputes the interval;
    ``describe()`` says in one line what was chosen and why.

    mtbf: seconds between interruptions; pins the value (no prior, no history). Default
        ``PREEMPTIBLE_MTBF``, else the prior updated by the history.
    run_dir: the run directory to read the history from; default the parent of
        ``PREEMPTIBLE_RUN_DIR`` (set by ``preemptible run``). ``history`` gives it directly.
    platform: selects the prior (``PRIORS``); default ``detect_platform()``.
    prior_mtbf: replaces the platform's prior MTBF (still updated by the history).
    notice_window: seconds from a notice to the hard stop; default ``PREEMPTIBLE_GRACE_PERIOD``,
        else the platform's.
    unannounced: the share (0..1) of interruptions that lose work; pins it (it is 1 anyway
        when the notice window is too short for a save).
    save_cost: the save cost to assume until the first save is measured; default the cost an
        earlier attempt measured (``save_s`` in its run record), else 1 s.
    every: a fixed interval in seconds (``save_every_seconds``); the rest is then unused.
    min_interval, max_interval: bounds. The formula goes below 30 s only when save x MTBF
        < 450 s² (a 1 s save and an MTBF under 8 min), where a save's side costs (storage
        traffic, uploads, log lines) dominate. Above 1 h an OOM kill or a bug (which no prior
        counts) would lose too much, while a save per hour costs under 1 % for any save
        shorter than 36 s.
    clock: seconds, monotonic; the uptime of this attempt counts from the object's creation.
    """

    def __init__(
        self,
        mtbf: float | None = None,
        *,
        run_dir: str | os.PathLike[str] | None = None,
        history: History | None = None,
        platform: str | None = None,
        prior_mtbf: float | None = None,
        notice_window: float | None = None,
        unannounced: float | None = None,
        save_cost: float | None = None,
        every: float | None = None,
        min_interval: float = 30.0,
        max_interval: float = HOUR,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._every = None if every is None else _seconds("every", every)
        self._min = _seconds("min_interval", min_interval)
        self._max = _seconds("max_interval", max_interval)
        if self._max < self._min:
            raise ConfigError(
                f"max_interval={max_interval!r} is not valid; use seconds >= min_interval "
                f"({min_interval!r})"
            )
        if platform is None:
            from ..notices import detect_platform

            platform = detect_platform()
        if platform not in PRIORS:
            raise ConfigError(f"platform={platform!r} is not valid; use one of {', '.join(PRIORS)}")
        self.platform = platform
        self._prior = PRIORS[platform]
        self._prior_mtbf = self._prior.mtbf
        self._prior_name = f"{platform} prior"
        if prior_mtbf is not None:
            self._prior_mtbf, self._prior_name = _seconds("prior_mtbf", prior_mtbf), "prior_mtbf"

        self._pinned: tuple[float, str] | None = None
        if mtbf is not None:
            self._pinned = (_seconds("mtbf", mtbf), "mtbf argument")
        else:
            env = mtbf_from_env()
            if env is not None:
                self._pinned = (env, "PREEMPTIBLE_MTBF")

        if unannounced is not None and (
            isinstance(unannounced, bool)
            or not isinstance(unannounced, int | float)
            or not 0 <= unannounced <= 1
        ):
            raise ConfigError(f"unannounced={unannounced!r} is not valid; use a share from 0 to 1")
        self._share = None if unannounced is None else float(unannounced)

        if notice_window is not None:
            window: float | None = _seconds("notice_window", notice_window, zero_ok=True)
        else:
            window = env_float("PREEMPTIBLE_GRACE_PERIOD")
        self._window = self._prior.window if window is None else window

        if history is None:
            if run_dir is None:
                attempt_dir = current_run().run_dir
                run_dir = attempt_dir.parent if attempt_dir is not None else None
            history = read_history(run_dir) if run_dir is not None else History()
        self.history = history

        self._assumed = None if save_cost is None else _seconds("save_cost", save_cost, True)
        self._saves: deque[float] = deque(maxlen=SAVES_KEPT)
        self._writes: deque[float] = deque(maxlen=SAVES_KEPT)
        self._clock = clock
        self._started = clock()
        self._interval = 0.0
        self._bound = ""
        self._inputs: tuple[float, str, float, str, float, str] = (0.0, "", 0.0, "", 0.0, "")
        self._update()

    # -- the per-step check ----------------------------------------------------------------
    def due(self, now: float, last_save_at: float) -> bool:
        """True when ``now - last_save_at`` (the end of the last save, or the start of
        training) has reached the interval; both on the clock given to the constructor."""
        return now - last_save_at >= self._interval

    def seconds(self) -> float:
        """The interval: seconds of training between the end of a save and the next."""
        return self._interval

    # -- inputs ----------------------------------------------------------------------------
    def observe_save(self, stall: float, write: float | None = None) -> None:
        """Feed one save: ``stall`` is the time the training loop was held up (the whole save
        when synchronous); ``write`` the background write of an async save, which the interval
        never undercuts (saves must not queue up). Recomputes the interval."""
        if not (math.isfinite(stall) and stall >= 0):
            return  # a clock oddity; one bad sample must not break training
        self._saves.append(stall)
        if write is not None and math.isfinite(write) and write >= 0:
            self._writes.append(write)
        self._update()

    def save_cost(self) -> tuple[float, str]:
        """The cost of a save in seconds, and where it comes from."""
        if self._saves:
            n = len(self._saves)
            return _median(self._saves), "measured" if n == 1 else f"median of {n} measured"
        if self._assumed is not None:
            return self._assumed, "given, until the first save is measured"
        if self.history.save_cost is not None:
            return self.history.save_cost, "measured by an earlier attempt"
        return DEFAULT_SAVE_COST, "assumed until the first save is measured"

    def mtbf(self) -> tuple[float, str]:
        """Mean seconds between interruptions of any kind, and where it comes from."""
        if self._pinned is not None:
            return self._pinned
        h = self.history
        uptime = h.uptime + max(self._clock() - self._started, 0.0)
        n = h.interruptions
        mean = (PRIOR_WEIGHT * self._prior_mtbf + uptime) / (PRIOR_WEIGHT + n)
        prior = f"{self._prior_name} of {_fmt(self._prior_mtbf)}"
        if n == 0 and uptime < 0.01 * self._prior_mtbf:
            return mean, prior
        seen = "no interruption" if n == 0 else f"{n} interruption{'s' * (n != 1)}"
        return mean, f"{seen} in {_fmt(uptime)} of this run, with the {prior}"

    def unannounced(self) -> tuple[float, str]:
        """The share of interruptions that lose work, and why."""
        cost, _ = self.save_cost()
        window = self._window
        if NOTICE_SAFETY * cost + EXIT_MARGIN >= window:
            return 1.0, f"a {_fmt(window)} notice is too short for a {_fmt(cost)} save"
        covers = "a stop waits for the save" if math.isinf(window) else f"{_fmt(window)} notices"
        if self._share is not None:
            return self._share, f"unannounced argument; {covers}"
        h = self.history
        share = (SHARE_WEIGHT * self._prior.unannounced + h.losses) / (
            SHARE_WEIGHT + h.interruptions
        )
        if h.interruptions == 0:
            return share, f"{self.platform} prior; {covers}"
        return share, (
            f"{h.losses} of {h.interruptions} lost work in this run, with the {self.platform} "
            f"prior of {self._prior.unannounced * 100:.0f} %; {covers}"
        )

    def describe(self) -> str:
        """One line: the interval in force and the inputs it was computed from."""
        if self._every is not None:
            return f"every {_fmt(self._every)} (fixed: save_every_seconds)"
        cost, cost_how, mtbf, mtbf_how, share, share_how = self._inputs
        return (
            f"every {_fmt(self._interval)}{self._bound}: Young/Daly with save {_fmt(cost)} "
            f"({cost_how}), MTBF {_fmt(mtbf)} ({mtbf_how}), {share * 100:.0f} % of interruptions "
            f"unannounced ({share_how}), so one lossy interruption per "
            f"{_fmt(mtbf / share if share > 0 else math.inf)}"
        )

    # -- internals -------------------------------------------------------------------------
    def _update(self) -> None:
        if self._every is not None:
            self._interval = self._every
            return
        cost, cost_how = self.save_cost()
        mtbf, mtbf_how = self.mtbf()
        share, share_how = self.unannounced()
        self._inputs = (cost, cost_how, mtbf, mtbf_how, share, share_how)
        interval = daly_interval(cost, mtbf / share if share > 0 else math.inf)
        self._bound = ""
        if interval < self._min:
            interval, self._bound = self._min, f" (raised to the {_fmt(self._min)} minimum)"
        elif interval > self._max:
            interval, self._bound = self._max, f" (capped at the {_fmt(self._max)} maximum)"
        write = _median(self._writes) if self._writes else 0.0
        if write > interval:
            interval, self._bound = write, " (the background write time: saves must not queue)"
        self._interval = interval


def _seconds(name: str, value: float, zero_ok: bool = False) -> float:
    """A finite number of seconds (> 0, or >= 0), else a ConfigError naming the argument."""
    ok = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and (value >= 0 if zero_ok else value > 0)
        and value < 1e300  # finite (nan fails the comparisons); no float() of a huge int
    )
    if not ok:
        raise ConfigError(
            f"{name}={value!r} is not valid; use seconds {'>=' if zero_ok else '>'} 0"
        )
    return float(value)


def _median(values: deque[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _fmt(seconds: float) -> str:
    if math.isinf(seconds):
        return "never"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 300:
        return f"{seconds:.0f} s"
    if seconds < 2 * HOUR:
        return f"{seconds / 60:.0f} min"
    if seconds < 72 * HOUR:
        return f"{seconds / HOUR:.3g} h"
    return f"{seconds / (24 * HOUR):.3g} d"


def mtbf_from_env() -> float | None:
    """``PREEMPTIBLE_MTBF``: seconds > 0 between interruptions, None when unset."""
    return env_float("PREEMPTIBLE_MTBF", min_value=0, strict_min=True, what="seconds")
