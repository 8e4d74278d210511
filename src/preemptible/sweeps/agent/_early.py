"""Early termination in the agent: the judge that decides, after each heartbeat of a run,
whether Hyperband (``_hyperband``) stops it, and what the stopped attempt then ends as.

A run's history for the judge is its stored points of the sweep metric (``report()``, copied
into the queue at each heartbeat), ascending by step; iteration n is its n-th point, so a run
that reports once per step is judged at its step, as W&B judges the n-th logged value. The
judge reads its own run's points and, of the others, only their n-th values at the bands its
run has reached (``Store.band_values``: found through the history's index, so that a check
does not carry every point of the sweep each heartbeat). Every run of the sweep with points
sets the bands' thresholds (finished, stopped and failed ones too); only the agent's own run
is judged, by its own agent, so no run is stopped twice and no agent needs to know of the
others.

A run chosen is stopped gracefully: the agent sends it the stop signal, the run commits a
checkpoint and exits as preempted, and the attempt is recorded ``Ending.STOPPED`` (the run
``QueueState.STOPPED``: no budget spent, not requeued). ``preemptible sweep resume --run``
puts it back; a run resumed so is exempt (``early_exempt``): the user overrode the decision,
which the same thresholds would otherwise take again at the next heartbeat.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..._states import Ending
from ..spec._hyperband import Goal, Hyperband, bands, parse_early_terminate, stop_verdict
from ..spec._model import SweepSpec

logger = logging.getLogger("preemptible")

Points = Sequence[tuple[int, float]]  # (step, value) ascending by step


class Histories(Protocol):
    """What the judge reads: ``Store.band_values`` and ``Store.metric_points``."""

    def band_values(
        self, sweep_id: str, name: str, bands: Sequence[int]
    ) -> dict[int, list[float]]: ...

    def metric_points(self, run_id: str, name: str) -> list[tuple[int, float]]: ...


@dataclass(frozen=True)
class Stop:
    """Why the judge stopped a run: the band it was judged at, its value there (the best of
    its history when not ``strict``) and the band's threshold."""

    run_id: str
    band: int
    value: float
    threshold: float
    step: int

    def describe(self, metric: str) -> str:
        return (
            f"{metric} {self.value:.6g} at band {self.band} (step {self.step}) is worse than "
            f"the band's threshold {self.threshold:.6g}"
        )


def judge(
    config: Hyperband, *, goal: Goal, histories: Mapping[str, Points], run_id: str
) -> Stop | None:
    """Whether Hyperband stops running run ``run_id`` now, given every run's points."""
    finite = {run: [p for p in points if math.isfinite(p[1])] for run, points in histories.items()}
    own = finite.get(run_id, [])
    wanted = [band for band in bands(config) if band <= len(own)]
    values = {
        b: [points[b - 1][1] for points in finite.values() if len(points) >= b] for b in wanted
    }
    return _stop(config, goal, values, own, run_id)


def _stop(
    config: Hyperband,
    goal: Goal,
    band_values: Mapping[int, Sequence[float]],
    own: Points,
    run_id: str,
) -> Stop | None:
    verdict = stop_verdict(config, goal=goal, band_values=band_values, own=[v for _, v in own])
    if verdict is None:
        return None
    band, value, threshold = verdict
    return Stop(run_id, band, float(value), float(threshold), int(own[band - 1][0]))


class Judge:
    """Hyperband for one run of a sweep whose spec has ``early_terminate``."""

    def __init__(self, spec: SweepSpec, sweep_id: str, run_id: str) -> None:
        assert spec.metric is not None  # the spec check requires one with early_terminate
        self.config = parse_early_terminate(spec.raw["early_terminate"])
        self.metric, self.goal = spec.metric.name, spec.metric.goal
        self.sweep_id, self.run_id = sweep_id, run_id
        self.bands = bands(self.config)

    def check(self, store: Histories) -> Stop | None:
        """The stop, if Hyperband stops the run now. Reads the run's own points, and of the
        other runs only their values at the bands the run has reached (in the database)."""
        own = store.metric_points(self.run_id, self.metric)
        wanted = [band for band in self.bands if band <= len(own)]
        if not wanted:  # before the first band: never stopped, nothing more to read
            return None
        found = store.band_values(self.sweep_id, self.metric, wanted)
        return _stop(self.config, self.goal, found, own, self.run_id)


def judge_for(spec: SweepSpec, sweep_id: str, run_id: str, *, exempt: bool) -> Judge | None:
    """The judge of run ``run_id``; None when its sweep has no early termination or the user
    resumed the run after a stop (``exempt``)."""
    if spec.raw.get("early_terminate") is None or exempt:
        return None
    return Judge(spec, sweep_id, run_id)


def said(stop: Stop, metric: str, attempt: int) -> None:
    logger.warning(
        "preemptible: run %s attempt %d: early termination (hyperband) stops it: %s; it "
        "saves a checkpoint and ends STOPPED (preemptible sweep resume --run %s continues it)",
        stop.run_id,
        attempt,
        stop.describe(metric),
        stop.run_id,
    )


def early_ending(ending: str, stopped: Stop | None, *, expired: bool) -> str:
    """An attempt's ending once the judge may have stopped it: the stop's PREEMPTED (a script
    without a stop handler that dies of the signal, or is killed after the term timeout, is
    PREEMPTED too), or a crash while it stopped, is STOPPED; a run that FINISHED anyway, or
    failed with its own exit code, is what it is; one stopped for this agent's lease meanwhile
    goes back to the queue as preempted."""
    if stopped is None or expired:
        return ending
    if ending in (Ending.PREEMPTED, Ending.KILLED, Ending.CRASHED):
        return Ending.STOPPED
    return ending
