"""The savers of several ranks: rank 0's full state, and sharded checkpoints.

Full state (``RankZeroSaver``): at the agreed step every rank puts its RNG states in the store,
rank 0 writes one ``step-N.ckpt`` with all of them (and its own state: under DDP the model and
optimizer are the same on every rank) and announces the result; the others wait for it, which
is the one barrier of a save. In the background rank 0 alone writes, from a snapshot taken at
the boundary.

Sharded (``ShardedSaver``, ``sharded=True`` or DTensor parameters such as FSDP2): every rank
writes its shards with ``torch.distributed.checkpoint`` into one temporary directory chosen by
rank 0, which adds the small state and commits the directory once every rank has written. In
the background DCP's ``async_save`` writes the same directory, and the "written" and "done"
messages go through the store from the ranks' background threads, so that every rank ends a
background save with the same checkpoint or the same failure.

A resume is the same for both: rank 0 finds the newest checkpoint that loads, every rank
restores it with its own random states (a sharded one through DCP, together).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._errors import CheckpointLoadError, ConfigError
from ..checkpoint._async import AsyncSaver
from ..checkpoint._payload import (
    StateSpec,
    apply_payload,
    build_payload,
    capture_rng,
    read_payload,
    write_payload,
)
from ..checkpoint._savers import BaseSaver, Saved, absorb_background, resume_hint
from ..checkpoint._store import Checkpoint, CheckpointStore
from ._group import (
    Ranks,
    dist_timeout,
    hear_written,
    pack,
    remote_error,
    run_on_zero,
    save_failed,
    unpack,
)
from ._sharded import (
    META_NAME,
    BackgroundShards,
    Subset,
    check_sharded,
    read_rank_rng,
    read_shards,
    split_sharded,
    write_rank_rng,
    write_shards,
)

logger = logging.getLogger("preemptible")


class _RanksSaver(BaseSaver):
    """What both multi-rank savers share: the state, the resume, the background writer."""

    def __init__(
        self,
        store: CheckpointStore,
        state: StateSpec,
        *,
        save_fn: Callable[[Path], None] | None = None,
        weights_only: bool = True,
        background: bool = False,
        policy: str = "wait",
    ) -> None:
        super().__init__(store)
        self.state = state
        self.save_fn = save_fn
        self.weights_only = weights_only
        self.background = background
        self.async_saver = AsyncSaver(store, policy=policy) if background else None

    @property
    def rank(self) -> int:
        return self.ranks.rank if self.ranks is not None else 0

    @property
    def write_seconds(self) -> float | None:
        return None if self.async_saver is None else self.async_saver.write_seconds

    def absorb(self) -> None:
        absorb_background(self, self.async_saver)

    def wait(self) -> None:
        if self.async_saver is not None:
            self.async_saver.wait()

    def close(self) -> None:
        if self.async_saver is not None:
            self.async_saver.close()

    def big_and_small(self) -> dict[str, Any]:
        """The modules and optimizers (what DCP writes) of the state as it is now."""
        objects, _plain = self.state.split()
        big, _small = split_sharded(objects)
        return big

    def resume(self, hint: Path | None) -> Saved | None:
        """Rank 0 finds the newest checkpoint that loads; every rank restores it, each with its
        own random states (a sharded one through torch.distributed.checkpoint, together)."""
        ranks = self.ranks
        peeked: dict[str, Any] | None = None  # rank 0 reads the newest one only once
        extra = resume_hint(hint)

        def find() -> dict[str, Any]:
            nonlocal peeked
            newest: Checkpoint | None
            if self.save_fn is not None:
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
            fields = run_on_zero(ranks, ranks.next_key("resume"), "rank 0 to resume", find)
            if "error" in fields:
                raise CheckpointLoadError(
                    f"rank 0 could not resume: {fields['error']}", self.store.directory
                )
        if fields.get("path") is None:
            return None
        path = self.store.directory / str(fields["path"])
        if self.save_fn is not None:
            self.last = (int(fields["step"]), path)
            return self.last
        try:
            payload = peeked if peeked is not None else self._peek(path)
        except Exception as exc:
            raise CheckpointLoadError(
                f"rank {self.rank} cannot read {path}, which rank 0 resumes from ({exc}); every "
                "rank must see the checkpoint directory (a shared file system)",
                path,
            ) from exc
        if path.is_dir():
            big = self.big_and_small()
            read_shards(big, path)
            payload = dict(payload, rng=read_rank_rng(path, self.rank))
            apply_payload(payload, Subset(self.state.mapping, set(big)), path)
        else:
            apply_payload(own_rng(payload, self.rank, path), self.state, path)
        self.last = (payload["step"], path)
        return self.last

    def _peek(self, path: Path) -> dict[str, Any]:
        """A checkpoint's payload: the whole file, or a sharded directory's small part."""
        if path.is_dir():
            check_sharded(path)
            return read_payload(path / META_NAME, weights_only=self.weights_only)
        return read_payload(path, weights_only=self.weights_only)


class RankZeroSaver(_RanksSaver):
    """Rank 0 writes the state with every rank's random states; the others wait for its commit
    (or, with ``save_fn``, rank 0's ``save_fn`` writes the checkpoint)."""

    def attach(self, ranks: Ranks | None) -> None:
        if ranks is None:
            raise ConfigError("RankZeroSaver needs torch.distributed with more than one rank")
        super().attach(ranks)

    def save(self, step: int, context: Any = None, *, reuse: bool = False) -> tuple[Path, bool]:
        ranks = self.ranks
        assert ranks is not None
        key = ranks.next_key("save")
        if self.save_fn is None:
            ranks.store.set(f"{key}/rng/{ranks.rank}", pack(capture_rng()))

        def write() -> dict[str, Any]:
            old = self.reused(step, reuse)
            if old is not None:
                return {"path": old.name, "written": False}
            if self.save_fn is not None:
                return {"path": self.store.save(step, self.save_fn).name, "written": True}
            rng_keys = [f"{key}/rng/{r}" for r in range(ranks.world)]
            ranks.wait_all(rng_keys, "the random states of every rank")
            rngs = [unpack(bytes(ranks.store.get(k))) for k in rng_keys]
            payload = build_payload(step, self.state)
            payload.update(rng_ranks=rngs, world_size=ranks.world)
            return {"path": self.store.save(step, lambda t: write_payload(payload, t)).name}

        fields = run_on_zero(ranks, f"{key}/done", f"rank 0 to save step {step}", write)
        path = self.store.directory / str(fields.get("path"))
        if "error" in fields:
            raise remote_error(fields, f"save step {step}", path)
        if ranks.is_zero and self.save_fn is None:
            for r in range(ranks.world):
                ranks.store.delete_key(f"{key}/rng/{r}")
        self.last = (step, path)
        return path, bool(fields.get("written", True))

    def save_in_background(self, step: int, context: Any = None) -> float | None:
        """Every rank's random states go to rank 0, which snapshots the state to host memory
        and writes it in a thread. None on the other ranks (they write nothing)."""
        ranks = self.ranks
        assert ranks is not None and self.async_saver is not None
        self.absorb()
        started = time.monotonic()
        payload = build_payload(step, self.state)
        got = ranks.gather(ranks.next_key("rng"), pack(capture_rng()), "the random states")
        if got is None:
            return None
        payload.update(rng_ranks=[unpack(b) for b in got], world_size=ranks.world)
        if not self.async_saver.save(step, payload, write_payload):  # the copy is made there
            return None
        return time.monotonic() - started


class ShardedSaver(_RanksSaver):
    """Every rank writes its shards into one directory that rank 0 commits (with or without a
    process group: one process writes them through DCP alone)."""

    def __init__(self, store: CheckpointStore, state: StateSpec, **options: Any) -> None:
        super().__init__(store, state, **options)
        self.shards: BackgroundShards | None = None

    def attach(self, ranks: Ranks | None) -> None:
        super().attach(ranks)
        if self.background:  # a collective (a gloo group): every rank attaches in order
            self.shards = BackgroundShards(dist_timeout())

    def close(self) -> None:
        super().close()
        if self.shards is not None:
            self.shards.close()
            self.shards = None

    def meta(self, step: int, big: Mapping[str, Any]) -> dict[str, Any]:
        """The small part of a sharded checkpoint (rank 0 writes it): everything but the
        modules and optimizers, the step, and what was sharded."""
        world = self.ranks.world if self.ranks is not None else 1
        meta = build_payload(step, Subset(self.state.mapping, set(big)))
        meta.update(sharded=sorted(big), world_size=world)
        return meta

    def save(self, step: int, context: Any = None, *, reuse: bool = False) -> tuple[Path, bool]:
        """Every rank writes its shards into rank 0's temporary directory; rank 0 adds the
        small state and commits the directory once every rank has written."""
        ranks = self.ranks
        rank = self.rank
        big = self.big_and_small()
        key = ranks.next_key("save") if ranks is not None else "save"
        rng = capture_rng()

        def write(tmp: Path) -> None:
            if ranks is not None:
                ranks.announce(f"{key}/tmp", {"name": tmp.name})
            write_shards(big, tmp, rank, rng)
            if ranks is not None:
                hear_written(ranks, key, tmp)
            write_payload(self.meta(step, big), tmp / META_NAME)

        if ranks is None:
            old = self.reused(step, reuse)
            if old is not None:
                return old, False
            path = self.store.save(step, write)
            self.last = (step, path)
            return path, True
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
            old = self.reused(step, reuse)
            if old is not None:
                return {"path": old.name, "written": False}
            return {"path": self.store.save(step, write).name}

        fields = run_on_zero(ranks, f"{key}/done", f"rank 0 to commit step {step}", commit)
        path = self.store.directory / str(fields.get("path"))
        if "error" in fields:
            raise remote_error(fields, f"save step {step}", path)
        self.last = (step, path)
        return path, bool(fields.get("written", True))

    def save_in_background(self, step: int, context: Any = None) -> float | None:
        """A sharded checkpoint written in the background. Rank 0 decides whether this save
        point is taken (policy "skip" with a save in flight) and names the temporary directory;
        every rank then snapshots its shards (DCP's async_save) and goes on. In the background
        each rank waits for its shards to be written and adds its random states; rank 0 then
        waits for every rank's, adds the small state and commits, and tells the others."""
        assert self.async_saver is not None and self.shards is not None
        self.absorb()
        started = time.monotonic()
        ranks, rank = self.ranks, self.rank
        big = self.big_and_small()
        key = ranks.next_key("save") if ranks is not None else "save"
        # Rank 0 announces at once (the others wait for it on their training threads); every
        # rank then waits for its own write in flight, whose end does not need any training
        # thread, before the copy overwrites the staging buffers that write reads.
        if ranks is None or ranks.is_zero:
            go: dict[str, Any] = {"skip": True}
            if not self.async_saver.skips(step):
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
            return None
        self.async_saver.wait()
        self.absorb()
        tmp = self.store.directory / str(go["tmp"])
        meta: dict[str, Any] | None = None
        shards: Any = None
        failed: BaseException | None = None
        try:
            rng = capture_rng()
            if rank == 0:
                meta = self.async_saver.snapshot.copy(self.meta(step, big))
            shards = self.shards.start(big, tmp)  # the copy to host memory is made in there
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

        self.async_saver.start(step, commit if rank == 0 else written)
        return time.monotonic() - started


def own_rng(payload: Mapping[str, Any], rank: int, path: Path) -> dict[str, Any]:
    """The payload with this rank's RNG states in ``rng`` (what ``apply_payload`` restores).

    A checkpoint of fewer ranks leaves the extra ranks' streams as they are (warned); one
    written without a process group gives every rank its single set of states."""
    ranks = payload.get("rng_ranks")
    out = dict(payload)
    if isinstance(ranks, list):
        if rank < len(ranks):
            out["rng"] = ranks[rank]
        else:
            out["rng"] = {}
            logger.warning(
                "preemptible: %s holds random states for %d ranks; rank %d keeps its own",
                path,
                len(ranks),
                rank,
            )
    return out
