"""ResumableDistributedSampler: a skipped-into epoch is the rest of the uninterrupted epoch.

Compared with torch's own DistributedSampler (the uninterrupted run), for every rank of 1-3
replicas, padded and dropped tails, shuffled and not, every skip; and through a DataLoader:
the batches of a resumed epoch are the uninterrupted epoch's from that batch on, and the
skipped ones are never loaded.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from preemptible import ConfigError
from preemptible.data import ResumableDistributedSampler


class Counting(Dataset[int]):
    """Items are their index; ``loaded`` lists what was read."""

    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.loaded.append(index)
        return index


@pytest.mark.parametrize("n", [10, 11])  # 11: not a multiple of 2 or 3 (padding, dropping)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_rank_every_skip_is_the_rest_of_the_uninterrupted_epoch(
    n: int, drop_last: bool, shuffle: bool
) -> None:
    data = Counting(n)
    for replicas in (1, 2, 3):
        for rank in range(replicas):
            kw = {"num_replicas": replicas, "rank": rank, "shuffle": shuffle, "seed": 7}
            plain = DistributedSampler(data, drop_last=drop_last, **kw)
            ours = ResumableDistributedSampler(data, drop_last=drop_last, **kw)
            for epoch in (0, 3):
                plain.set_epoch(epoch)
                whole = list(plain)
                for skip in range(len(whole) + 1):
                    ours.set_epoch(epoch, skip=skip)
                    assert list(ours) == whole[skip:], (replicas, rank, epoch, skip)
                    assert len(ours) == len(whole) - skip
                ours.set_epoch(epoch)  # the next epoch starts at its beginning
                assert list(ours) == whole


def test_a_resumed_epoch_loads_only_its_remaining_batches() -> None:
    data = Counting(40)
    plain = DistributedSampler(data, num_replicas=2, rank=1, seed=3)
    plain.set_epoch(2)
    uninterrupted = [b.tolist() for b in DataLoader(data, batch_size=4, sampler=plain)]
    ours = ResumableDistributedSampler(data, num_replicas=2, rank=1, seed=3)
    ours.set_epoch(2, skip=3 * 4)  # resume at batch 3 of epoch 2
    data.loaded.clear()
    resumed = [b.tolist() for b in DataLoader(data, batch_size=4, sampler=ours)]
    assert resumed == uninterrupted[3:]
    assert data.loaded == [i for batch in uninterrupted[3:] for i in batch]  # none skipped read


def test_without_a_process_group_it_is_one_replica() -> None:
    assert not torch.distributed.is_initialized()
    data = Counting(6)
    ours = ResumableDistributedSampler(data, shuffle=False)
    ours.set_epoch(0, skip=2)
    assert (ours.num_replicas, ours.rank, list(ours)) == (1, 0, [2, 3, 4, 5])


@pytest.mark.parametrize("skip", [-1, 6, 1.5, True, "2"])
def test_a_skip_outside_the_ranks_share_is_one_clear_error(skip: object) -> None:
    ours = ResumableDistributedSampler(Counting(10), num_replicas=2, rank=0)
    with pytest.raises(ConfigError, match=r"skip=.* is not valid; use an integer from 0 to 5"):
        ours.set_epoch(1, skip=skip)  # type: ignore[arg-type]
    assert (ours.epoch, ours.skip) == (0, 0)  # nothing changed
