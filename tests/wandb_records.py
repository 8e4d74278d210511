"""Read the records of a W&B offline run file (``run-<id>.wandb``) back, for assertions.

The file is a LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks
of chunks, each with a 7-byte header (crc32, length, type: full/first/middle/last) and a piece
of a serialized ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, out, pending = HEADER, [], b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:
            pos += left_in_block  # block trailer padding
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + HEADER : pos + HEADER + length]
        if len(chunk) < length:
            break  # the writer has not finished this record yet
        pos += HEADER + length
        if kind in (FULL, FIRST):
            pending = chunk
        else:
            pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def summary(run_dir: Path, timeout: float = 30.0) -> dict[str, Any]:
    """exit code, preempting flag and artifact names of the newest offline run under run_dir.

    W&B's writer (a separate wandb-core process) may still be flushing the file when
    ``finish()`` returns or the training process exits: wait, with a deadline, until the
    run's exit record is in it.
    """
    deadline = time.monotonic() + timeout
    while True:
        found = _summary(run_dir)
        if found["exit_codes"] or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _summary(run_dir: Path) -> dict[str, Any]:
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no offline run under {run_dir}"
    found: dict[str, Any] = {"exit_codes": [], "preempting": False, "artifacts": []}
    for record in records(files[-1]):
        kind = record.WhichOneof("record_type")
        if kind == "exit":
            found["exit_codes"].append(record.exit.exit_code)
        elif kind == "preempting":
            found["preempting"] = True
        elif kind == "artifact":
            found["artifacts"].append(record.artifact.name)
        elif kind == "request" and record.request.WhichOneof("request_type") == "log_artifact":
            found["artifacts"].append(record.request.log_artifact.artifact.name)
    return found
