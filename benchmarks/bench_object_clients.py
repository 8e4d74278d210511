"""Which object-store client for the checkpoint mirror (issue 32, item 6): measured, not assumed.

Against local protocol servers this script starts itself (moto's standalone S3 server and, when
tests/services/azurite.sh can install it, Azurite for Azure Blob), median of --repeats:

  upload    one object of --mb MiB, and 16 objects of --mb/16 MiB (8 at a time), from a file in
            /dev/shm, each client's own file upload (obstore.put of a Path: multipart, 5 MiB
            parts, and again with 16 MiB parts; boto3's upload_file: s3transfer's multipart;
            s3fs.put_file; azure-storage-blob's upload_blob with max_concurrency=8): MB/s, and
            the client process's CPU seconds per GB
  download  the same objects back into files in /dev/shm
  create    a create-only put (If-None-Match: *), twice: honoured when the second one fails
  if-match  an update with the current ETag, then one with the stale ETag: honoured when the
            second one fails
  import    `import CLIENT` (and that plus making one client object, no request) in a fresh
            interpreter, in ms

The servers are the bottleneck here as much as the clients (moto is Python; everything runs on
this machine's cores), so the ratios compare clients on one server, never servers; the CPU column
is the client's own cost and does not depend on the server.

    .venv/bin/python benchmarks/bench_object_clients.py [--mb 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import machine, median, table

ROOT = Path(__file__).resolve().parent.parent
AZURITE_SH = ROOT / "tests" / "services" / "azurite.sh"
# Azurite's documented, public development account (not a secret)
AZ_ACCOUNT = "devstoreaccount1"
AZ_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
TIMEOUT_S = 300
PARALLEL = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, proc: subprocess.Popen[bytes] | None, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {deadline_s:.0f} s")


@contextlib.contextmanager
def moto_server(work: Path) -> Iterator[str]:
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    log = open(work / "moto.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        wait_listening(port, proc, 30)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def azurite(work: Path) -> Iterator[str | None]:
    """Azurite's endpoint, or None (said on stderr) where it cannot be installed here."""
    directory = work / "azurite"
    up = subprocess.run(
        ["bash", str(AZURITE_SH), "up", str(directory)], capture_output=True, text=True, timeout=600
    )
    try:
        if up.returncode != 0:
            print(f"no Azurite, Azure rows left out: {up.stderr.strip()}", file=sys.stderr)
            yield None
        else:
            yield up.stdout.strip()
    finally:
        subprocess.run(["bash", str(AZURITE_SH), "down", str(directory)], timeout=120)


# ---------------------------------------------------------------- the clients, one interface


@dataclass
class Client:
    name: str
    upload: Callable[[Path, str], None]
    download: Callable[[str, Path], None]
    delete: Callable[[str], None]
    put_create: Callable[[str, bytes], None]  # create-only put; raises when it exists
    put_plain: Callable[[str, bytes], str]  # returns the ETag
    put_if_match: Callable[[str, bytes, str], str]  # raises when the ETag is not current
    note: str = ""
    results: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    create: str = "?"
    if_match: str = "?"


def obstore_client(name: str, store: Any, part_mb: int | None = None) -> Client:
    """obstore's own put of a file; ``part_mb``: its multipart part size (default 5 MiB)."""
    import obstore

    parts = {} if part_mb is None else {"chunk_size": part_mb << 20}

    def upload(src: Path, key: str) -> None:
        obstore.put(store, key, src, **parts)

    def download(key: str, dst: Path) -> None:
        with open(dst, "wb") as fh:
            for chunk in obstore.get(store, key):
                fh.write(chunk)

    def put_create(key: str, data: bytes) -> None:
        obstore.put(store, key, data, mode="create")

    def put_plain(key: str, data: bytes) -> str:
        return str(obstore.put(store, key, data)["e_tag"])

    def put_if_match(key: str, data: bytes, etag: str) -> str:
        return str(obstore.put(store, key, data, mode={"e_tag": etag})["e_tag"])

    return Client(
        name,
        upload,
        download,
        lambda key: obstore.delete(store, key),
        put_create,
        put_plain,
        put_if_match,
    )


def obstore_s3(endpoint: str, bucket: str, part_mb: int | None = None) -> Client:
    from obstore.store import S3Store

    store = S3Store(
        bucket,
        endpoint=endpoint,
        region="us-east-1",
        access_key_id="testing",
        secret_access_key="testing",
        client_options={"allow_http": True, "timeout": f"{TIMEOUT_S}s"},
    )
    return obstore_client(_obstore_name(part_mb), store, part_mb)


