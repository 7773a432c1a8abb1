"""The pull's blob cache: resumable part by part (local and S3 stores), one download per digest per host,
dead pulls' partials reclaimed without touching live ones, and a fault loop of killed `hive-aot pull`s.

Interruptions are real: a store whose reads fail after some parts (as a dropped connection does), and
`kill -9` of the CLI at random moments. What must hold after each: the destination is absent or complete
and verified, the cache holds no blob under its digest that is not the blob, and the next pull fetches
only what the killed one had not written."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipelines.client.blob_batch import fetch_blobs
from pipelines.client.blob_cache import TransferStats, blob_path, fetch_blob, missing_bytes, parts_of
from pipelines.client.blob_leftovers import reclaim_partials
from pipelines.core.errors import IntegrityError, StoreError
from pipelines.core.hashing import sha256_file
from pipelines.store import open_store

PART = 64 << 10


class Flaky:
    """A store whose ranged reads stop working after `parts_ok` parts (a connection that drops mid-pull), and
    that counts the bytes it serves. Everything else is the wrapped store's."""

    def __init__(self, store, parts_ok: int | None = None, gate: threading.Event | None = None):
        self.store, self.parts_ok, self.gate = store, parts_ok, gate
        self.served, self.parts, self.completed, self.lock = 0, 0, 0, threading.Lock()
        self.uri = store.uri

    def iter_range(self, key, start, length):
        with self.lock:
            self.parts += 1
            fail = self.parts_ok is not None and self.parts > self.parts_ok
        if self.gate is not None:
            self.gate.wait(30)
        if fail:
            raise StoreError(f"{self.uri}: cannot read {key} (connection reset)")
        for chunk in self.store.iter_range(key, start, length):
            with self.lock:
                self.served += len(chunk)
            yield chunk
        with self.lock:
            self.completed += 1  # the reader wrote this part's last chunk before asking for more


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("HIVE_AOT_CACHE", str(cache))
    return cache


def _blob(store, tmp_path, size: int, seed: int = 0) -> tuple[str, int]:
    f = tmp_path / f"blob-{seed}.bin"
    f.write_bytes(random.Random(seed).randbytes(size))
    return store.put_blob(f), size


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_an_interrupted_fetch_resumes_with_only_the_missing_parts(kind, fresh_cache, tmp_path, request):
    store = open_store(str(tmp_path / "store") if kind == "local" else request.getfixturevalue("s3_uri"))
    digest, size = _blob(store, tmp_path, 10 * PART + 123)  # 11 parts, the last a short one
    flaky = Flaky(store, parts_ok=4)
    with pytest.raises(StoreError, match="connection reset"):
        fetch_blob(flaky, digest, size, part_bytes=PART, workers=1)
    assert not blob_path(digest).exists()  # nothing under the digest's name until it verifies
    left = missing_bytes(digest, size)
    assert left == size - 4 * PART  # the 4 parts that came are on disk and recorded

    again, stats = Flaky(store), TransferStats()
    path = fetch_blob(again, digest, size, part_bytes=PART, stats=stats)
    assert sha256_file(path) == digest and path.stat().st_mode & 0o777 == 0o644
    assert again.served == stats.fetched == left and stats.resumed == 4 * PART
    # no partial, part list or lock left; the stamp of its verification (blob_stamps.py)
    assert sorted(p.name for p in path.parent.iterdir()) == [f".{digest}.verified", digest]


def test_parts_kept_from_a_damaged_partial_are_fetched_again_from_scratch(fresh_cache, tmp_path):
    """A crash can lose pages a part list says were written: the whole blob is verified, and a resumed blob that
    does not verify is fetched once more from nothing (a second mismatch is the store's)."""
    store = open_store(str(tmp_path / "store"))
    digest, size = _blob(store, tmp_path, 6 * PART)
    with pytest.raises(StoreError):
        fetch_blob(Flaky(store, parts_ok=3), digest, size, part_bytes=PART, workers=1)
    partial = blob_path(digest).with_name(f".{digest}.partial")
    with open(partial, "r+b") as f:  # zero a page inside a part recorded as done
        f.seek(PART + 100)
        f.write(b"\0" * 4096)
    again, stats = Flaky(store), TransferStats()
    path = fetch_blob(again, digest, size, part_bytes=PART, stats=stats)
    assert sha256_file(path) == digest
    assert again.served == size + (size - 3 * PART)  # the rest, then everything once more


