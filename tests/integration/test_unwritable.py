"""A save the operating system refuses: a clear error naming the path; old checkpoints intact.

The refusals are real: a read-only bind mount (EROFS) made in a private mount namespace of the
child, an immutable directory (EPERM, chattr +i), and a file size limit (EFBIG, which fails a
write half way like a full disk). The first two need root; elsewhere they skip and say why.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from preemptible import CheckpointSaveError, PreemptionCheckpointHandler
from tests.conftest import python_args

pytestmark = pytest.mark.timeout(120)


def _try(cmd: list[str]) -> bool:
    if shutil.which(cmd[0]) is None:
        return False
    return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[None]:
    if not _try(["chattr", "+i", str(path)]):
        pytest.skip("chattr +i is not possible here (needs root and ext4-like file system)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True, timeout=30)


def readonly_prefix(path: Path) -> list[str]:
    if os.geteuid() != 0 or not _try(["unshare", "-m", "true"]):
        pytest.skip("a private read-only bind mount needs root and unshare(1)")
    script = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"'
    return ["unshare", "-m", "sh", "-c", script, str(path)]


def _limit_file_size() -> None:  # runs in the child before exec: writes past 8 KiB fail
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.RLIM_INFINITY))


@pytest.mark.parametrize(
    "refusal", ["read-only mount", "immutable directory", "file size limit (disk full)"]
)
def test_refused_save_names_the_path_and_keeps_the_old_checkpoint(
    refusal: str, tmp_path: Path, spawn
) -> None:
    ckpt = tmp_path / "ckpt"
    first = spawn(
        python_args(
            "train.py",
            "--ckpt",
            str(ckpt),
            "--out",
            str(tmp_path / "o.pt"),
            "--steps",
            "4",
            "--save-every",
            "2",
        )
    )
    assert first.wait(120) == 0, first.output
    before = {p.name: p.read_bytes() for p in ckpt.glob("step-*.ckpt")}
    assert len(before) == 2

    train = python_args(
        "train.py",
        "--ckpt",
        str(ckpt),
        "--out",
        str(tmp_path / "x.pt"),
        "--steps",
        "100000",
        "--step-sleep",
        "0.01",
    )
    with contextlib.ExitStack() as stack:
        if refusal == "read-only mount":
            args, expected = [*readonly_prefix(ckpt), *train], "Read-only file system"
        elif refusal == "immutable directory":
            stack.enter_context(immutable(ckpt))
            args, expected = train, "Operation not permitted"
        else:
            args, expected = train, "File too large"
        limit = _limit_file_size if refusal.startswith("file size") else None
        second = spawn(args, preexec_fn=limit)
        second.wait_line(lambda line: line == "step 6", timeout=60)
        second.signal(signal.SIGTERM)
        rc = second.wait(60)
    assert rc == 1, second.output
    assert f"CheckpointSaveError: could not save checkpoint {ckpt}/step-00000000" in second.output
    assert expected in second.output
    assert "the previous checkpoints are intact" in second.output
    after = {p.name: p.read_bytes() for p in ckpt.glob("step-*.ckpt")}
    assert after == before
    assert torch.load(ckpt / "step-0000000004.ckpt", weights_only=True)["step"] == 4


def test_a_directory_that_cannot_hold_files() -> None:
    # /proc/self exists, but no file can be created in it, even by root
    h = PreemptionCheckpointHandler("/proc/self", {"m": torch.nn.Linear(1, 1)})
    try:
        with pytest.raises(
            CheckpointSaveError, match=r"could not save checkpoint /proc/self/step-0+\.ckpt"
        ) as info:
            h.save()
        assert info.value.path == Path("/proc/self/step-0000000000.ckpt")
    finally:
        h.close()
