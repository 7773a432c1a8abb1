"""The local, content-addressed blob cache that pulls fill: resumable, one download per digest per host.

Under `$HIVE_AOT_CACHE/blobs/sha256/<2 hex>/`:

    <digest>             a complete blob, verified by sha256 (mode 0644: pulled files are hard links to it)
    .<digest>.partial    the download in progress: the blob's size, parts written in place
    .<digest>.parts      which parts of the partial are complete (JSON, replaced atomically after each part)
    .<digest>.lock       flock of the one process downloading the digest; other pulls of it wait

A blob is fetched in parts (ranged reads, several at once). A killed pull leaves the partial and its
part list; the next pull of that digest fetches only the parts not listed, then verifies the whole blob
(a resumed blob that does not verify is fetched once more from scratch before failing), so nothing
incomplete or unverified is ever visible under the digest's name. Concurrent pulls of one digest on a host
serialize on its lock: the second finds the blob complete and downloads nothing. A partial whose
downloader died is reclaimed once it is older than a day (or by `gc`), and only while holding its lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from .errors import IntegrityError
from .hashing import sha256_file
from .paths import cache_root, exclusive_lock, lock_is_free, release_lock, try_lock
from .store import Store, blob_key

FILE_MODE = 0o644
PART_BYTES = 64 << 20  # bytes per ranged read: a killed pull loses at most this much per worker
PART_SIZE_ENV = "HIVE_AOT_PULL_PART_SIZE"  # e.g. 16M: smaller parts lose less to a kill, cost more requests
PART_WORKERS = 8  # ranged reads in flight per blob
PARTIAL_MAX_AGE_S = 24 * 3600.0  # a dead pull's partial waits this long for a pull to resume it
STATE_VERSION = 1
HASH_READ = 8 << 20  # bytes read back per sha256 update


@dataclass
class TransferStats:
    """What a pull moved: bytes fetched from the store, bytes reused from a killed pull's partial, blobs the
    cache already held."""

    fetched: int = 0
    resumed: int = 0
    cached_blobs: int = 0

    def add(self, fetched: int = 0, resumed: int = 0, cached: int = 0) -> None:
        with _STATS_LOCK:
            self.fetched += fetched
            self.resumed += resumed
            self.cached_blobs += cached


_STATS_LOCK = threading.Lock()


def blob_path(digest: str) -> Path:
    return cache_root() / "blobs" / "sha256" / digest[:2] / digest


def _sidecar(blob: Path, suffix: str) -> Path:
    return blob.with_name(f".{blob.name}.{suffix}")


def _complete(path: Path, digest: str, size: int) -> bool:
    # A cache hit is re-hashed: pulled files are hard links to cached blobs, so a file edited in a serving
    # directory would otherwise poison every later pull of the same digest.
    return path.is_file() and path.stat().st_size == size and sha256_file(path) == digest


def _ensure_mode(path: Path) -> None:
    """Give a cached blob the served mode (blobs cached by older versions were 0600); a blob we may not chmod
    (another user's cache) keeps its mode, and pull copies it instead of linking."""
    if path.stat().st_mode & 0o777 != FILE_MODE:
        try:
            os.chmod(path, FILE_MODE)
        except PermissionError:
            pass


def parts_of(size: int, part_bytes: int) -> list[tuple[int, int]]:
    """(start, length) of every part of a blob of `size` bytes."""
    return [(start, min(part_bytes, size - start)) for start in range(0, size, part_bytes)] or [(0, 0)]


def missing_bytes(digest: str, size: int) -> int:
    """Bytes a pull of this blob still has to write into the cache: none when it is there (by size: the
    verification comes with the pull), the parts a killed pull did not finish otherwise."""
    dest = blob_path(digest)
    if dest.is_file() and dest.stat().st_size == size:
        return 0
    partial, state = _sidecar(dest, "partial"), _sidecar(dest, "parts")
    if not partial.is_file():
        return size
    try:
        saved = json.loads(state.read_text())
        parts = parts_of(size, int(saved["part_bytes"]))
        # the partial is allocated sparse: its unwritten parts still take disk when they come
        return size - sum(parts[int(i)][1] for i in saved.get("done", []) if int(i) < len(parts))
    except (OSError, ValueError, TypeError, KeyError, IndexError):
        return size


def part_bytes_setting() -> int:
    from .units import parse_size

    value = os.environ.get(PART_SIZE_ENV)
    return max(1, parse_size(value, PART_SIZE_ENV)) if value else PART_BYTES


def fetch_blob(store: Store, digest: str, size: int, progress=None, *, stats: TransferStats | None = None,
               part_bytes: int | None = None, workers: int = PART_WORKERS) -> Path:
    """The blob `digest` in the local cache, complete and verified: fetched from `store`, or resumed from a
    killed pull's partial, or found there."""
    part_bytes = part_bytes or part_bytes_setting()
    dest = blob_path(digest)
    stats = stats if stats is not None else TransferStats()
    if _complete(dest, digest, size):
        stats.add(cached=1)
        if progress is not None:
            progress.update(size)
        _ensure_mode(dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(_sidecar(dest, "lock")):
        if _complete(dest, digest, size):  # another pull of this digest finished while we waited
            stats.add(cached=1)
            if progress is not None:
                progress.update(size)
            return dest
        try:
            _download(store, digest, size, dest, progress, stats, part_bytes, workers, resume=True)
        except IntegrityError:
            if not stats.resumed:
                raise
            # the parts kept from an earlier pull did not add up (a crash can lose written pages): once more
            # from nothing, and a second mismatch is the store's
            _download(store, digest, size, dest, progress, stats, part_bytes, workers, resume=False)
    return dest


def _download(store: Store, digest: str, size: int, dest: Path, progress, stats: TransferStats, part_bytes: int,
              workers: int, *, resume: bool) -> None:
    partial, state_file = _sidecar(dest, "partial"), _sidecar(dest, "parts")
    key = blob_key(digest)
    done: set[int] = set()
    state = {"version": STATE_VERSION, "digest": digest, "size": size, "part_bytes": part_bytes}
    if resume and partial.is_file() and partial.stat().st_size == size:
        try:
            saved = json.loads(state_file.read_text())
            if {k: saved.get(k) for k in state} == state:
                done = {int(i) for i in saved.get("done", [])}
        except (OSError, ValueError, TypeError):
            done = set()
    if not done:
        state_file.unlink(missing_ok=True)
    fd = os.open(partial, os.O_RDWR | os.O_CREAT | (0 if done else os.O_TRUNC), 0o600)
    try:
        os.ftruncate(fd, size)
        parts = parts_of(size, part_bytes)
        kept = sum(parts[i][1] for i in done if i < len(parts))
        stats.add(resumed=kept)
        if progress is not None and kept:
            progress.update(kept)

        def fetch(index: int) -> int:
            start, length = parts[index]
            at = start
            for chunk in store.iter_range(key, start, length):
                os.pwrite(fd, chunk, at)
                at += len(chunk)
                stats.add(fetched=len(chunk))
                if progress is not None:
                    progress.update(len(chunk))
            if at - start != length:  # the stored object is shorter than its manifest says: damaged, not flaky
                raise IntegrityError(f"blob {digest[:12]} from {store.uri} does not match its manifest sha256 "
                                     f"(it ends after {at} of {size} bytes)")
            return index

        # The sha256 runs over the parts as they complete in order, while later ones are still coming (hashlib
        # releases the GIL): the verification costs little more than reading the last parts back.
        hasher, hashed = hashlib.sha256(), [0]  # parts [0, hashed) are in the digest

        def hash_ready() -> None:
            while hashed[0] < len(parts) and hashed[0] in done:
                start, length = parts[hashed[0]]
                for at in range(start, start + length, HASH_READ):
                    hasher.update(os.pread(fd, min(HASH_READ, start + length - at), at))
                hashed[0] += 1

        todo = [i for i in range(len(parts)) if i not in done]
        with ThreadPoolExecutor(max(1, min(workers, len(todo) or 1)), thread_name_prefix="pull-part") as pool:
            pending = {pool.submit(fetch, i) for i in todo}
            try:
                while pending:
                    finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                    failed = [f.exception() for f in finished if f.exception() is not None]
                    done.update(f.result() for f in finished if f.exception() is None)
                    # the pages written are the kernel's now: a killed pull resumes after these parts
                    _write_state(state_file, {**state, "done": sorted(done)})
                    if failed:
                        raise failed[0]
                    hash_ready()
            finally:
                for f in pending:
                    f.cancel()
        hash_ready()
    except IntegrityError:
        _discard(partial, state_file)
        raise
    finally:
        os.close(fd)
    if os.path.getsize(partial) != size or hashed[0] != len(parts) or hasher.hexdigest() != digest:
        _discard(partial, state_file)
        raise IntegrityError(f"blob {digest[:12]} from {store.uri} does not match its manifest sha256")
    # Cached blobs are hard-linked into serving directories, so they carry the served mode.
    os.chmod(partial, FILE_MODE)
    os.replace(partial, dest)
    state_file.unlink(missing_ok=True)


def _discard(partial: Path, state: Path) -> None:
    partial.unlink(missing_ok=True)
    state.unlink(missing_ok=True)


def _write_state(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def reclaim_partials(max_age_s: float = PARTIAL_MAX_AGE_S, keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Remove what dead pulls left in the cache: partials older than `max_age_s` that no pull is resuming
    (their lock is free), and the random-named partials of older versions, which cannot be resumed. A digest
    in `keep` (the pull about to resume it) is left alone. Returns the removed partials' names."""
    removed = []
    root = cache_root() / "blobs" / "sha256"
    now = time.time()
    for partial in sorted(root.glob("*/.*.partial")):
        digest = partial.name[1:-len(".partial")]
        if "." in digest:  # `.<digest12>.<random>.partial` (before resumable pulls): flock on the file itself
            if lock_is_free(partial):
                partial.unlink(missing_ok=True)
                removed.append(partial.name)
            continue
        blob = partial.with_name(digest)
        state, lock = _sidecar(blob, "parts"), _sidecar(blob, "lock")
        try:
            age = now - max(partial.stat().st_mtime, state.stat().st_mtime if state.exists() else 0.0)
        except FileNotFoundError:
            continue
        if digest in keep or age <= max_age_s:
            continue
        if not lock.exists():
            lock.touch()
        fd = try_lock(lock)
        if fd is None:
            continue  # a live pull holds it
        try:
            partial.unlink(missing_ok=True)
            state.unlink(missing_ok=True)
            removed.append(partial.name)
        finally:
            release_lock(lock, fd)
    return removed


__all__ = ["PART_BYTES", "TransferStats", "blob_path", "fetch_blob", "missing_bytes", "parts_of", "reclaim_partials"]
