"""Upload throughput of a committed checkpoint through the mirror, against obstore's own put of
the same bytes to the same server; and a new machine's download of it (a store on an empty
staging directory brings the newest back, verified) against obstore's own get.

Side by side in one run, interleaved, median of --repeats, for one file of --mb MiB and for a
directory of --files files of the same total:
  obstore.put   obstore.put(store, key, Path(file)) for each file, one after another: the
                client's own upload (multipart for large files), nothing else
  mirror        what a URL's store does after a save is committed in staging: the hard-linked
                snapshot, sha256 of every file, the same puts under a fresh upload id, the
                manifest (create-only), retention; timed from the hand-over (enqueue) to the
                end of flush()
  download      obstore.get of each file streamed into a local file, against
                CheckpointStore(url) on an empty staging directory: the newest checkpoint
                brought back (ranged GETs, sha256 checked, committed in staging)

The server is moto's S3 server on 127.0.0.1 (tests/services/s3.sh), or --endpoint URL of
another S3-compatible one (its bucket --bucket must exist).

    .venv/bin/python benchmarks/bench_upload.py [--mb 256] [--files 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from _common import machine, median, s3_bucket, table


def make_data(where: Path, mb: int, files: int) -> tuple[Path, Path]:
    one = where / "one.bin"
    with open(one, "wb") as f:
        for _ in range(mb):
            f.write(os.urandom(1 << 20))
    many = where / "many"
    many.mkdir()
    each = mb // files
    for i in range(files):
        with open(many / f"part-{i}.bin", "wb") as f:
            for _ in range(each):
                f.write(os.urandom(1 << 20))
    return one, many


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--endpoint", default=None)
    p.add_argument("--bucket", default=None)
    args = p.parse_args()
    with s3_bucket(args.endpoint, args.bucket) as bucket:
        run(args, str(os.environ["AWS_ENDPOINT_URL"]), bucket)


def raw_get(raw: object, keys: list[str], target: Path) -> float:
    """obstore.get of each key, streamed into a local file; seconds taken."""
    import obstore

    t0 = time.perf_counter()
    for key in keys:
        with open(target, "wb") as f:
            for chunk in obstore.get(raw, key).stream(min_chunk_size=8 << 20):
                f.write(chunk)
    return time.perf_counter() - t0


def run(args: argparse.Namespace, endpoint: str, bucket: str) -> None:
    import obstore
    from obstore.store import S3Store

    from preemptible import CheckpointStore

    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        staging = str(work / "staging")
        os.environ["PREEMPTIBLE_STAGING_DIR"] = staging
        one, many = make_data(work, args.mb, args.files)
        raw = S3Store(bucket, prefix="raw", client_options={"allow_http": True})
        store = CheckpointStore(f"s3://{bucket}/mirror", keep=1)
        assert store.lock() and store.mirror is not None
        mirror = store.mirror
        labels = ("one file", f"{args.files} files")
        up: dict[str, dict[str, list[float]]] = {k: {"raw": [], "mirror": []} for k in labels}
        down: dict[str, dict[str, list[float]]] = {k: {"raw": [], "mirror": []} for k in labels}
        for i in range(args.repeats):
            for label, source in zip(labels, (one, many), strict=True):
                paths = sorted(source.iterdir()) if source.is_dir() else [source]
                keys = [f"{i}/{path.name}" for path in paths]
                t0 = time.perf_counter()
                for key, path in zip(keys, paths, strict=True):
                    obstore.put(raw, key, path)
                up[label]["raw"].append(time.perf_counter() - t0)
                down[label]["raw"].append(raw_get(raw, keys, work / "raw-get"))
                obstore.delete(raw, keys)
                # the checkpoint as the store has it once committed: a name in staging
                name = f"step-{2 * i + (label != 'one file'):010d}.ckpt"
                staged = store.directory / name
                if source.is_dir():
                    staged.mkdir()
                    for path in paths:
                        os.link(path, staged / path.name)
                else:
                    os.link(source, staged)
                t0 = time.perf_counter()
                mirror.enqueue(name, staged)
                assert mirror.flush(time.monotonic() + 600), mirror.failed
                up[label]["mirror"].append(time.perf_counter() - t0)
                # a new machine: an empty staging directory brings it back
                os.environ["PREEMPTIBLE_STAGING_DIR"] = str(work / f"machine-{i}-{name}")
                t0 = time.perf_counter()
                CheckpointStore(f"s3://{bucket}/mirror", keep=1)
                down[label]["mirror"].append(time.perf_counter() - t0)
                os.environ["PREEMPTIBLE_STAGING_DIR"] = staging
        store.unlock()
    mb = args.mb * (1 << 20) / 1e6
    rows = []
    for what, results in (("upload", up), ("download", down)):
        for label in labels:
            plain, ours = median(results[label]["raw"]), median(results[label]["mirror"])
            rows.append(
                [
                    what,
                    f"{label}, {args.mb} MiB",
                    f"{plain:.2f} s ({mb / plain:.0f} MB/s)",
                    f"{ours:.2f} s ({mb / ours:.0f} MB/s)",
                    f"{plain / ours:.2f}x",
                ]
            )
    print(f"machine: {machine()}")
    print(f"server: moto_server on 127.0.0.1 ({endpoint}); median of {args.repeats}")
    print(
        table(
            ["", "checkpoint", "obstore (put / get)", "preemptible (mirror / new store)", "ratio"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
