"""SIGKILL at random moments, most of them inside a save: the newest committed checkpoint
always loads. PREEMPTIBLE_STRESS_SCALE multiplies the number of kills: CI runs the short
form, scale 1 (80 kills of the byte writer, 10 of torch.save); scale 5 or more is the long
stress run."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from preemptible import CheckpointStore
from preemptible.checkpoint._store import LOCK_NAME
from tests.conftest import python_args, wait_for

SCALE = float(os.environ.get("PREEMPTIBLE_STRESS_SCALE", "1"))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(600 * max(SCALE, 1)))]


def blob_ok(path: Path) -> bool:
    data = path.read_bytes()
    return len(data) > 64 and hashlib.sha256(data[64:]).hexdigest().encode() == data[:64]


def kill_loop(spawn, ckpt: Path, mode: str, kills: int, max_delay: float, check) -> tuple[int, int]:
    """Returns (kills after which a checkpoint was checked, kills that landed inside a save)."""
    rng = random.Random(2026)
    checked = mid_save = 0
    for _ in range(kills):
        child = spawn(python_args("kill_target.py", "--ckpt", str(ckpt), "--mode", mode))
        saves = rng.randint(1, 3)
        wait_for(
            lambda c=child, n=saves: c.lines.count("saving") >= n or c.proc.poll() is not None,
            60,
            f"save number {saves}",
        )
        assert child.proc.poll() is None, child.output
        time.sleep(rng.uniform(0, max_delay))  # the kill moment, not a synchronisation
        child.signal(signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
        mid_save += any(p.name.startswith(".tmp-") for p in ckpt.iterdir())
        newest = CheckpointStore(ckpt).latest()
        if newest is not None:
            assert check(newest.path), f"newest checkpoint {newest.path} does not load"
            checked += 1
    return checked, mid_save


def test_sigkill_never_leaves_an_unloadable_newest_checkpoint(tmp_path: Path, spawn) -> None:
    kills = int(80 * SCALE)
    checked, mid_save = kill_loop(spawn, tmp_path / "blob", "blob", kills, 0.08, blob_ok)
    assert checked >= kills * 0.9, f"only {checked} of {kills} kills left a checkpoint to check"
    print(f"{kills} kills, {mid_save} inside a save, {checked} checkpoints checked")
    assert mid_save >= kills * 0.25, f"only {mid_save} of {kills} kills landed inside a save"
    # the next start cleans what the killed writers left behind
    store = CheckpointStore(tmp_path / "blob")
    store.clean_stale_temporaries()
    leftovers = [p.name for p in (tmp_path / "blob").iterdir() if p.name.startswith(".")]
    assert [name for name in leftovers if name != LOCK_NAME] == []


def test_sigkill_during_torch_saves(tmp_path: Path, spawn) -> None:
    def loads(path: Path) -> bool:
        payload = torch.load(path, weights_only=True)
        return payload["state"]["model"]["weight"].shape == (512, 512)

    kills = int(10 * SCALE)
    checked, _ = kill_loop(spawn, tmp_path / "torch", "torch", kills, 0.05, loads)
    assert checked >= kills - 2
