"""Time wasted by periodic saves and interruptions: fixed intervals, "auto", Daly's optimum.

A training run of ``--days`` of work is interrupted at random: the uptimes between
interruptions are exponential with mean MTBF. An interruption loses the work since the last
committed checkpoint (a save in progress does not commit), then the restart costs R = 60 s +
the save cost (starting the process, loading the checkpoint). Each save stalls training for
C x U(0.8, 1.2). Steps take a fixed time. Every policy sees the same interruptions and save
costs (common random numbers); the waste is wall time - work, in % of the work, averaged
over ``--seeds`` runs.

  every N steps    a save after every N steps (N = 100, 1000, 10000)
  auto x4 / auto /4  preemptible's ``SaveInterval``, created afresh in each attempt as a new
                   process would, knowing only what the handler knows: the earlier attempts
                   (uptime, how they ended, the save cost the last one measured), the saves it
                   measures itself, and a prior MTBF 4x too long / 4x too short
  Daly             Daly's interval with the true MTBF and the mean save cost (the optimum)

Table 2 (``--notices``): EC2-like, 2-minute notices for 70 % of the interruptions. An announced
interruption whose save fits the window (1.25 C + 5 s < 120 s) loses only the last 1.25 C + 5 s
of training; one that does not fit, and every unannounced one, loses all since the last save.
"auto" uses the EC2 prior (10 % unannounced, so 3x off) and learns the share from the history.

    .venv/bin/python benchmarks/bench_interval.py [--days 30] [--seeds 10]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from _common import machine, table

from preemptible.checkpoint._interval import HOUR, History, SaveInterval, daly_interval

RESTART = 60.0
JITTER = 0.2
NOTICE_SAFETY, EXIT_MARGIN = 1.25, 5.0


@dataclass(frozen=True)
class World:
    mtbf: float
    save: float
    step: float
    announced: float = 0.0  # share of interruptions that come with a notice
    window: float = 120.0


@dataclass
class Past:
    """What the journal and the run records of the earlier attempts hold."""

    uptime: float = 0.0
    interruptions: int = 0
    losses: int = 0
    attempts: int = 0
    save: float | None = None


class Fixed:
    def __init__(self, steps: int) -> None:
        self.steps = steps

    def start(self, past: Past, clock: Clock, world: World) -> None:
        pass

    def next_steps(self) -> int:
        return self.steps

    def saved(self, cost: float) -> None:
        pass


class Daly(Fixed):
    def __init__(self, world: World) -> None:
        lossy = world.mtbf / (1 - world.announced) if world.announced < 1 else math.inf
        if NOTICE_SAFETY * world.save + EXIT_MARGIN >= world.window:
            lossy = world.mtbf  # the notices are too short for a save
        super().__init__(max(1, round(daly_interval(world.save, lossy) / world.step)))


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Auto:
    prior_factor: float
    platform: str = "local"
    step: float = 1.0
    interval: SaveInterval | None = field(default=None, repr=False)

    def start(self, past: Past, clock: Clock, world: World) -> None:
        history = History(
            past.uptime, past.interruptions, past.losses, past.attempts, save_cost=past.save
        )
        self.step = world.step
        self.interval = SaveInterval(
            platform=self.platform,
            prior_mtbf=world.mtbf * self.prior_factor,
            notice_window=world.window if world.announced else None,
            history=history,
            clock=clock,
        )

    def next_steps(self) -> int:
        assert self.interval is not None
        return max(1, math.ceil(self.interval.seconds() / self.step - 1e-9))

    def saved(self, cost: float) -> None:
        assert self.interval is not None
        self.interval.observe_save(cost)


def simulate(policy: Fixed | Auto, world: World, work: float, seed: int) -> float:
    """Seconds of wall time beyond ``work``."""
    interruptions, costs = random.Random(seed), random.Random(seed + 1_000_003)
    done = wall = 0.0
    past = Past()
    clock = Clock()
    while True:
        limit = interruptions.expovariate(1 / world.mtbf)  # uptime of this attempt
        announced = interruptions.random() < world.announced
        final = world.save * costs.uniform(1 - JITTER, 1 + JITTER)
        clock.now = 0.0
        policy.start(past, clock, world)
        committed_at = 0.0  # uptime when the last checkpoint was committed
        trained = 0.0  # training since then
        measured: list[float] = []
        while True:
            chunk = min(policy.next_steps() * world.step, work - done)
            if clock.now + chunk >= limit:
                trained += limit - clock.now
                break
            clock.now += chunk
            trained = chunk
            if done + chunk >= work - 1e-9:
                return wall + clock.now - work
            cost = world.save * costs.uniform(1 - JITTER, 1 + JITTER)
            if clock.now + cost > limit:
                break
            clock.now += cost
            done += chunk
            committed_at, trained = clock.now, 0.0
            measured.append(cost)
            policy.saved(cost)
        margin = NOTICE_SAFETY * final + EXIT_MARGIN
        covered = announced and margin < world.window
        if covered:  # the handler trained on and saved inside the notice window
            done += max(0.0, min(trained, limit - margin - committed_at))
        wall += limit + RESTART + world.save
        past.uptime += limit
        past.interruptions += 1
        past.losses += not covered
        past.attempts += 1
        if measured:
            past.save = statistics.median(measured[-5:])


Policies = dict[str, Callable[[World], "Fixed | Auto"]]


def run_grid(
    worlds: list[World], policies: Policies, days: float, seeds: int
) -> list[tuple[World, dict[str, float]]]:
    rows = []
    for world in worlds:
        wasted: dict[str, float] = {}
        for name, make in policies.items():
            total = 0.0
            for seed in range(seeds):
                policy = make(world)
                total += simulate(policy, world, days * 24 * HOUR, seed)
            wasted[name] = 100 * total / seeds / (days * 24 * HOUR)
        rows.append((world, wasted))
    return rows


def fmt_time(seconds: float) -> str:
    return f"{seconds / HOUR:g} h" if seconds >= HOUR else f"{seconds:g} s"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--days", type=float, default=30.0, help="days of work per run")
    p.add_argument("--seeds", type=int, default=10)
    args = p.parse_args()
    for name in ("PREEMPTIBLE_MTBF", "PREEMPTIBLE_GRACE_PERIOD", "PREEMPTIBLE_RUN_DIR"):
        os.environ.pop(name, None)  # the simulation gives SaveInterval everything itself
    started = time.monotonic()

    policies: Policies = {
        "every 100": lambda w: Fixed(100),
        "every 1000": lambda w: Fixed(1000),
        "every 10000": lambda w: Fixed(10000),
        "auto x4": lambda w: Auto(4.0),
        "auto /4": lambda w: Auto(0.25),
        "Daly": Daly,
    }
    worlds = [
        World(mtbf, save, step)
        for mtbf in (HOUR, 6 * HOUR, 24 * HOUR)
        for save in (1.0, 10.0, 60.0)
        for step in (0.2, 2.0)
    ]
    rows = []
    worst = 0.0
    for world, wasted in run_grid(worlds, policies, args.days, args.seeds):
        ratio = max(wasted["auto x4"], wasted["auto /4"]) / wasted["Daly"]
        worst = max(worst, ratio)
        rows.append(
            [fmt_time(world.mtbf), fmt_time(world.save), fmt_time(world.step)]
            + [f"{wasted[name]:.2f} %" for name in policies]
            + [f"{ratio:.3f}"]
        )
    header = ["MTBF", "save", "step", *policies, "auto/Daly (worse)"]
    print(f"Wasted time in % of the work ({args.days:g} days of work, {args.seeds} seeds)\n")
    print(table(header, rows))
    print(f"\nworst auto/Daly: {worst:.3f}\n")

    notice_policies: Policies = {
        "every 1000": lambda w: Fixed(1000),
        "Daly, notices ignored": lambda w: Daly(World(w.mtbf, w.save, w.step)),
        "auto (ec2 prior x4)": lambda w: Auto(4.0, platform="ec2"),
        "auto (ec2 prior /4)": lambda w: Auto(0.25, platform="ec2"),
        "Daly": Daly,
    }
    worlds = [World(6 * HOUR, save, 1.0, announced=0.7) for save in (10.0, 60.0, 100.0)]
    rows = []
    for world, wasted in run_grid(worlds, notice_policies, args.days, args.seeds):
        ratio = max(wasted["auto (ec2 prior x4)"], wasted["auto (ec2 prior /4)"]) / wasted["Daly"]
        rows.append(
            [fmt_time(world.save)]
            + [f"{wasted[name]:.2f} %" for name in notice_policies]
            + [f"{ratio:.3f}"]
        )
    print("MTBF 6 h, 70 % announced with 120 s notices, 1 s steps\n")
    print(table(["save", *notice_policies, "auto/Daly (worse)"], rows))
    print(f"\n{machine()}; {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
