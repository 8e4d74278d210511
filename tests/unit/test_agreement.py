"""The multi-rank stop agreement, with ranks as threads over one in-memory store.

A "step" is either a barrier of every rank (a collective: ranks in lockstep) or a sleep of its
own (no collective: ranks drift apart). A rank that stops alone, or passes the agreed step,
leaves the others in a barrier that times out: a broken agreement fails the test, it never
hangs it.
"""

from __future__ import annotations

import datetime
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from preemptible._errors import ConfigError
from preemptible.distributed._agreement import StopAgreement
from preemptible.distributed._group import AgreementError, default_store, fallback_store
from preemptible.stop._controller import Decision
from preemptible.stop._termination import Notice
from tests.support.reference import free_port

pytestmark = pytest.mark.timeout(60)

POLL = 0.005


@dataclass
class Rank:
    """One simulated rank: what it asks for (from which boundary) and what it did."""

    rank: int
    ask: dict[int, Decision] = field(default_factory=dict)  # boundary -> sticky local decision
    ask_when: threading.Event | None = None  # or: STOP from the first boundary after this is set
    acted: list[tuple[str, int]] = field(default_factory=list)
    notice: Notice | None = None
    error: BaseException | None = None


def local_decision(r: Rank, b: int, insured: set[int]) -> Decision:
    if r.ask_when is not None and r.ask_when.is_set():
        return Decision.STOP
    wanted = Decision.CONTINUE
    for at, d in sorted(r.ask.items()):
        if at <= b:
            wanted = d
    if wanted is Decision.INSURANCE and insured:
        return Decision.CONTINUE  # like the controller: one insurance per notice
    return wanted


def train(
    ag: StopAgreement,
    r: Rank,
    steps: int,
    step: Callable[[int], None],
) -> None:
    insured: set[int] = set()
    try:
        for b in range(steps):
            assert ag.boundary == b
            while True:
                local = local_decision(r, b, insured)
                if local is Decision.CONTINUE and ag.quiet():
                    break
                agreed = ag.decide(local, Notice(source=f"rank{r.rank}", signum=r.rank + 1))
                if agreed.decision is Decision.INSURANCE:
                    r.acted.append(("insurance", b))
                    insured.add(b)
                    continue
                if agreed.decision is Decision.STOP:
                    r.acted.append(("stop", b))
                    r.notice = agreed.notice
                    return
                break
            step(b)
        r.acted.append(("end", steps))
    except BaseException as exc:
        r.error = exc


