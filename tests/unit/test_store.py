"""The atomic checkpoint store, on a real file system."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from preemptible import (
    Checkpoint,
    CheckpointLoadError,
    CheckpointLockError,
    CheckpointSaveError,
    CheckpointStore,
    ConfigError,
)
from preemptible._files import host_tag
from preemptible.checkpoint import _store
from preemptible.checkpoint._store import FOREIGN_TEMP_MAX_AGE, LOCK_NAME


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


def test_saves_with_pruning_deferred_prune_nothing_and_the_next_save_prunes_them(
    tmp_path: Path,
) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    store.save(1, write_text("one"))
    with store.pruning_deferred():
        store.save(2, write_text("two"))
        store.save(3, write_text("three"))
    assert [c.step for c in store.committed()] == [3, 2, 1]
    store.save(4, write_text("four"))
    assert [c.step for c in store.committed()] == [4]


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_save_retires_at_once_and_removes_in_a_thread_it_does_not_wait_for(
    tmp_path: Path, monkeypatch, kind: str
) -> None:
    """Freeing a retired checkpoint's blocks is a sixth of writing it: the save returns
    without it, and no reader ever sees a half-removed checkpoint under its name."""
    release, removers = threading.Event(), []
    remove_path = _store.remove_path

    def held(path: Path) -> None:
        if path.parent == tmp_path:  # not a removal some earlier test left running
            removers.append(threading.current_thread().name)
            assert release.wait(30)
        remove_path(path)

    def write(text: str):
        def write(path: Path) -> None:
            if kind == "file":
                path.write_text(text)
            else:
                path.mkdir()
                for shard in range(3):
                    (path / f"shard{shard}").write_text(text)

        return write

    monkeypatch.setattr(_store, "remove_path", held)
    store = CheckpointStore(tmp_path, keep=1)
    store.save(1, write("one"))
    store.save(2, write("two"))  # returns while the removal of step 1 is held
    assert [c.step for c in store.committed()] == [2]
    aside = [p.name for p in tmp_path.iterdir() if p.name.startswith(".retired-")]
    assert len(aside) == 1, aside
    assert aside[0].startswith(f".retired-step-0000000001.ckpt.{host_tag()}.{os.getpid()}.")
    assert not store.wait_for_removals(timeout=0.05)

    def pruning() -> int:
        return sum(t.name == "preemptible-prune" for t in threading.enumerate())

    before = pruning()
    store.save(3, write("three"))  # saves faster than the disk frees: one thread, a queue
    store.save(4, write("four"))
    assert [c.step for c in store.committed()] == [4]
    assert pruning() == before  # no thread more
    release.set()
    assert store.wait_for_removals(timeout=30)
    assert removers == ["preemptible-prune"] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000000004.ckpt"]


def test_a_prune_without_a_thread_removes_before_it_returns(tmp_path: Path, monkeypatch) -> None:
    def refused(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    store = CheckpointStore(tmp_path, keep=1)
    store.save(1, write_text("one"))
    monkeypatch.setattr(threading.Thread, "start", refused)
    store.save(2, write_text("two"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000000002.ckpt"]


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
    """One line saying which file is in the way (mkdir said "File exists" or "Not a
    directory"), for the directory itself (a reader's too) and for one under it."""
    f = tmp_path / "file"
    f.write_text("")
    for where, create, said in [
        (f, True, f"checkpoint directory: {f} is a file, not a directory"),
        (f, False, f"checkpoint directory: {f} is a file, not a directory"),
        (f / "c", True, f"checkpoint directory: {f / 'c'} cannot be a directory: {f} is a file"),
    ]:
        with pytest.raises(CheckpointSaveError) as info:
            CheckpointStore(where, create=create)
        assert str(info.value).startswith(said), info.value


# -- an unloadable file above the good ones: retention and quarantine ----------------------


def load_int(path: Path) -> int:
    return int(path.read_text())  # "garbage" raises ValueError: the file does not load


@pytest.mark.parametrize("keep", [1, 2])
def test_unloadable_higher_step_does_not_prune_the_good_ones(
    tmp_path: Path, keep: int, caplog
) -> None:
    store = CheckpointStore(tmp_path, keep=keep)
    store.save(1, write_text("1"))
    foreign = tmp_path / "step-0000000099.ckpt"
    foreign.write_text("garbage")
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        store.save(2, write_text("2"))
        store.save(3, write_text("3"))
    # retention counts only steps up to the one just saved, and leaves the higher one alone
    assert [c.step for c in store.committed()] == [99, 3, 2][: keep + 1]
    assert foreign.read_text() == "garbage"
    warnings = [r.getMessage() for r in caplog.records if foreign.name in r.getMessage()]
    assert len(warnings) == 1 and "leaving" in warnings[0], warnings  # once, naming it

    # the next resume puts the unloadable one aside (renamed, never deleted) ...
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        found = store.load_newest(load_int)
    assert found is not None and (found[0].step, found[1]) == (3, 3)
    aside = tmp_path / "step-0000000099.ckpt.unloadable"
    assert aside.read_text() == "garbage" and not foreign.exists()
    assert f"{foreign} to {aside.name}" in caplog.text
    # ... so it no longer counts as a checkpoint at all
    store.save(4, write_text("4"))
    assert [c.step for c in store.committed()] == [4, 3][:keep]


def test_quarantine_only_when_an_older_one_loads(tmp_path: Path, caplog) -> None:
    store = CheckpointStore(tmp_path, keep=5)
    for step, text in [(1, "bad"), (2, "bad")]:
        store.save(step, write_text(text))
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(CheckpointLoadError, match="none of the 2 checkpoints"):
        store.load_newest(load_int)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing renamed

    store.save(0, write_text("0"))  # an older one that loads
    (tmp_path / "step-0000000002.ckpt.unloadable").write_text("an earlier quarantine")
    found = store.load_newest(load_int)
    assert found is not None and found[0].step == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0] == "step-0000000000.ckpt"
    assert names[1] == "step-0000000001.ckpt.unloadable"
    assert names[2] == "step-0000000002.ckpt.unloadable"  # kept, not overwritten
    assert names[3].startswith("step-0000000002.ckpt.unloadable-") and len(names) == 4
    assert (tmp_path / names[2]).read_text() == "an earlier quarantine"


