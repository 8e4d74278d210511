"""The atomic checkpoint store, on a real file system."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from preemptible import CheckpointLoadError, CheckpointSaveError, CheckpointStore, ConfigError


def write_text(text: str):
    def write(path: Path) -> None:
        path.write_text(text)

    return write


def test_commit_names_and_order(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    for step in (5, 10, 2):
        store.save(step, write_text(f"s{step}"))
    assert [c.step for c in store.committed()] == [10, 5, 2]
    assert store.latest().path.read_text() == "s10"  # type: ignore[union-attr]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-0000000002.ckpt",
        "step-0000000005.ckpt",
        "step-0000000010.ckpt",
    ]


def test_keep_prunes_oldest_only_after_commit(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    store.save(1, write_text("one"))

    def write_and_look(path: Path) -> None:
        # while the next checkpoint is being written, the committed one is still there
        assert (tmp_path / "step-0000000001.ckpt").read_text() == "one"
        path.write_text("two")

    store.save(2, write_and_look)
    assert [c.step for c in store.committed()] == [2]


def test_failed_write_leaves_previous_and_no_temporary(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    store.save(1, write_text("good"))

    def broken(path: Path) -> None:
        path.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointSaveError) as info:
        store.save(2, broken)
    assert "step-0000000002.ckpt" in str(info.value)
    assert "No space left on device" in str(info.value)
    assert info.value.path == tmp_path / "step-0000000002.ckpt"
    assert [p.name for p in tmp_path.iterdir()] == ["step-0000000001.ckpt"]
    assert store.latest().path.read_text() == "good"  # type: ignore[union-attr]


def test_file_size_limit_is_a_clear_save_error(tmp_path: Path) -> None:
    # A real write failure from the kernel (EFBIG), run in a child so the limit stays there.
    code = f"""
import resource, signal
from pathlib import Path
from preemptible import CheckpointStore, CheckpointSaveError
store = CheckpointStore({str(tmp_path)!r})
store.save(1, lambda p: p.write_bytes(b"x" * 100))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    store.save(2, lambda p: p.write_bytes(b"y" * 100_000))
except CheckpointSaveError as exc:
    print("ERROR", exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "ERROR could not save checkpoint" in out.stdout, out
    assert "File too large" in out.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["step-0000000001.ckpt"]


def test_directory_checkpoints_and_same_step_replace(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)

    def write_dir(tag: str):
        def write(path: Path) -> None:
            path.mkdir()
            (path / "shard0").write_text(tag)

        return write

    store.save(3, write_dir("a"))
    store.save(3, write_dir("b"))
    assert (tmp_path / "step-0000000003.ckpt" / "shard0").read_text() == "b"
    assert [p.name for p in tmp_path.iterdir()] == ["step-0000000003.ckpt"]


def test_stale_temporaries_are_cleaned_and_half_swapped_dirs_restored(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (tmp_path / f".tmp-step-0000000009.ckpt.{dead}.abcd").write_text("partial")
    live = tmp_path / f".tmp-step-0000000008.ckpt.{os.getpid()}.abcd"
    live.write_text("being written by a live process")
    (tmp_path / ".old-step-0000000004.ckpt.beef").mkdir()  # killed between the two renames
    store = CheckpointStore(tmp_path)
    removed = store.clean_stale_temporaries()
    assert [p.name for p in removed] == [f".tmp-step-0000000009.ckpt.{dead}.abcd"]
    assert live.exists()
    assert [c.step for c in store.committed()] == [4]


def test_load_newest_skips_broken_with_a_warning(tmp_path: Path, caplog) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.save(1, write_text("1"))
    store.save(2, write_text("broken"))

    def load(path: Path) -> int:
        text = path.read_text()
        if text == "broken":
            raise ValueError("truncated")
        return int(text)

    with caplog.at_level(logging.WARNING, logger="preemptible"):
        ckpt, value = store.load_newest(load)  # type: ignore[misc]
    assert (ckpt.step, value) == (1, 1)
    assert "step-0000000002.ckpt" in caplog.text and "truncated" in caplog.text


def test_load_newest_refuses_to_start_over_when_nothing_loads(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(1, write_text("x"))
    with pytest.raises(CheckpointLoadError, match="none of the 1 checkpoints"):
        store.load_newest(lambda p: int("not a number"))
    assert CheckpointStore(tmp_path / "empty").load_newest(lambda p: 1) is None


@pytest.mark.parametrize("keep", [0, -1, 1.5, True, "2"])
def test_bad_keep(tmp_path: Path, keep: object) -> None:
    with pytest.raises(ConfigError, match=r"keep=.* use an integer >= 1"):
        CheckpointStore(tmp_path, keep=keep)  # type: ignore[arg-type]


def test_directory_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(CheckpointSaveError, match=str(f)):
        CheckpointStore(f)