def run_ranks(
    ranks: list[Rank],
    steps: int,
    *,
    lockstep: bool = True,
    pace: Callable[[int, int], float] | None = None,
    store: Any = None,
    timeout: float = 20.0,
) -> list[Rank]:
    world = len(ranks)
    store = store if store is not None else dist.HashStore()
    barrier = threading.Barrier(world, timeout=timeout)
    ags = [StopAgreement(store, r.rank, world, poll_interval=POLL, timeout=timeout) for r in ranks]

    def stepper(rank: int) -> Callable[[int], None]:
        def step(b: int) -> None:
            if pace is not None:
                time.sleep(pace(rank, b))
            if lockstep:
                barrier.wait()

        return step

    threads = [
        threading.Thread(target=train, args=(ags[i], r, steps, stepper(i)), daemon=True)
        for i, r in enumerate(ranks)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    for ag in ags:
        ag.close()
    for r in ranks:
        if r.error is not None:
            raise AssertionError(f"rank {r.rank} failed: {r.error!r}") from r.error
    return ranks


def stops(ranks: list[Rank]) -> set[int]:
    return {b for r in ranks for kind, b in r.acted if kind == "stop"}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_a_stop_on_one_rank_stops_every_rank_at_one_boundary(world: int, seed: int) -> None:
    rng = random.Random(seed)
    asker = rng.randrange(world)
    at = rng.randrange(3, 30)
    ranks = [Rank(i) for i in range(world)]
    ranks[asker].ask = {at: Decision.STOP}
    run_ranks(ranks, 200, pace=lambda rank, b: rng.random() * 0.002)
    [stop] = stops(ranks)
    assert all(r.acted == [("stop", stop)] for r in ranks), [r.acted for r in ranks]
    assert at <= stop <= at + 2  # lockstep: the last rank to hear of it is at most a step behind
    assert {r.notice.exit_code for r in ranks if r.notice} == {128 + asker + 1}


def test_stops_on_every_rank_at_once_agree_on_one_signal() -> None:
    ranks = [Rank(i, ask={5: Decision.STOP}) for i in range(4)]
    run_ranks(ranks, 100)
    [stop] = stops(ranks)
    assert stop == 5  # every rank asked at 5, none had passed it
    codes = {r.notice.exit_code for r in ranks if r.notice}
    assert len(codes) == 1 and codes <= {129, 130, 131, 132}, codes


def test_ranks_far_apart_without_collectives_still_stop_at_one_boundary() -> None:
    """No collective per step: the fast rank runs ahead, the slow one is told to stop."""
    went = threading.Event()
    ranks = [Rank(0), Rank(1, ask_when=went)]

    def pace(rank: int, b: int) -> float:
        if rank == 1 and b == 5:
            went.set()
        return 0.0005 if rank == 0 else 0.005

    run_ranks(ranks, 100_000, lockstep=False, pace=pace)
    [stop] = stops(ranks)
    assert stop > 10, stop  # the fast rank was far ahead: the slow one catches up to it
    assert all(r.acted == [("stop", stop)] for r in ranks)


def test_a_grace_window_gives_one_insurance_and_one_stop_at_the_same_boundaries() -> None:
    ranks = [Rank(i) for i in range(3)]
    ranks[2].ask = {4: Decision.INSURANCE, 12: Decision.STOP}
    run_ranks(ranks, 100, pace=lambda rank, b: 0.001 * rank)
    acted = {tuple(r.acted) for r in ranks}
    assert len(acted) == 1, acted
    [(first, at), (second, stop)] = acted.pop()
    assert (first, second) == ("insurance", "stop")
    assert 4 <= at <= 6 and 12 <= stop <= 14


def test_an_insurance_and_a_stop_at_one_boundary_run_in_order() -> None:
    """Rank 0 insures at 3 and must stop at once after: the save, then the stop, same place."""
    ranks = [Rank(0, ask={3: Decision.INSURANCE, 4: Decision.STOP}), Rank(1)]
    run_ranks(ranks, 50)
    [acted] = {tuple(r.acted) for r in ranks}
    assert [kind for kind, _ in acted] == ["insurance", "stop"]


class CountingStore:
    """A store that counts the calls each thread makes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.inner, name)

        def call(*args: Any) -> Any:
            who = threading.current_thread().name
            self.calls[who] = self.calls.get(who, 0) + 1
            return fn(*args)

        return call


def test_a_quiet_boundary_makes_no_store_call_in_the_training_thread() -> None:
    store = CountingStore(dist.HashStore())
    ag = StopAgreement(store, 0, 2, poll_interval=POLL)
    try:
        batches = []  # the best of several: a loaded machine preempts a batch, not the code
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(20_000):
                assert ag.quiet()
            batches.append((time.perf_counter() - started) / 20_000)
        per_boundary = min(batches)
    finally:
        ag.close()
    assert threading.current_thread().name not in store.calls
    assert store.calls.get("preemptible-agree", 0) > 0  # the poller did the looking
    assert per_boundary < 20e-6, per_boundary  # a few attribute accesses, not a round trip


def test_handlers_in_their_own_namespaces_do_not_see_each_others_stops() -> None:
    base = dist.HashStore()
    a0 = StopAgreement(dist.PrefixStore("preemptible/0/", base), 0, 1, poll_interval=POLL)
    b1 = StopAgreement(dist.PrefixStore("preemptible/1/", base), 1, 2, poll_interval=POLL)
    try:
        assert a0.decide(Decision.STOP).decision is Decision.STOP  # a world of one: at once
        time.sleep(0.1)  # several poll intervals: a poller that could see it would have
        assert not b1.pending
        assert b1.quiet()
    finally:
        a0.close()
        b1.close()


def test_a_rank_that_never_answers_fails_the_wait_with_one_clear_error() -> None:
    ag = StopAgreement(dist.HashStore(), 0, 2, poll_interval=POLL, timeout=0.3)
    try:
        with pytest.raises(AgreementError, match=r"waited 0.3 s for every rank to acknowledge"):
            ag.decide(Decision.STOP, Notice(source="SIGTERM", signum=15))
    finally:
        ag.close()


def test_the_notice_of_the_agreed_stop_carries_the_first_signal() -> None:
    ranks = [Rank(0, ask={2: Decision.STOP}), Rank(1)]
    run_ranks(ranks, 20)
    for r in ranks:
        assert r.notice is not None
        assert r.notice.signum == 1 and r.notice.exit_code == 129
        assert "rank 0" in r.notice.detail


# -- the store: torch's accessors (canary) and the fallback -------------------------------------


@pytest.fixture
def one_rank_group(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_canary_torch_still_gives_the_default_store_where_preemptible_looks(
    one_rank_group: None,
) -> None:
    """If this fails, torch moved the store (the pin is 2.13.0): fix default_store() first."""
    from torch.distributed import distributed_c10d

    group_store = dist.group.WORLD.get_group_store()
    private = distributed_c10d._get_default_store()
    group_store.set("canary", "1")
    assert bytes(private.get("canary")) == b"1"
    assert bytes(default_store().get("canary")) == b"1"


def test_without_either_accessor_the_ranks_meet_in_a_store_of_their_own(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed import distributed_c10d

    monkeypatch.delattr(type(dist.group.WORLD), "get_group_store")
    monkeypatch.delattr(distributed_c10d, "_get_default_store")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port() - 1))
    store = default_store()
    store.set("k", "v")
    assert bytes(store.get("k")) == b"v"


def test_the_fallback_store_is_shared_by_the_ranks() -> None:
    port = free_port()
    stores: dict[int, Any] = {}

    def make(rank: int) -> None:
        stores[rank] = fallback_store(rank, 2, host="127.0.0.1", port=port, timeout=10)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    stores[1].set("from-1", "x")
    assert bytes(stores[0].get("from-1")) == b"x"
    assert stores[0].wait(["from-1"], datetime.timedelta(seconds=1)) is None


@pytest.mark.parametrize("port", ["", "http", "65535"])
def test_a_bad_master_port_is_one_clear_line(port: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    with pytest.raises(ConfigError, match=r"^MASTER_PORT='.*' is not valid; .*below 65535$"):
        fallback_store(0, 2)


def test_a_periodic_save_asked_for_by_rank_zero_is_known_as_periodic_on_every_rank() -> None:
    """Only rank 0 knows its clock said "save"; every rank must know the agreed checkpoint is
    that periodic one (it may go to the background), not a grace window's insurance."""
    store = dist.HashStore()
    ags = [StopAgreement(store, r, 2, poll_interval=POLL, timeout=10) for r in range(2)]
    got: dict[int, tuple[bool, int]] = {}

    def rank(r: int) -> None:
        for b in range(5000):
            asks = r == 0 and b == 2
            local = Decision.INSURANCE if asks else Decision.CONTINUE
            if not asks and ags[r].quiet():
                time.sleep(0.001)
                continue
            agreed = ags[r].decide(local, periodic=asks)
            if agreed.decision is Decision.INSURANCE:
                got[r] = (agreed.periodic, b)
                return

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    finally:
        for ag in ags:
            ag.close()
    assert got[0] == got[1] and got[0][0] is True, got
