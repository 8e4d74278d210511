"""Files planted where preemptible writes or reads: links, foreign payloads, odd names.

A planted link must not turn a lock or a journal into a write outside its directory (or onto a
committed checkpoint); a file that loads with ``weights_only`` but was not written by
preemptible is skipped like a torn one, before any of it is put back; an unreadable directory
is an error, not an empty one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from preemptible import CheckpointLockError, ConfigError, PreemptionCheckpointHandler
from preemptible._env import env_int
from preemptible.checkpoint._store import LOCK_NAME
from tests.conftest import PY


def linear_state(seed: int) -> dict[str, object]:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(3, 2)}


def commit(directory: Path, step: int, seed: int) -> Path:
    """A real checkpoint of step ``step`` holding the weights of seed ``seed``."""
    h = PreemptionCheckpointHandler(directory, linear_state(seed))
    path = h.save(step)
    h.close()
    return path


def run_supervised(cwd: Path, run_id: str) -> subprocess.CompletedProcess[str]:
    """``preemptible run --run-id RUN_ID`` of a job that does nothing, in ``cwd``."""
    return subprocess.run(
        [PY, "-m", "preemptible", "run", "--run-id", run_id, "--", PY, "-c", "pass"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=50,
    )


def weights(state: dict[str, object]) -> torch.Tensor:
    model = state["model"]
    assert isinstance(model, torch.nn.Linear)
    return model.weight.detach().clone()


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_lock_file_linked_to_a_checkpoint_never_writes_into_it(tmp_path: Path, link: str) -> None:
    ckpt = commit(tmp_path, 3, seed=1)
    before = ckpt.read_bytes()
    (tmp_path / LOCK_NAME).unlink()
    if link == "symlink":
        (tmp_path / LOCK_NAME).symlink_to(ckpt.name)
    else:
        os.link(ckpt, tmp_path / LOCK_NAME)
    # the lock fails closed: no handler, so nothing is written (through the link or at all)
    with pytest.raises(CheckpointLockError, match=f"{tmp_path / LOCK_NAME} is a "):
        PreemptionCheckpointHandler(tmp_path, linear_state(seed=2))
    assert ckpt.read_bytes() == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["supervisor.lock", "attempts.jsonl"])
def test_run_files_linked_outside_the_run_directory_are_not_written_through(
    tmp_path: Path, name: str
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run_dir = tmp_path / ".preemptible" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / name).symlink_to(victim)
    proc = run_supervised(tmp_path, "r1")
    assert victim.read_text() == "precious\n"
    assert "a symbolic link; it is not written through" in proc.stderr, proc.stderr
    if name == "supervisor.lock":  # no lock, no run: one line, exit 2
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    else:  # the journal is best effort: the run itself goes on
        assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"plain": 7}, "list of plain values is not a list of names"),
        ({"state": ["model"]}, "state is not a mapping of names"),
        ({"rng": {"python": "garbage"}}, "random states do not restore"),
        ({"rng": {"torch": torch.zeros(3)}}, "random states do not restore"),
        ({"rng": {"numpy": ("MT19937", [1, 2], 0, 0, 0.0)}}, "random states do not restore"),
        ({"rng": [1, 2]}, "random states are a list, not a mapping"),
        ({"rng_ranks": [{"python": 1}]}, "random states do not restore"),
    ],
)
def test_a_foreign_payload_that_loads_is_skipped_before_anything_is_restored(
    tmp_path: Path, change: dict[str, object], problem: str, caplog
) -> None:
    commit(tmp_path, 3, seed=1)
    newer = commit(tmp_path, 9, seed=9)
    payload = torch.load(newer, weights_only=True)
    payload.update(change)
    torch.save(payload, newer)
    state = linear_state(seed=2)
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        h = PreemptionCheckpointHandler(tmp_path, state)
        assert h.resume() == 3  # the older good one, with its weights only
    h.close()
    assert torch.equal(weights(state), weights(linear_state(seed=1)))
    assert problem in caplog.text
    assert (tmp_path / (newer.name + ".unloadable")).exists()  # set aside, not deleted


def test_a_step_too_large_for_64_bits_is_not_a_checkpoint(tmp_path: Path, caplog) -> None:
    good = commit(tmp_path, 3, seed=1)
    huge = tmp_path / "step-99999999999999999999999.ckpt"
    shutil.copy(good, huge)
    state = linear_state(seed=2)
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        h = PreemptionCheckpointHandler(tmp_path, state)
        assert h.resume() == 3
        h.save(4)
    h.close()
    assert huge.exists() and "its step does not fit a 64-bit integer" in caplog.text
    assert caplog.text.count("does not fit a 64-bit") == 1  # said once, not at every listing


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [0o666, 0o333])  # not searchable; not listable
def test_an_unreadable_checkpoint_directory_is_an_error_not_a_fresh_start(
    tmp_path: Path, mode: int
) -> None:
    ckpt_dir = tmp_path / "ck"
    commit(ckpt_dir, 3, seed=1)
    code = (
        "import preemptible, torch\n"
        "try:\n"
        f"    preemptible.PreemptionCheckpointHandler({str(ckpt_dir)!r}, "
        "{'m': torch.nn.Linear(1, 1)})\n"
        "except preemptible.CheckpointLoadError as exc:\n"
        "    print('refused:', exc)\n"
    )
    argv = [PY, "-c", code]
    if os.geteuid() == 0:  # root reads anything: drop the capabilities that let it
        capsh = shutil.which("capsh")
        if capsh is None:
            pytest.skip("running as root without capsh to drop CAP_DAC_OVERRIDE")
        argv = [capsh, "--drop=cap_dac_override,cap_dac_read_search", "--", "-c", 'exec "$@"']
        argv += ["sh", PY, "-c", code]
    ckpt_dir.chmod(mode)
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=50)
    finally:
        ckpt_dir.chmod(0o755)
    assert out.returncode == 0, out.stderr
    assert f"refused: checkpoint directory {ckpt_dir} cannot be read" in out.stdout, out
    assert "Permission denied" in out.stdout


def test_attempt_directories_with_non_ascii_digits_are_not_attempt_numbers(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / ".preemptible" / "runs" / "odd"
    (run_dir / "attempt-²").mkdir(parents=True)
    (run_dir / "attempt-٣").mkdir()
    proc = run_supervised(tmp_path, "odd")
    assert proc.returncode == 0, proc.stderr
    [line] = (run_dir / "attempts.jsonl").read_text().splitlines()
    assert json.loads(line)["attempt"] == 1


@pytest.mark.parametrize("raw", ["²", "-²", "٣"])
def test_env_integers_take_ascii_digits_only(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("PREEMPTIBLE_TEST_INT", raw)
    with pytest.raises(ConfigError, match="PREEMPTIBLE_TEST_INT="):
        env_int("PREEMPTIBLE_TEST_INT", min_value=None)