def test_quarantine_that_cannot_rename_is_a_warning(tmp_path: Path, monkeypatch, caplog) -> None:
    store = CheckpointStore(tmp_path, keep=5)
    store.save(1, write_text("1"))
    store.save(2, write_text("bad"))

    def refuse(src: object, dst: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "rename", refuse)
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        found = store.load_newest(load_int)
    assert found is not None and found[0].step == 1
    assert "could not rename unloadable checkpoint" in caplog.text
    assert "Read-only file system" in caplog.text
    assert (tmp_path / "step-0000000002.ckpt").exists()


def test_resume_from_elsewhere_is_not_renamed(tmp_path: Path) -> None:
    other = CheckpointStore(tmp_path / "other")
    other.save(9, write_text("bad"))
    store = CheckpointStore(tmp_path / "mine")
    store.save(1, write_text("1"))
    extra = [Checkpoint(9, tmp_path / "other" / "step-0000000009.ckpt")]
    found = store.load_newest(load_int, extra)
    assert found is not None and found[0].step == 1
    assert (tmp_path / "other" / "step-0000000009.ckpt").exists()


# -- only regular files and directories are checkpoints ------------------------------------


def test_committed_ignores_fifos_and_dangling_links(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(1, write_text("1"))
    os.mkfifo(tmp_path / "step-0000000007.ckpt")
    os.symlink(tmp_path / "nowhere", tmp_path / "step-0000000008.ckpt")
    outside = tmp_path.parent / f"{tmp_path.name}-target"
    outside.write_text("3")
    os.symlink(outside, tmp_path / "step-0000000003.ckpt")  # a link to a file is fine
    assert [c.step for c in store.committed()] == [3, 1]


@pytest.mark.timeout(120)
def test_a_fifo_named_like_a_checkpoint_does_not_hang_resume(tmp_path: Path) -> None:
    code = f"""
import torch
from preemptible import PreemptionCheckpointHandler
state = {{"model": torch.nn.Linear(2, 2)}}
h = PreemptionCheckpointHandler({str(tmp_path)!r}, state, save_every_steps=1)
list(h.steps(2))
import os
os.mkfifo({str(tmp_path / "step-0000000005.ckpt")!r})
h = PreemptionCheckpointHandler({str(tmp_path)!r}, state)
print("resumed at", h.resume())
h.close()
"""
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("resume() blocked on a FIFO named step-0000000005.ckpt")
    assert out.returncode == 0, out.stderr
    assert "resumed at 2" in out.stdout


# -- one writer per directory --------------------------------------------------------------

LOCKER = """
import sys
from preemptible import CheckpointStore
store = CheckpointStore(sys.argv[1])
store.lock()
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.mark.timeout(60)
def test_lock_across_processes_released_by_sigkill(tmp_path: Path, spawn) -> None:
    holder = spawn([sys.executable, "-c", LOCKER, str(tmp_path)], stdin=subprocess.PIPE)
    holder.wait_line(lambda line: line == "locked", 30)
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointLockError) as info:
        store.lock()
    message = str(info.value)
    assert str(tmp_path) in message and "\n" not in message
    assert f"held by pid {holder.pid} on host {socket.gethostname()}" in message
    assert not store.locked
    holder.signal(signal.SIGKILL)
    assert holder.wait(30) == -signal.SIGKILL
    assert store.lock() is True  # the kernel released it with the process
    store.unlock()


@pytest.mark.timeout(60)
def test_lock_within_one_process(tmp_path: Path) -> None:
    first, second = CheckpointStore(tmp_path), CheckpointStore(tmp_path)
    assert not (tmp_path / LOCK_NAME).exists()  # the constructor creates no lock file
    assert first.lock() is True
    assert first.lock() is True  # the holder may ask again
    with pytest.raises(CheckpointLockError, match="in this process"):
        second.lock()
    first.unlock()
    first.unlock()  # idempotent
    assert second.lock() is True
    with pytest.raises(CheckpointLockError):
        first.lock()
    second.unlock()
    # the lock file is never taken for a checkpoint or a temporary
    assert (tmp_path / LOCK_NAME).exists()
    assert first.committed() == [] and first.clean_stale_temporaries() == []
    assert (tmp_path / LOCK_NAME).exists()


@pytest.mark.timeout(60)
def test_lock_is_not_inherited_by_exec(tmp_path: Path, spawn) -> None:
    store = CheckpointStore(tmp_path)
    store.lock()
    child = spawn(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        close_fds=False,
    )
    store.unlock()
    other = CheckpointStore(tmp_path)
    assert other.lock() is True  # the running child holds no copy of the descriptor
    other.unlock()
    child.kill()


def test_lock_in_a_directory_that_takes_no_files_warns(caplog) -> None:
    # /proc/self exists, but nothing can be created in it, even by root: no checkpoint of ours
    # can land there either, so running unlocked mixes nothing (a read-only mount is the same)
    store = CheckpointStore("/proc/self")
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        assert store.lock() is False
    assert "cannot lock checkpoint directory /proc/self" in caplog.text and not store.locked


@pytest.mark.parametrize("kind", ["symlink to /dev/null", "FIFO", "directory", "hard link"])
def test_a_lock_file_that_is_not_ours_refuses_to_lock(tmp_path: Path, kind: str) -> None:
    """Fail closed: each of these used to warn and train unlocked, so two runs wrote one
    directory at once (a symlink to /dev/null "locks" nothing)."""
    path = tmp_path / LOCK_NAME
    what = {
        "symlink to /dev/null": "a symbolic link (to /dev/null)",
        "FIFO": "a FIFO",
        "directory": "a directory",
        "hard link": "a file with 2 names (a hard link)",
    }[kind]
    if kind == "symlink to /dev/null":
        path.symlink_to("/dev/null")
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        (tmp_path / "other").write_text("")
        os.link(tmp_path / "other", path)
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointLockError) as info:
        store.lock()
    message = str(info.value)
    assert "\n" not in message and info.value.path == tmp_path
    assert f"{path} is {what}; remove it" in message, message
    assert not store.locked


# -- temporaries on a shared file system ---------------------------------------------------


def dead_pid() -> int:
    return int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )


def test_temporaries_carry_host_and_pid(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu_node.7.example.com")
    assert host_tag() == "gpu-node-7-example-com"
    monkeypatch.setattr(socket, "gethostname", lambda: "n" * 80)
    assert host_tag() == "n" * 63
    monkeypatch.undo()
    seen: list[str] = []

    def write(path: Path) -> None:
        seen.append(path.name)
        path.write_text("x")

    CheckpointStore(tmp_path).save(5, write)
    prefix = f".tmp-step-0000000005.ckpt.{host_tag()}.{os.getpid()}."
    assert seen[0].startswith(prefix), seen


def test_clean_stale_temporaries_across_hosts(tmp_path: Path) -> None:
    me, dead, hour = host_tag(), dead_pid(), 3600.0
    names = {
        "mine_dead": f".tmp-step-0000000001.ckpt.{me}.{dead}.ab12",
        "mine_live": f".tmp-step-0000000002.ckpt.{me}.{os.getpid()}.ab12",
        "other_young": f".tmp-step-0000000003.ckpt.other-host.{dead}.ab12",
        "other_old": f".tmp-step-0000000004.ckpt.other-host.{os.getpid()}.ab12",
        "other_dir_written_lately": f".tmp-step-0000000005.ckpt.other-host.{dead}.ab12",
        "old_format_dead": f".tmp-step-0000000006.ckpt.{dead}.ab12",
        "old_format_live": f".tmp-step-0000000007.ckpt.{os.getpid()}.ab12",
        "pid_20_digits": f".tmp-step-0000000008.ckpt.{'9' * 20}.ab12",
        "pid_0": f".tmp-step-0000000009.ckpt.{me}.0.ab12",
        "pid_above_limit": f".tmp-step-0000000010.ckpt.{me}.4194305.ab12",
        "retired_mine_dead": f".retired-step-0000000011.ckpt.{me}.{dead}.ab12cd34",
        "retired_dir_mine_dead": f".retired-step-0000000012.ckpt.{me}.{dead}.ab12cd34",
        "retired_mine_live": f".retired-step-0000000013.ckpt.{me}.{os.getpid()}.ab12cd34",
        "retired_other_young": f".retired-step-0000000014.ckpt.other-host.{dead}.ab12cd34",
    }
    for key, name in names.items():
        path = tmp_path / name
        if key == "retired_dir_mine_dead":
            path.mkdir()
            (path / "shard0").write_text("retired")
        elif key == "other_dir_written_lately":
            path.mkdir()
            (path / "shard0").write_text("written a moment ago")
            os.utime(path, (time.time() - 2 * hour,) * 2)  # the directory itself is old
        else:
            path.write_text("partial")
    os.utime(tmp_path / names["other_old"], (time.time() - FOREIGN_TEMP_MAX_AGE - 60,) * 2)

    removed = CheckpointStore(tmp_path).clean_stale_temporaries()
    expect_removed = {
        "mine_dead",
        "other_old",
        "old_format_dead",
        "pid_20_digits",
        "pid_0",
        "pid_above_limit",
        "retired_mine_dead",
        "retired_dir_mine_dead",
    }
    assert sorted(p.name for p in removed) == sorted(names[k] for k in expect_removed)
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {names[k] for k in names if k not in expect_removed}
