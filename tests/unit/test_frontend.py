"""The front-end kit in this process: a front end of one's own with a checkpoint format of its
own (``NamedSaver``), stopped by a real signal, resumed, and its retention."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from preemptible.frontend import (
    CheckpointLoadError,
    CheckpointSaveError,
    ConfigError,
    Decision,
    NamedSaver,
    Periodic,
    Phase,
    StagedSaver,
    StopSession,
    TerminationConfig,
)


class Counter:
    """A program whose whole state is a running sum, saved as JSON."""

    def __init__(self) -> None:
        self.total = 0

    def write(self, tmp: Path, step: int, context: Any) -> None:
        tmp.write_text(json.dumps({"step": step, "total": self.total}))

    def load(self, path: Path) -> int:
        saved = json.loads(path.read_text())
        self.total = saved["total"]
        return int(saved["step"])


def run(directory: Path, program: Counter, total: int, *, stop_at: int | None = None, **kw: Any):
    codes: list[int] = []
    saver = NamedSaver(directory, "sum-{step}.json", program.write, load=program.load, **kw)
    session = StopSession(saver, termination_config=TerminationConfig(exit_fn=codes.append))
    session.start()
    step = session.resume()
    try:
        while step < total:
            program.total += step
            step += 1
            if step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)
            if session.at_boundary(Phase.STEP, step=step):
                return step, codes
        session.finished(step=step)
    finally:
        session.close()
    return step, codes


def test_a_step_named_checkpoint_is_committed_found_and_resumed(tmp_path: Path) -> None:
    first = Counter()
    assert run(tmp_path, first, 10, stop_at=4) == (4, [143])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".preemptible.lock", "sum-4.json"]
    again = Counter()
    assert run(tmp_path, again, 10) == (10, [])
    assert again.total == sum(range(10))  # the resumed run continued from step 4's sum
    # its end is committed too (it resumed), and the newest two are kept
    assert sorted(p.name for p in tmp_path.glob("sum-*")) == ["sum-10.json", "sum-4.json"]


def test_retention_keeps_the_newest_of_a_step_named_checkpoint(tmp_path: Path) -> None:
    program = Counter()
    saver = NamedSaver(str(tmp_path), "sum-{step}.json", program.write, keep=2)
    session = StopSession(
        saver, termination_config=TerminationConfig(), periodic=Periodic(every_steps=2)
    )
    session.start()
    for step in range(1, 9):
        session.at_boundary(Phase.STEP, step=step)
    session.close()
    assert sorted(p.name for p in tmp_path.glob("sum-*")) == ["sum-6.json", "sum-8.json"]


def test_a_torn_newest_is_set_aside_and_the_older_one_resumed(tmp_path: Path) -> None:
    program = Counter()
    run(tmp_path, program, 10, stop_at=3)
    run(Path(tmp_path), Counter(), 10, stop_at=6)
    (tmp_path / "sum-6.json").write_text("{torn")
    again = Counter()
    assert run(tmp_path, again, 10) == (10, [])
    assert again.total == sum(range(10))
    assert (tmp_path / "sum-6.json.unloadable").exists()


def test_a_fixed_name_that_does_not_load_fails_the_resume(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text("{torn")
    program = Counter()
    session = StopSession(
        NamedSaver(tmp_path, "state.json", program.write, load=program.load),
        termination_config=TerminationConfig(),
    )
    session.start()
    with pytest.raises(CheckpointLoadError, match="none of the 1 checkpoints"):
        session.resume()
    session.close()
    assert (tmp_path / "state.json").read_text() == "{torn"  # never destroyed


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "x-{step}-{step}", 7])
def test_a_bad_name_is_one_clear_error(tmp_path: Path, name: object) -> None:
    with pytest.raises(ConfigError, match="name="):
        NamedSaver(tmp_path, name, Counter().write)  # type: ignore[arg-type]


def test_a_frameworks_torch_save_under_a_named_saver_skips_the_crc32_nothing_reads(
    tmp_path: Path,
) -> None:
    """Lightning's checkpoint is one torch.save: written like a payload, without the CRC32 of
    each record (the CPU cost of serializing), it loads the same; torch's setting is restored."""
    torch = pytest.importorskip("torch")
    config = pytest.importorskip("torch.utils.serialization").config
    if not hasattr(config.save, "compute_crc32"):
        pytest.skip("this torch has no save.compute_crc32 setting")
    import zipfile

    weight = torch.randn(4096, generator=torch.Generator().manual_seed(5))

    def write(tmp: Path, step: int, context: Any) -> None:
        torch.save({"weight": weight, "step": step}, tmp)

    path = NamedSaver(tmp_path, "resume.ckpt", write).write(3, None)
    with zipfile.ZipFile(path) as archive:
        records = [i for i in archive.infolist() if "/data/" in i.filename]
        assert records and all(i.CRC == 0 for i in records)
    loaded = torch.load(path, weights_only=True)
    assert loaded["step"] == 3 and torch.equal(loaded["weight"], weight)
    assert config.save.compute_crc32 is True


# -- a framework that writes its checkpoints itself, after the boundary (StagedSaver) ---------


class LateWriter:
    """A framework that decides at the boundary and writes its checkpoint afterwards, into
    the directory it is pointed at (as the Hugging Face Trainer does)."""

    def __init__(self, directory: Path) -> None:
        self.saver = StagedSaver(directory, "checkpoint-{step}")
        self.codes: list[int] = []
        self.session = StopSession(
            self.saver, termination_config=TerminationConfig(exit_fn=self.codes.append)
        )

    def write(self, step: int) -> None:
        parent = self.saver.stage(step)
        (parent / f"checkpoint-{step}").mkdir()
        (parent / f"checkpoint-{step}" / "model.bin").write_bytes(b"x" * step)


def test_a_late_written_checkpoint_is_committed_at_its_name(tmp_path: Path) -> None:
    late = LateWriter(tmp_path)
    session = late.session
    session.start()
    try:
        session.resume()
        assert session.decide(step=1) is Decision.CONTINUE
        os.kill(os.getpid(), signal.SIGTERM)
        assert session.decide(step=2) is Decision.STOP
        late.write(2)
        path = session.save(step=2)
        assert path == tmp_path / "checkpoint-2" and (path / "model.bin").read_bytes() == b"xx"
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")) == []
        session.stop(step=2)  # saved here: no second save, exit with the signal's code
        assert late.codes == [143]
    finally:
        session.close()


def test_a_staged_save_that_did_not_come_leaves_nothing(tmp_path: Path) -> None:
    late = LateWriter(tmp_path)
    late.session.start()
    try:
        parent = late.saver.stage(3)
        assert parent.name.startswith(".tmp-checkpoint-3.") and parent.is_dir()
        late.saver.discard()
        assert not parent.exists()
        with pytest.raises(CheckpointSaveError, match="no save of step 4 was written"):
            late.session.save(step=4)  # nothing staged: an error, nothing committed
        late.saver.stage(5)  # staged, but the framework wrote nothing there
        with pytest.raises(CheckpointSaveError, match="wrote no"):
            late.session.save(step=5)
        assert list(tmp_path.glob("checkpoint-*")) == []
        assert [p.name for p in tmp_path.iterdir()] == [".preemptible.lock"]
    finally:
        late.session.close()