def _obstore_name(part_mb: int | None) -> str:
    return "obstore" if part_mb is None else f"obstore, {part_mb} MiB parts"


def obstore_azure(endpoint: str, container: str, part_mb: int | None = None) -> Client:
    from obstore.store import AzureStore

    store = AzureStore(
        container,
        account_name=AZ_ACCOUNT,
        account_key=AZ_KEY,
        endpoint=f"{endpoint}/{AZ_ACCOUNT}",
        client_options={"allow_http": True, "timeout": f"{TIMEOUT_S}s"},
    )
    return obstore_client(_obstore_name(part_mb), store, part_mb)


def boto3_s3(endpoint: str, bucket: str) -> Client:
    import boto3
    from botocore.config import Config

    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(connect_timeout=30, read_timeout=TIMEOUT_S, max_pool_connections=16),
    )

    def put_plain(key: str, data: bytes) -> str:
        return str(s3.put_object(Bucket=bucket, Key=key, Body=data)["ETag"])

    def put_if_match(key: str, data: bytes, etag: str) -> str:
        return str(s3.put_object(Bucket=bucket, Key=key, Body=data, IfMatch=etag)["ETag"])

    return Client(
        "boto3 (s3transfer)",
        lambda src, key: s3.upload_file(str(src), bucket, key),
        lambda key, dst: s3.download_file(bucket, key, str(dst)),
        lambda key: s3.delete_object(Bucket=bucket, Key=key),
        lambda key, data: s3.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*"),
        put_plain,
        put_if_match,
    )


def s3fs_s3(endpoint: str, bucket: str) -> Client:
    import s3fs

    opts: dict[str, Any] = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "config_kwargs": {"connect_timeout": 30, "read_timeout": TIMEOUT_S},
    }
    fs = s3fs.S3FileSystem(**opts)
    # create-only: the fsspec API has `pipe_file(..., mode="create")` in s3fs >= 2024.12; an older
    # s3fs has only extra put_object arguments on every write of a file system object
    create_fs = s3fs.S3FileSystem(**opts, s3_additional_kwargs={"IfNoneMatch": "*"})

    def put_create(key: str, data: bytes) -> None:
        if hasattr(fs, "_pipe_file"):
            fs.pipe_file(f"{bucket}/{key}", data, mode="create")
        else:
            with create_fs.open(f"{bucket}/{key}", "wb") as fh:
                fh.write(data)

    def put_plain(key: str, data: bytes) -> str:
        with fs.open(f"{bucket}/{key}", "wb") as fh:
            fh.write(data)
        fs.invalidate_cache()
        return str(fs.info(f"{bucket}/{key}")["ETag"])

    def put_if_match(key: str, data: bytes, etag: str) -> str:
        match_fs = s3fs.S3FileSystem(**opts, s3_additional_kwargs={"IfMatch": etag})
        with match_fs.open(f"{bucket}/{key}", "wb") as fh:
            fh.write(data)
        fs.invalidate_cache()
        return str(fs.info(f"{bucket}/{key}")["ETag"])

    return Client(
        "s3fs",
        lambda src, key: fs.put_file(str(src), f"{bucket}/{key}"),
        lambda key, dst: fs.get_file(f"{bucket}/{key}", str(dst)),
        lambda key: fs.rm(f"{bucket}/{key}"),
        put_create,
        put_plain,
        put_if_match,
        note=f"s3fs {s3fs.__version__}"
        + ("" if hasattr(fs, "_pipe_file") else ", conditionals by s3_additional_kwargs"),
    )


def azure_sdk(endpoint: str, container: str) -> Client:
    from azure.core import MatchConditions
    from azure.storage.blob import BlobServiceClient

    conn = (
        f"DefaultEndpointsProtocol=http;AccountName={AZ_ACCOUNT};AccountKey={AZ_KEY};"
        f"BlobEndpoint={endpoint}/{AZ_ACCOUNT};"
    )
    service = BlobServiceClient.from_connection_string(
        conn, connection_timeout=30, read_timeout=TIMEOUT_S
    )
    cc = service.get_container_client(container)

    def upload(src: Path, key: str) -> None:
        with open(src, "rb") as fh:
            cc.upload_blob(key, fh, overwrite=True, max_concurrency=PARALLEL)

    def download(key: str, dst: Path) -> None:
        with open(dst, "wb") as fh:
            cc.download_blob(key, max_concurrency=PARALLEL).readinto(fh)

    def put_plain(key: str, data: bytes) -> str:
        return str(cc.get_blob_client(key).upload_blob(data, overwrite=True)["etag"])

    def put_if_match(key: str, data: bytes, etag: str) -> str:
        out = cc.get_blob_client(key).upload_blob(
            data, overwrite=True, etag=etag, match_condition=MatchConditions.IfNotModified
        )
        return str(out["etag"])

    return Client(
        "azure-storage-blob",
        upload,
        download,
        lambda key: cc.delete_blob(key),
        lambda key, data: cc.upload_blob(key, data, overwrite=False),
        put_plain,
        put_if_match,
    )


