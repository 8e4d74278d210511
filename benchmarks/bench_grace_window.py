"""How much of a notice window is spent training, and whether the process is gone in time.

Three policies and a reference on a virtual clock, from the notice being posted (t = 0) to
the platform's deadline (the window): the process sees the notice at the watcher's next poll,
writes an insurance checkpoint at the next step boundary (which measures the save), keeps
training, then writes the final checkpoint and exits (watcher stop, acknowledgements,
interpreter and torch shutdown). It must be *gone* by the deadline.

  new               preemptible's policy (``StopRequests.must_stop_now`` with
                    ``Durations``): one more step + final save + exit, each a pessimistic
                    bound of what was measured, before the deadline less the detection latency
  old               the previous policy: ``now + 1.25 * (save + 2 * step) < deadline``
                    (longest recent save and step); exit and detection latency not counted
  6 x step          a widely used framework's: save once ``now > deadline - 6 * mean step``
  worst case known  a reference: knows how long each duration can be at most (not the
                    draws) and plans for that; no policy that can never miss keeps more

Windows: 30 s (GCE: the notice carries no time, so its deadline is counted from the moment the
watcher saw it, with a detection latency of one poll interval) and 120 s (EC2: the notice
carries the deadline). Steps, saves and the exit vary uniformly by +-``--step-jitter``,
+-``--save-jitter`` and 0.75-1.5x; before the notice the run measured 16 steps,
``--saves-before`` saves (periodic checkpoints) and one exit (a previous attempt's).

Reported per row (median over the trials unless said otherwise):
  kept         training that ended up in a checkpoint committed by the deadline, as a share of
               the usable window: window - time spent saving - exit time (target >= 90 %)
  worst slack  the smallest time left between the process being gone and the deadline, over
               all trials (new policy; < 0 is a miss)
  misses       trials in which the process was still there at the deadline

    .venv/bin/python benchmarks/bench_grace_window.py [--trials 200] [--saves-before 8]
        [--save-jitter 0.1] [--step-jitter 0.2] [--safety 1.25] [--seed 0] [--save S ...]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from _common import machine, table

from preemptible import Notice
from preemptible.stop._termination import EXIT_PRIOR_SPREAD, Durations, StopRequests

POLL = 1.0  # the watcher's poll interval (TerminationConfig's default)
EXIT = 0.4  # measured: final commit to process gone
SAFETY = 1.25  # the default safety_factor; the old formula always used 1.25
POLICIES = ("old", "new", "6 x step", "worst case known")


@dataclass
class Case:
    window: float
    gce: bool
    save: float
    step: float
    save_jitter: float
    step_jitter: float
    saves_before: int
    safety: float


@dataclass
class Outcome:
    kept: float  # share of the usable window
    slack: float  # deadline - time the process is gone


def simulate(policy: str, case: Case, rng: random.Random) -> Outcome:
    def step_time() -> float:
        return case.step * rng.uniform(1 - case.step_jitter, 1 + case.step_jitter)

    def save_time() -> float:
        return case.save * rng.uniform(1 - case.save_jitter, 1 + case.save_jitter)

    def exit_time() -> float:
        return EXIT * rng.uniform(0.75, 1.5)

    steps = Durations(values=[step_time() for _ in range(16)])
    saves = Durations(values=[save_time() for _ in range(case.saves_before)])
    exits = Durations(prior_spread=EXIT_PRIOR_SPREAD, values=[exit_time()])

    seen = rng.uniform(0, POLL)  # the first poll after the notice was posted
    if case.gce:  # deadline counted from detection; the notice may be one poll old
        notice = Notice(
            source="gce", received_at=seen, deadline=seen + case.window, detection_latency=POLL
        )
    else:
        notice = Notice(source="ec2", received_at=seen, deadline=case.window)
    requests = StopRequests()
    requests.add(notice)
    assert notice.deadline is not None
    given = notice.deadline  # what the old formulas see
    final, ex = save_time(), exit_time()
    worst = case.step * (1 + case.step_jitter) + case.save * (1 + case.save_jitter) + EXIT * 1.5

    def must_stop(t: float) -> bool:
        if policy == "new":
            return requests.must_stop_now(
                now=t, save_time=saves, step_time=steps, safety=case.safety, exit_time=exits
            )
        if policy == "old":
            return t + SAFETY * (saves.max() + 2 * steps.max()) >= given
        if policy == "6 x step":
            return t > given - 6 * steps.mean()
        return t + worst > given - notice.detection_latency  # knows the worst case

    t = seen + case.step * rng.uniform(0, 1)  # the step running at detection ends
    saving = 0.0
    covered = 0.0  # training in the newest checkpoint committed by the deadline
    saved_here = False

    def save(d: float) -> None:
        nonlocal t, saving, covered, saved_here
        trained = t - saving
        t += d
        saving += d
        saves.add(d)
        saved_here = True
        if t <= case.window:
            covered = trained

    if not must_stop(t):
        save(save_time())  # the insurance checkpoint
    while not must_stop(t):
        d = step_time()
        t += d
        steps.add(d)
        saved_here = False
    if not saved_here:
        save(final)
    t += ex
    usable = case.window - saving - ex
    return Outcome(kept=covered / usable, slack=case.window - t)


def grid(args: argparse.Namespace) -> list[Case]:
    windows = ((30.0, True, (0.5, 2.0, 10.0)), (120.0, False, (0.5, 2.0, 10.0, 30.0)))
    return [
        Case(
            window,
            gce,
            save,
            step,
            args.save_jitter,
            args.step_jitter,
            args.saves_before,
            args.safety,
        )
        for window, gce, saves in windows
        for save in saves
        if not args.save or save in args.save
        for step in (0.05, 0.25, 1.0, 4.0)
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--saves-before", type=int, default=8)
    p.add_argument("--save-jitter", type=float, default=0.1)
    p.add_argument("--step-jitter", type=float, default=0.2)
    p.add_argument("--safety", type=float, default=SAFETY, help="safety_factor of the new policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", type=float, action="append", help="only rows with this save time")
    args = p.parse_args()
    started = time.perf_counter()
    rows, short = [], []
    misses = dict.fromkeys(POLICIES, 0)
    for case in grid(args):
        kept, missed, worst = {}, {}, 0.0
        for policy in POLICIES:
            # the same measurements before the notice for each policy, whatever rows run
            rng = random.Random(f"{args.seed}/{case.window}/{case.save}/{case.step}")
            runs = [simulate(policy, case, rng) for _ in range(args.trials)]
            kept[policy] = statistics.median(o.kept for o in runs)
            missed[policy] = sum(o.slack < 0 for o in runs)
            misses[policy] += missed[policy]
            if policy == "new":
                worst = min(o.slack for o in runs)
        name = f"{case.window:g} s ({'GCE' if case.gce else 'EC2'})"
        if case.step <= 1 and kept["new"] < 0.9:
            short.append(f"{name} / {case.save:g} s / {case.step:g} s: {kept['new'] * 100:.1f} %")
        rows.append(
            [
                name,
                f"{case.save:g} s",
                f"{case.step:g} s",
                *(f"{kept[p] * 100:.0f} %" for p in POLICIES),
                f"{worst:+.2f} s",
                " / ".join(str(missed[p]) for p in POLICIES[:3]),
            ]
        )
    print(
        f"{args.trials} simulated notices per row; steps +-{args.step_jitter * 100:g} %, saves "
        f"+-{args.save_jitter * 100:g} %, exit {EXIT:g} s x 0.75-1.5; {args.saves_before} saves "
        f"measured before the notice; poll {POLL:g} s; safety {args.safety:g}; seed {args.seed}\n"
    )
    header = ["window", "save", "step", *(f"kept: {p}" for p in POLICIES)]
    header += ["worst slack: new", "misses: old / new / 6 x step"]
    print(table(header, rows))
    print(f"\nmisses in all rows: {', '.join(f'{p} {misses[p]}' for p in POLICIES[:3])}")
    print(f"rows with steps <= 1 s under 90 % (new): {'; '.join(short) or 'none'}")
    print(f"{machine()}; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
