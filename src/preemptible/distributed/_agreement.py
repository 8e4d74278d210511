"""Every rank stops (or takes an insurance checkpoint) at the same step, without a collective.

The rank that learns of a stop *proposes a round* in the process group's key-value store, and a
daemon thread on every rank polls the store for it. While nothing is pending, a step boundary
costs two attribute writes and two truth tests.

Rounds are numbered; round ``n`` is a key whose value (the first writer wins, ``compare_set``)
says what it is: an insurance checkpoint or a stop (with the signal or notice that started
it). Every rank acknowledges round ``n`` with the first boundary at which it can still act,
and all act at the same boundary: the maximum of the acknowledgements. The poller acknowledges
for its rank even while the training thread is blocked in a collective, so waiting for the
acknowledgements never deadlocks, however far the ranks are apart (ranks that do a collective
every step are at most one step apart; ranks that accumulate gradients without one may be
further). The training thread publishes where it is in one integer, ``2 * boundary`` on
arriving and ``2 * boundary + 1`` once past it, and reads the flag after each write; the poller
sets the flag and then reads the integer (Dekker's order), so an acknowledgement never claims a
boundary the rank has already passed.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._env import env_float
from .._errors import AgreementError
from ..stop._controller import Decision
from ..stop._signals import signal_name
from ..stop._termination import Notice
from ._group import DEFAULT_POLL, DEFAULT_TIMEOUT, Ranks

logger = logging.getLogger("preemptible")
# -- the agreement -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Agreed:
    """What every rank does at this boundary; ``notice`` is the stop's (for STOP);
    ``periodic``: an INSURANCE that is rank 0's periodic save (it may be written in the
    background), not a checkpoint a grace window asked for."""

    decision: Decision
    notice: Notice | None = None
    periodic: bool = False


CONTINUE = Agreed(Decision.CONTINUE)


def dist_poll() -> float:
    """``PREEMPTIBLE_DIST_POLL``: seconds between two looks of the poller at the store."""
    poll = env_float("PREEMPTIBLE_DIST_POLL", DEFAULT_POLL, strict_min=True)
    assert poll is not None
    return poll


def agreement_of(ranks: Ranks) -> StopAgreement:
    """The stop agreement of ``ranks`` (``PREEMPTIBLE_DIST_POLL``: seconds between two looks of
    its poller at the store)."""
    return StopAgreement(
        ranks.store, ranks.rank, ranks.world, poll_interval=dist_poll(), timeout=ranks.timeout
    )


class StopAgreement:
    """All ranks act on a stop or an insurance checkpoint at the same boundary.

    Front ends call ``quiet()`` at every boundary (True: nothing pending anywhere, this rank
    passes it) and ``decide()`` when it is False or when the rank itself has something to ask
    for. ``decide()`` returns what to do here; after INSURANCE (the save is done) the front end
    calls it again at the same boundary. The store only needs ``set``, ``get``, ``check``,
    ``compare_set`` and ``delete_key`` (any c10d store; a HashStore in the unit tests).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        *,
        poll_interval: float = DEFAULT_POLL,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.ranks = Ranks(rank, world, store, timeout)
        self.rank, self.world = rank, world
        self._store = store
        self._poll_interval = poll_interval
        self._flag = False  # a round is open here: the one thing the fast path reads
        self._boundary = 0  # boundaries passed so far
        self._pos = 0  # 2 * boundary on arriving, + 1 once past it
        self._round = 0  # the round this rank acts on next
        self._acked = 0  # rounds 0 .. _acked - 1 are acknowledged by this rank
        self._own_ack: dict[int, int] = {}
        self._kind: dict[str, Any] | None = None  # round _round, once known
        self._act_at: int | None = None  # its boundary, once every rank acknowledged
        self._stopped = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="preemptible-agree", daemon=True)
        self._thread.start()

    @property
    def boundary(self) -> int:
        """Boundaries passed so far (one per ``quiet()``/``decide()`` that let the rank on)."""
        return self._boundary

    @property
    def pending(self) -> bool:
        return self._flag

    def close(self) -> None:
        self._done.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._poll_interval + 1)

    def open_stop(self) -> Notice | None:
        """The stop some rank proposed and this one has not acted on (None if none): for a
        front end whose ranks meet once more after their last boundary (the end of a fit)."""
        with self._lock:
            n = self._round
            while True:
                key = _round_key(n)
                if not self._store.check([key]):
                    return None
                kind = _parse_kind(self._store.get(key))
                if kind.get("kind") == "stop":
                    return _notice_of(kind)
                n += 1

    def at_end(self, mine: Notice | None) -> Notice | None:
        """Every rank at the end of training, after its last boundary: the stop any rank was
        asked for, the same on every rank (the largest signal, so all exit alike), or None.
        The ranks meet in the store once; no collective."""
        first = mine if mine is not None else self.open_stop()
        signum = (first.signum or signal.SIGTERM) if first is not None else 0
        self._store.set(f"end/{self.rank}", str(int(signum)))
        keys = [f"end/{r}" for r in range(self.world)]
        self.ranks.wait_all(keys, "every rank to reach the end of training")
        agreed = max(int(bytes(self._store.get(k))) for k in keys)
        if not agreed:
            return None
        if first is not None and (first.signum or signal.SIGTERM) == agreed:
            return first
        return Notice(source=signal_name(agreed), signum=agreed, detail="another rank was told")

    # -- the fast path ---------------------------------------------------------------------
    def quiet(self) -> bool:
        """At a boundary: True when no round is open (this rank passes the boundary)."""
        b = self._boundary
        self._pos = 2 * b
        if self._flag:
            return False
        self._pos = 2 * b + 1
        if self._flag:  # the poller saw a round between the two reads: stay at b
            self._pos = 2 * b
            return False
        self._boundary = b + 1
        return True

    # -- the slow path ---------------------------------------------------------------------
    def decide(
        self, local: Decision, notice: Notice | None = None, *, periodic: bool = False
    ) -> Agreed:
        """What every rank does at this boundary. ``local``: what this rank's own requests
        ask for (its controller's decision); ``notice``: its stop request, for the others;
        ``periodic``: its INSURANCE is a periodic save."""
        with self._lock:
            if self._stopped:
                raise AgreementError("this rank already stopped; the agreement is over")
            b = self._boundary
            self._pos = 2 * b
            kind = self._open_round(local, notice, periodic)
            if kind is None:
                return self._pass(b)
            n = self._round
            if self._acked <= n:
                self._ack(n, b)
            if self._act_at is None and b >= self._own_ack[n]:
                self._act_at = self._agreed_boundary(n)
            if self._act_at is None or self._act_at > b:
                return self._pass(b)
            if self._act_at < b:
                raise AgreementError(
                    f"rank {self.rank} is at step boundary {b}, past the agreed {self._act_at}"
                )
            if kind.get("kind") == "stop":
                self._stopped = True
                self._done.set()
                return Agreed(Decision.STOP, _notice_of(kind))
            self._next_round()
            return Agreed(Decision.INSURANCE, periodic=kind.get("kind") == "periodic")

    def _open_round(
        self, local: Decision, notice: Notice | None, periodic: bool
    ) -> dict[str, Any] | None:
        """The current round's kind: known, found in the store, or proposed now."""
        if self._kind is not None:
            return self._kind
        key = _round_key(self._round)
        if self._store.check([key]):
            self._kind = _parse_kind(self._store.get(key))
        elif local is not Decision.CONTINUE:
            what = "periodic" if periodic else "insurance"
            mine: dict[str, Any] = {
                "kind": "stop" if local is Decision.STOP else what,
                "rank": self.rank,
            }
            if notice is not None:
                mine.update(source=notice.source, signum=notice.signum)
            self._kind = _parse_kind(self._store.compare_set(key, "", json.dumps(mine)))
            self._flag = True
        if self._kind is not None:
            self._flag = True
        return self._kind

    def _ack(self, n: int, value: int) -> None:
        self._store.set(f"{_round_key(n)}/ack/{self.rank}", str(value))
        self._own_ack[n] = value
        self._acked = n + 1

    def _agreed_boundary(self, n: int) -> int:
        """The round's boundary: the maximum of every rank's acknowledgement (waits for them;
        each poller acknowledges on its own, so the wait ends within a poll interval or two)."""
        keys = [f"{_round_key(n)}/ack/{r}" for r in range(self.world)]
        self.ranks.wait_all(keys, f"every rank to acknowledge round {n}")
        return max(int(bytes(self._store.get(k))) for k in keys)

    def _pass(self, b: int) -> Agreed:
        self._pos = 2 * b + 1
        self._boundary = b + 1
        return CONTINUE

    def _next_round(self) -> None:
        self._round += 1
        self._kind = None
        self._act_at = None
        self._flag = self._acked > self._round  # the poller saw the next one already

    # -- the poller ------------------------------------------------------------------------
    def _poll(self) -> None:
        while not self._done.wait(self._poll_interval):
            try:
                n = self._acked
                if not self._store.check([_round_key(n)]):
                    continue
                with self._lock:
                    if self._acked != n or self._stopped:
                        continue
                    self._flag = True  # before reading the position: see the module docstring
                    pos = self._pos
                    self._ack(n, (pos + 1) // 2)
            except Exception as exc:  # the store went away: the group is being torn down
                logger.debug("preemptible: agreement poller ends: %r", exc)
                return


def _round_key(n: int) -> str:
    return f"round/{n}"


def _parse_kind(raw: Any) -> dict[str, Any]:
    try:
        value = json.loads(bytes(raw).decode())
    except (ValueError, UnicodeDecodeError):
        value = None
    if not isinstance(value, dict) or value.get("kind") not in ("stop", "insurance", "periodic"):
        raise AgreementError(f"the store holds an unknown round: {bytes(raw)[:100]!r}")
    return value


def _notice_of(kind: Mapping[str, Any]) -> Notice:
    signum = kind.get("signum")
    source = kind.get("source")
    return Notice(
        source=str(source) if source else (signal_name(signum) if signum else "stop"),
        signum=signum if isinstance(signum, int) else None,
        detail=f"agreed by all ranks; first asked for by rank {kind.get('rank')}",
    )