# ---------------------------------------------------------------- measurements


def why(exc: Exception) -> str:
    """The exception's class, and the service's error code where the client gives one."""
    response = getattr(exc, "response", None)  # botocore's is a dict, azure-core's is not
    code = getattr(exc, "error_code", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
    return f"{type(exc).__name__} {code}" if code else type(exc).__name__


def check_conditionals(client: Client) -> None:
    key = f"cond/{uuid.uuid4().hex}"
    try:
        client.put_create(key, b"first")
    except Exception as exc:
        client.create = f"error: {why(exc)}"
    else:
        try:
            client.put_create(key, b"second")
            client.create = "IGNORED (2nd create succeeded)"
        except Exception as exc:
            client.create = f"honoured ({why(exc)})"
    key = f"cond/{uuid.uuid4().hex}"
    try:
        old = client.put_plain(key, b"v1")
        client.put_if_match(key, b"v2", old)
    except Exception as exc:
        client.if_match = f"error: {why(exc)}"
        return
    try:
        client.put_if_match(key, b"v3", old)
        client.if_match = "IGNORED (stale ETag accepted)"
    except Exception as exc:
        client.if_match = f"honoured ({why(exc)})"


def timed(
    client: Client,
    key: str,
    nbytes: int,
    pool: ThreadPoolExecutor,
    fn: Callable[[Any, Any], None],
    pairs: list[tuple[Any, Any]],
) -> None:
    cpu0, t0 = time.process_time(), time.perf_counter()
    list(pool.map(lambda pair: fn(*pair), pairs))
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    client.results.setdefault(key, []).append(nbytes / wall / 1e6)
    client.cpu.setdefault(key, []).append(cpu / (nbytes / 1e9))


def measure(client: Client, files: dict[str, list[Path]], work: Path, repeats: int) -> None:
    with ThreadPoolExecutor(PARALLEL) as pool:
        for _ in range(repeats):
            for label, srcs in files.items():
                keys = [f"bench/{uuid.uuid4().hex}/{src.name}" for src in srcs]
                outs = [work / f"out-{i}" for i in range(len(keys))]
                nbytes = sum(src.stat().st_size for src in srcs)
                ups = list(zip(srcs, keys, strict=True))
                timed(client, f"up {label}", nbytes, pool, client.upload, ups)
                downs = list(zip(keys, outs, strict=True))
                timed(client, f"down {label}", nbytes, pool, client.download, downs)
                for src, out in zip(srcs, outs, strict=True):
                    if out.stat().st_size != src.stat().st_size:
                        raise RuntimeError(f"{client.name}: downloaded {out} has the wrong size")
                    out.unlink()
                for key in keys:
                    client.delete(key)


IMPORTS = {
    "obstore": (
        "import obstore; from obstore.store import S3Store",
        "S3Store('b', region='us-east-1', skip_signature=True)",
    ),
    "boto3 (s3transfer)": (
        "import boto3; import s3transfer",
        "boto3.client('s3', region_name='us-east-1')",
    ),
    "s3fs": ("import s3fs", "s3fs.S3FileSystem(anon=True)"),
    "azure-storage-blob": (
        "from azure.storage.blob import BlobServiceClient",
        "BlobServiceClient('https://a.blob.core.windows.net')",
    ),
}


def import_ms(code: str, make: str) -> tuple[float, float]:
    script = (
        "import time; t0 = time.perf_counter()\n"
        f"{code}\n"
        "t1 = time.perf_counter()\n"
        f"{make}\n"
        "t2 = time.perf_counter(); print((t1 - t0) * 1e3, (t2 - t0) * 1e3)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    return float(out[0]), float(out[1])


def ratio(value: float, best: float, higher_is_better: bool) -> str:
    r = value / best if higher_is_better else best / value
    return f"{r:.2f}x"


def throughput_table(clients: list[Client], labels: list[str]) -> str:
    """MB/s with the ratio to the fastest client on this server, then the client's own CPU
    seconds per GB moved, then whether the conditional puts were honoured."""
    best = {lab: max(median(c.results[lab]) for c in clients) for lab in labels}
    rows = []
    for c in clients:
        row: list[object] = [c.name + (f" ({c.note})" if c.note else "")]
        for lab in labels:
            v = median(c.results[lab])
            row.append(f"{v:.0f} ({ratio(v, best[lab], True)})")
        rows.append(row)
    out = table(["client", *[f"{lab} MB/s" for lab in labels]], rows)
    rows = [[c.name, *[f"{median(c.cpu[lab]):.2f}" for lab in labels]] for c in clients]
    out += "\n\nclient CPU seconds per GB moved:\n\n"
    out += table(["client", *labels], rows)
    out += "\n\nconditional puts through the client:\n\n"
    out += table(
        ["client", "create-only (If-None-Match: *)", "update If-Match"],
        [[c.name, c.create, c.if_match] for c in clients],
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=256, help="bytes per round, in MiB")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(f"machine: {machine()}")
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="bench-objects-", dir=base) as d:
        work = Path(d)
        one = work / "one.bin"
        one.write_bytes(os.urandom(args.mb << 20))
        parts = []
        for i in range(16):
            part = work / f"part-{i:02d}.bin"
            part.write_bytes(os.urandom((args.mb << 20) // 16))
            parts.append(part)
        files = {f"1x{args.mb}MB": [one], f"16x{args.mb / 16:g}MB": parts}
        labels = [f"{w} {lab}" for w in ("up", "down") for lab in files]

        import boto3
        from azure.storage.blob import BlobServiceClient

        with moto_server(work) as s3_endpoint, azurite(work) as az_endpoint:
            boto3.client(
                "s3",
                endpoint_url=s3_endpoint,
                region_name="us-east-1",
                aws_access_key_id="testing",
                aws_secret_access_key="testing",
            ).create_bucket(Bucket="bench")
            print(f"\n## S3 protocol: moto_server at {s3_endpoint}, {args.mb} MiB a round\n")
            s3_clients = [
                obstore_s3(s3_endpoint, "bench"),
                obstore_s3(s3_endpoint, "bench", part_mb=16),
                boto3_s3(s3_endpoint, "bench"),
                s3fs_s3(s3_endpoint, "bench"),
            ]
            for c in s3_clients:
                check_conditionals(c)
            for _ in range(args.repeats):  # interleaved: a drift in the server hits all alike
                for c in s3_clients:
                    measure(c, files, work, 1)
            print(throughput_table(s3_clients, labels))
            if az_endpoint is not None:
                conn = (
                    f"DefaultEndpointsProtocol=http;AccountName={AZ_ACCOUNT};"
                    f"AccountKey={AZ_KEY};BlobEndpoint={az_endpoint}/{AZ_ACCOUNT};"
                )
                BlobServiceClient.from_connection_string(conn).create_container("bench")
                print(f"\n## Azure Blob: Azurite at {az_endpoint}, {args.mb} MiB a round\n")
                az_clients = [
                    obstore_azure(az_endpoint, "bench"),
                    obstore_azure(az_endpoint, "bench", part_mb=16),
                    azure_sdk(az_endpoint, "bench"),
                ]
                for c in az_clients:
                    check_conditionals(c)
                for _ in range(args.repeats):
                    for c in az_clients:
                        measure(c, files, work, 1)
                print(throughput_table(az_clients, labels))

    print("\n## Import time, fresh interpreter (ms)\n")
    times = {name: [import_ms(*c) for _ in range(args.repeats)] for name, c in IMPORTS.items()}
    best_import = min(median([t[0] for t in ts]) for ts in times.values())
    best_client = min(median([t[1] for t in ts]) for ts in times.values())
    rows = []
    for name, ts in times.items():
        imp, cli = median([t[0] for t in ts]), median([t[1] for t in ts])
        rows.append(
            [
                name,
                f"{imp:.0f}",
                ratio(imp, best_import, False),
                f"{cli:.0f}",
                ratio(cli, best_client, False),
            ]
        )
    print(table(["client", "import ms", "vs best", "import + client ms", "vs best"], rows))
    print(f"\nmedians of {args.repeats}; ratios: this client against the fastest (1.00x)")


if __name__ == "__main__":
    main()
