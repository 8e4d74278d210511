"""Upload throughput of a committed checkpoint through the mirror, against obstore's own put of
the same bytes to the same server.

Side by side in one run, interleaved, median of --repeats, for one file of --mb MiB and for a
directory of --files files of the same total:
  obstore.put   obstore.put(store, key, Path(file)) for each file, one after another: the
                client's own upload (multipart for large files), nothing else
  mirror        what a URL's store does after a save is committed in staging: the hard-linked
                snapshot, sha256 of every file, the same puts under a fresh upload id, the
                manifest (create-only), retention; timed from the hand-over (enqueue) to the
                end of flush()

The server is moto's S3 server on 127.0.0.1 (tests/services/s3.sh), or --endpoint URL of
another S3-compatible one (its bucket --bucket must exist).

    .venv/bin/python benchmarks/bench_upload.py [--mb 256] [--files 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from _common import machine, median, table

ROOT = Path(__file__).resolve().parent.parent
S3_SCRIPT = ROOT / "tests" / "services" / "s3.sh"


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
    server_dir = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    endpoint = args.endpoint
    if endpoint is None:
        endpoint = subprocess.run(
            ["bash", str(S3_SCRIPT), "up", str(server_dir / "s3")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    bucket = args.bucket or f"bench-{uuid.uuid4().hex[:12]}"
    try:
        if args.bucket is None:
            request = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")
            urllib.request.urlopen(request, timeout=30).close()
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ALLOW_HTTP="true",
            AWS_ACCESS_KEY_ID=os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
            AWS_SECRET_ACCESS_KEY=os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
            AWS_REGION=os.environ.get("AWS_REGION", "us-east-1"),
        )
        run(args, endpoint, bucket)
    finally:
        if args.endpoint is None:
            subprocess.run(["bash", str(S3_SCRIPT), "down", str(server_dir / "s3")], check=False)
        with contextlib.suppress(OSError):
            server_dir.rmdir()


def run(args: argparse.Namespace, endpoint: str, bucket: str) -> None:
    import obstore
    from obstore.store import S3Store

    from preemptible import CheckpointStore

    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        os.environ["PREEMPTIBLE_STAGING_DIR"] = str(work / "staging")
        one, many = make_data(work, args.mb, args.files)
        raw = S3Store(bucket, prefix="raw", client_options={"allow_http": True})
        store = CheckpointStore(f"s3://{bucket}/mirror", keep=1)
        assert store.lock() and store.mirror is not None
        mirror = store.mirror
        results: dict[str, dict[str, list[float]]] = {
            "one file": {"obstore.put": [], "mirror": []},
            f"{args.files} files": {"obstore.put": [], "mirror": []},
        }
        for i in range(args.repeats):
            for label, source in (("one file", one), (f"{args.files} files", many)):
                paths = sorted(source.iterdir()) if source.is_dir() else [source]
                t0 = time.perf_counter()
                for path in paths:
                    obstore.put(raw, f"{i}/{path.name}", path)
                results[label]["obstore.put"].append(time.perf_counter() - t0)
                obstore.delete(raw, [f"{i}/{path.name}" for path in paths])
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
                results[label]["mirror"].append(time.perf_counter() - t0)
        store.unlock()
    mib = args.mb * (1 << 20) / 1e6
    rows = []
    for label, timings in results.items():
        put, mir = median(timings["obstore.put"]), median(timings["mirror"])
        rows.append(
            [
                label,
                f"{args.mb} MiB",
                f"{put:.2f} s ({mib / put:.0f} MB/s)",
                f"{mir:.2f} s ({mib / mir:.0f} MB/s)",
                f"{put / mir:.2f}x",
            ]
        )
    print(f"machine: {machine()}")
    print(f"server: moto_server on 127.0.0.1 ({endpoint}); median of {args.repeats}")
    print(
        table(
            ["checkpoint", "size", "obstore.put", "mirror (upload + commit)", "mirror / raw"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