def test_a_store_blob_shorter_than_its_manifest_is_refused_and_leaves_nothing(fresh_cache, tmp_path):
    store = open_store(str(tmp_path / "store"))
    digest, size = _blob(store, tmp_path, 3 * PART)
    with pytest.raises(IntegrityError, match=f"blob {digest[:12]} .* does not match its manifest sha256") as ei:
        fetch_blob(store, digest, size + 10, part_bytes=PART)
    assert "\n" not in str(ei.value)
    assert not any(p.is_file() for p in (fresh_cache / "blobs").rglob("*"))


def _wait_for_lock_waiters(lock: Path, count: int, timeout: float = 30) -> None:
    """Until `count` flock requests wait on `lock` (the kernel lists each blocked one in /proc/locks as
    `N: -> FLOCK ... MAJ:MIN:INODE ...`)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            inode = os.stat(lock).st_ino
            waiting = sum(1 for line in Path("/proc/locks").read_text().splitlines()
                          if "->" in line and line.split()[6].rsplit(":", 1)[-1] == str(inode))
        except FileNotFoundError:
            waiting = 0
        if waiting >= count:
            return
        assert time.monotonic() < deadline, f"{waiting} of {count} fetches wait on {lock.name}"
        time.sleep(0.005)


def test_concurrent_fetches_of_one_digest_download_it_once(fresh_cache, tmp_path):
    store = open_store(str(tmp_path / "store"))
    digest, size = _blob(store, tmp_path, 5 * PART)
    gate = threading.Event()
    counting = Flaky(store, gate=gate)
    stats = [TransferStats() for _ in range(6)]
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda s=s: paths.append(fetch_blob(counting, digest, size, stats=s,
                                                                           part_bytes=PART))) for s in stats]
    for t in threads:
        t.start()
    # the first holds the digest's lock (and waits at the gate), the five others wait for the lock
    _wait_for_lock_waiters(blob_path(digest).with_name(f".{digest}.lock"), 5)
    gate.set()
    for t in threads:
        t.join(60)
    assert len(paths) == 6 and len(set(paths)) == 1 and sha256_file(paths[0]) == digest
    assert counting.served == size  # downloaded once
    assert sorted(s.cached_blobs for s in stats) == [0, 1, 1, 1, 1, 1]


class Together(Flaky):
    """Holds the first read of each blob until `count` blobs are being read at once (a barrier): fetches done one
    after another break it."""

    def __init__(self, store, count: int, refuse: str | None = None, timeout: float = 30):
        super().__init__(store)
        self.barrier, self.seen, self.refuse = threading.Barrier(count, timeout=timeout), set(), refuse

    def iter_range(self, key, start, length):
        with self.lock:
            first = key not in self.seen
            self.seen.add(key)
        if first:
            self.barrier.wait()
        if self.refuse and key.endswith(self.refuse):
            raise StoreError(f"{self.uri}: cannot read {key} (connection reset)")
        yield from super().iter_range(key, start, length)


def test_several_blobs_are_fetched_at_once_and_the_first_failure_is_raised(fresh_cache, tmp_path, monkeypatch):
    """A sharded artifact's files are fetched several at a time (each blob's sha256 runs on its own core): all are
    in flight together. A blob the store cannot serve fails the fetch in one line; the others are complete or
    resumable, never half-visible."""
    monkeypatch.setenv("HIVE_AOT_PULL_PART_SIZE", str(PART))
    store = open_store(str(tmp_path / "store"))
    sizes = dict(_blob(store, tmp_path, 3 * PART + i, seed=i) for i in range(3))
    stats = TransferStats()
    paths = fetch_blobs(Together(store, 3), sizes, stats=stats, at_once=3)  # CachedBlob: path, verified stat
    assert {d: sha256_file(b.path) for d, b in paths.items()} == {d: d for d in sizes}
    assert stats.fetched == sum(sizes.values())

    shutil.rmtree(fresh_cache)
    broken = sorted(sizes)[1]
    with pytest.raises(StoreError, match="connection reset") as failed:
        fetch_blobs(Together(store, 3, refuse=broken), sizes, at_once=3)
    assert "\n" not in str(failed.value) and not blob_path(broken).exists()
    for d in sizes:  # the others: whole and verified, or absent
        assert not blob_path(d).exists() or sha256_file(blob_path(d)) == d
    shutil.rmtree(fresh_cache)
    with pytest.raises(threading.BrokenBarrierError):  # one at a time: the barrier never fills
        fetch_blobs(Together(store, 2, timeout=1), sizes, at_once=1)


def test_reclaim_takes_dead_old_partials_keeps_young_live_and_resumed_ones(fresh_cache, tmp_path):
    store = open_store(str(tmp_path / "store"))
    digests = [_blob(store, tmp_path, 2 * PART, seed=i)[0] for i in range(4)]
    for d in digests:
        with pytest.raises(StoreError):
            fetch_blob(Flaky(store, parts_ok=1), d, 2 * PART, part_bytes=PART, workers=1)
    old = time.time() - 3 * 24 * 3600
    for d in digests[1:]:
        for p in blob_path(d).parent.glob(f".{d}.*"):
            os.utime(p, (old, old))
    live = blob_path(digests[2]).with_name(f".{digests[2]}.lock")
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(live)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        removed = reclaim_partials(keep={digests[3]})
        # young (digests[0]), held by a live pull (2) and about to be resumed (3) stay; only 1 goes
        assert sorted(removed) == [f".{digests[1]}.partial", f".{digests[1]}.parts"]
        assert missing_bytes(digests[0], 2 * PART) == PART and missing_bytes(digests[3], 2 * PART) == PART
    finally:
        holder.kill()
        holder.wait(timeout=30)
    removed = reclaim_partials(max_age_s=0)
    assert (sorted(n for n in removed if n.endswith(".partial"))
            == sorted(f".{d}.partial" for d in (digests[0], digests[2], digests[3])))
    assert f".{digests[2]}.lock" in removed  # the killed holder's lock file
    assert not any(p.name.startswith(".") for p in (fresh_cache / "blobs").rglob("*"))


class SlowHash:
    """A sha256 that takes 20 ms per update (a hash slower than the download, as on a host whose link outruns one
    core's sha256), and interrupts the pull (as a kill -9 would: no code of the pull runs after) once every part is
    written: at the update after the one that first sees them all, so the pull's loop has looked for finished parts
    in between (the interrupt at the first such update raced a loaded host's last part threads: a flaky failure)."""

    def __init__(self, flaky: Flaky, size: int, parts: int):
        self.inner, self.flaky, self.size, self.parts, self.armed = hashlib.sha256(), flaky, size, parts, False

    def update(self, data) -> None:
        if self.flaky.served >= self.size and self.flaky.completed >= self.parts:
            if self.armed:
                raise KeyboardInterrupt
            self.armed = True
        time.sleep(0.02)
        self.inner.update(data)

    def hexdigest(self) -> str:
        return self.inner.hexdigest()


def test_the_part_list_keeps_up_while_the_hash_trails_the_download(fresh_cache, tmp_path, monkeypatch):
    """A kill while the sha256 is still catching up loses none of the parts already written: the part list on
    disk follows the download, not the hash (it was written only when the hash caught up, so a pull killed
    near the end of a long blob resumed from its first parts)."""
    import pipelines.client.blob_cache as blob_cache

    store = open_store(str(tmp_path / "store"))
    digest, size = _blob(store, tmp_path, 24 * PART)
    flaky = Flaky(store)
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(blob_cache, "HASH_READ", PART)  # one update per part: the hash trails by many parts
        m.setattr(blob_cache, "hashlib", SimpleNamespace(sha256=lambda: SlowHash(flaky, size, 24)))
        fetch_blob(flaky, digest, size, part_bytes=PART, workers=4)
    assert flaky.served == size and missing_bytes(digest, size) == 0  # every written part is on the list
    again, stats = Flaky(store), TransferStats()
    assert sha256_file(fetch_blob(again, digest, size, part_bytes=PART, stats=stats)) == digest
    assert again.served == stats.fetched == 0 and stats.resumed == size


def test_parts_cover_the_blob():
    assert parts_of(10, 4) == [(0, 4), (4, 4), (8, 2)] and parts_of(0, 4) == [(0, 0)] and parts_of(8, 4) == [(0, 4), (4, 4)]


KILLS = 15


def _kill_after_parts(proc: subprocess.Popen, state: Path, parts: int) -> bool:
    """SIGKILL `proc` once its part list records `parts` parts; False when it finished first."""
    while proc.poll() is None:
        try:
            done = len(json.loads(state.read_text())["done"])
        except (OSError, ValueError, KeyError):
            done = 0  # not written yet (or mid-rename)
        if done >= parts:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
            return True
        time.sleep(0.001)  # a poll that yields the core to the pull it watches
    return False


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_killed_pulls_resume_and_never_leave_a_half_destination(kind, tmp_path, request, record_property):
    """The fault loop: `hive-aot pull` of a 16 MiB artifact (256 parts of 64 KiB, 8 at a time) killed with SIGKILL
    at a random point of its download, 15 times, then pulled to the end. After every kill DIR is absent and no
    blob sits under the digest's name; the pull that finishes fetches only what the killed ones had not written;
    after `gc`, no partial, part list or lock is left."""
    from pipelines.store.layout import manifest_key, ref_key
    from pipelines.store.manifest import FileEntry, Manifest, ModelInfo, RecipeInfo

    store_uri = str(tmp_path / "store") if kind == "local" else request.getfixturevalue("s3_uri")
    store = open_store(store_uri)
    digest, size = _blob(store, tmp_path, 16 << 20)
    m = Manifest(build_id="ab" * 32, model=ModelInfo(id="test-org/killed", revision="r", commit="c", source="s",
                                                     content_digest="cd" * 32),
                 recipe=RecipeInfo(id="gguf-f16", kind="gguf", digest="ef" * 32, options={}),
                 runtime_profiles=["llm-llamacpp-cpu"], format="gguf",
                 files=[FileEntry(path="m.gguf", sha256=digest, size=size)], toolchain={})
    raw = m.to_bytes()
    key = manifest_key("test-org/killed", "gguf-f16", m.build_id)
    store.write_bytes(key, raw)
    store.write_bytes(ref_key("test-org/killed", "gguf-f16", "latest"), json.dumps(
        {"build_id": m.build_id, "manifest": key, "manifest_sha256": hashlib.sha256(raw).hexdigest(),
         "created_at": "now"}).encode())
    cache, dest = tmp_path / "cache", tmp_path / "out" / "model"
    env = {**os.environ, "HIVE_AOT_CACHE": str(cache), "HIVE_AOT_PULL_PART_SIZE": "64K"}
    cmd = [sys.executable, "-m", "pipelines.cli", "pull", "test-org/killed", "--target", "llm-llamacpp-cpu",
           "--dest", str(dest), "--store", store_uri, "--json"]
    state = Path(cache) / "blobs" / "sha256" / digest[:2] / f".{digest}.parts"
    rng = random.Random(7)
    kills, written, completed = 0, 0, 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HIVE_AOT_CACHE", str(cache))
        while kills < KILLS:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            already = len(json.loads(state.read_text())["done"]) if state.exists() else 0
            if not _kill_after_parts(proc, state, rng.randint(already + 1, already + 40)):
                # it finished before the kill came: complete and verified; start the next trials from nothing
                assert proc.returncode == 0 and sha256_file(dest / "m.gguf") == digest
                completed += 1
                shutil.rmtree(dest)
                blob_path(digest).unlink()
                written = 0
                continue
            if blob_path(digest).exists():
                # killed after the verified blob took its name, before DIR was placed (the sha256 now ends with the
                # last part): whole and correct, DIR still absent; the next trials start from nothing
                assert not dest.exists() and sha256_file(blob_path(digest)) == digest
                blob_path(digest).unlink()
                completed += 1
                written = 0
                continue
            kills += 1
            assert not dest.exists(), kills
            now_written = size - missing_bytes(digest, size)
            assert now_written >= written  # a resumed pull keeps what the killed ones wrote
            written = now_written
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    moved = json.loads(done.stdout)["transfer"]
    assert sha256_file(dest / "m.gguf") == digest
    assert moved["resumed_bytes"] == written > 0 and moved["fetched_bytes"] == size - written < size
    summary = (f"puller kills ({kind}): {kills} mid-download, {completed} pulls finished first; the resumed pull "
               f"fetched {moved['fetched_bytes']} of {size} bytes")
    record_property("fault_loop", summary)  # tests/run.py prints it in make test's summary
    print(summary)
    gc = subprocess.run([sys.executable, "-m", "pipelines.cli", "gc", "--min-age", "0", "--store", store_uri],
                        env=env, capture_output=True, text=True, timeout=120)
    assert gc.returncode == 0, gc.stderr
    # the stamps of blobs the loop deleted went with gc (issue 39 item 13); the finished pull's blob keeps its own
    leftovers = [p.name for p in (cache / "blobs").rglob(".*")
                 if not (p.name == f".{digest}.verified" and p.with_name(digest).is_file())] + \
        [p.name for p in dest.parent.glob(".*")]
    assert leftovers == [], leftovers
