"""How much of a notice window is spent training: preemptible's policy vs. a step-only formula.

An EC2-style notice gives a 120 s window. At the first step boundary after it, the handler
writes an insurance checkpoint (which measures the save time), keeps training, and writes the
final checkpoint when ``now + safety * (save + 2 * step)`` would pass the deadline. A widely
used framework instead saves when ``now > deadline - 6 * step`` (3 x 2 x mean step time) and
ignores the save time.

The policy code is preemptible's own (``StopRequests``, ``Durations``) driven by a virtual
clock: steps take ``step`` seconds with +-20 % jitter, saves take ``save`` seconds. Reported:
  training   seconds of training between the notice and the final save that were kept (0 when
             the final save did not finish before the deadline: that work is lost)
  of usable  training / (window - time spent saving): the share of the time not spent saving
             that went into training (target >= 90 %)
  slack      seconds left between the end of the final save and the deadline (< 0: too late,
             the final checkpoint is lost and the run falls back to the insurance one)

    .venv/bin/python benchmarks/bench_grace_window.py [--window 120] [--trials 200]
"""

from __future__ import annotations

import argparse
import random
import statistics

from _common import table

from preemptible import Notice
from preemptible._termination import Durations, StopRequests


def simulate(
    policy: str, window: float, step: float, save: float, rng: random.Random, safety: float = 1.25
) -> tuple[float, float, float]:
    t = 0.0
    requests = StopRequests()
    requests.add(Notice(source="ec2", received_at=0.0, deadline=window))
    steps, saves = Durations(), Durations()
    for _ in range(10):  # steps before the notice, so step times are known
        steps.add(step * rng.uniform(0.8, 1.2))
    t += step * rng.uniform(0, 1)  # the step that was running when the notice came
    saved = save * rng.uniform(0.9, 1.1)  # insurance checkpoint
    t += saved
    saves.add(saved)
    saving = saved
    training = 0.0
    while True:
        if policy == "preemptible":
            stop = requests.must_stop_now(
                now=t, save_time=saves.max(), step_time=steps.max(), safety=safety
            )
        else:
            stop = t > window - 6 * statistics.fmean(list(steps._values))
        if stop:
            break
        d = step * rng.uniform(0.8, 1.2)
        t += d
        training += d
        steps.add(d)
    final = save * rng.uniform(0.9, 1.1)
    t += final
    saving += final
    if t > window:  # killed during the final save: resumes from the insurance checkpoint
        training = 0.0
    return training, training / (window - saving), window - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--window", type=float, default=120.0)
    p.add_argument("--trials", type=int, default=200)
    args = p.parse_args()
    rows = []
    for save in (10.0, 2.0, 30.0):
        for step in (0.25, 1.0, 4.0):
            for policy in ("preemptible", "deadline - 6 x step"):
                rng = random.Random(0)
                runs = [simulate(policy, args.window, step, save, rng) for _ in range(args.trials)]
                late = sum(1 for r in runs if r[2] < 0)
                rows.append(
                    [
                        f"{save:g} s",
                        f"{step:g} s",
                        policy,
                        f"{statistics.median(r[0] for r in runs):.1f} s",
                        f"{statistics.median(r[1] for r in runs) * 100:.0f} %",
                        f"{statistics.median(r[2] for r in runs):+.1f} s",
                        f"{late}/{args.trials}",
                    ]
                )
    print(f"window {args.window:g} s (EC2 Spot), median of {args.trials} simulated notices\n")
    print(
        table(
            ["save", "step", "policy", "training", "of usable", "slack", "final save too late"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
