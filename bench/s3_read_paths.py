"""Where a pull's time goes: the same 1 GiB object read from one loopback SeaweedFS by three client paths, in one
run, against s5cmd (the anchor), each into a file with ranged GETs in flight at once.

    .venv/bin/python bench/s3_read_paths.py [--size 1G] [--parts 64M] [--workers 8]

- botocore: `get_object(Range=...)` + `iter_chunks(1 MiB)` + `os.pwrite` (what `S3Store.iter_range` does);
- http.client: a presigned URL (signed locally by botocore) read over one persistent connection per thread,
  `read(1 MiB)` + `os.pwrite`, the sha256 following the contiguous written frontier from the main thread;
- s5cmd `cp` of the object (no hashing).

On 2026-12-05 (2 cores, quiet): botocore 1.58 s (1.47x s5cmd), http.client with the hash 1.08 s (1.01x), s5cmd
1.08 s. S3Store.iter_range now reads the second way (pipelines/store/s3_ranges.py) and the blob cache hashes
behind the written frontier: `hive-aot pull` of 1 GiB (bench/pull_s3.py) went from 2.6-2.8 s to 2.1 s, in process
from 3.5 s to 1.46 s; what the CLI child adds is the next thing to profile (the issue 26 notes).
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))
CHUNK = 1 << 20


def botocore_path(client, bucket: str, key: str, fd: int, parts: list[tuple[int, int]], workers: int) -> None:
    def one(part: tuple[int, int]) -> None:
        start, n = part
        at = start
        for chunk in client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + n - 1}")["Body"].iter_chunks(CHUNK):
            os.pwrite(fd, chunk, at)
            at += len(chunk)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, parts))


def http_client_path(client, bucket: str, key: str, fd: int, parts: list[tuple[int, int]], workers: int,
                     size: int) -> str:
    url = urlsplit(client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=3600))
    local, filled = threading.local(), [0] * len(parts)

    def one(index: int) -> None:
        start, n = parts[index]
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = http.client.HTTPConnection(url.netloc, timeout=60)
        conn.request("GET", f"{url.path}?{url.query}", headers={"Range": f"bytes={start}-{start + n - 1}"})
        resp = conn.getresponse()
        if resp.status != 206:
            raise RuntimeError(f"HTTP {resp.status}")
        got = 0
        while got < n:
            data = resp.read(min(CHUNK, n - got))
            if not data:
                raise RuntimeError("short body")
            os.pwrite(fd, data, start + got)
            got += len(data)
            filled[index] = got

    hasher, at = hashlib.sha256(), 0
    part = parts[0][1] or 1
    with ThreadPoolExecutor(workers) as pool:
        pending = {pool.submit(one, i) for i in range(len(parts))}
        while True:
            if pending:
                finished, pending = wait(pending, timeout=0.02, return_when=FIRST_COMPLETED)
                for f in finished:
                    f.result()
            index = min(at // part, len(parts) - 1)
            frontier = parts[index][0] + filled[index]
            while at < frontier:
                n = min(8 << 20, frontier - at)
                hasher.update(os.pread(fd, n, at))
                at += n
            if not pending and at >= size:
                return hasher.hexdigest()


def main() -> int:
    import boto3
    from pull_s3 import s5cmd_binary, write_random
    from s3_server import BUCKET, seaweedfs

    from pipelines.core.paths import cache_root
    from pipelines.core.units import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--parts", default="64M", help="bytes per ranged GET")
    ap.add_argument("--workers", type=int, default=8, help="ranged GETs in flight")
    args = ap.parse_args()
    size, part = parse_size(args.size, "--size"), parse_size(args.parts, "--parts")
    parts = [(start, min(part, size - start)) for start in range(0, size, part)]
    work = Path(tempfile.mkdtemp(prefix="bench-s3-read-"))
    try:
        src = work / "src.bin"
        digest = write_random(src, size)
        s5cmd = s5cmd_binary(cache_root())
        with seaweedfs(work / "weed") as endpoint:
            client = boto3.client("s3")
            client.upload_file(str(src), BUCKET, "blob")
            walls = {}
            for name in ("botocore", "http.client + frontier sha256"):
                out = work / "out.bin"
                fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                os.ftruncate(fd, size)
                t0 = time.perf_counter()
                if name == "botocore":
                    botocore_path(client, BUCKET, "blob", fd, parts, args.workers)
                else:
                    assert http_client_path(client, BUCKET, "blob", fd, parts, args.workers, size) == digest
                walls[name] = time.perf_counter() - t0
                os.close(fd)
                out.unlink()
            t0 = time.perf_counter()
            subprocess.run([str(s5cmd), "--endpoint-url", endpoint, "cp", f"s3://{BUCKET}/blob", str(work / "s5.bin")],
                           check=True, capture_output=True)
            walls["s5cmd cp (anchor)"] = time.perf_counter() - t0
        anchor = walls["s5cmd cp (anchor)"]
        print(f"{size / 2**30:.1f} GiB, {len(parts)} ranges x {args.parts}, {args.workers} in flight:")
        for name, wall in walls.items():
            print(f"  {name:32} {wall:6.2f} s  {wall / anchor:5.2f}x s5cmd")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
