"""The local, content-addressed blob cache that pulls fill: resumable, one download per digest per host.

Under `$HIVE_AOT_CACHE/blobs/sha256/<2 hex>/`:

    <digest>             a complete blob, verified by sha256 (mode 0644: pulled files are hard links to it)
    .<digest>.partial    the download in progress: the blob's size, parts written in place
    .<digest>.parts      which parts of the partial are complete (JSON, replaced atomically after each part)
    .<digest>.lock       flock of the one process downloading the digest; other pulls of it wait
    .<digest>.verified   the digest and the blob's (device, inode, size, mtime, ctime) when it last matched
                         (blob_stamps.py)

A blob is fetched in parts (ranged reads, several at once: blob_parts.py). A killed pull leaves the partial and its
part list; the next pull of that digest fetches only the parts not listed, then verifies the whole blob
(a resumed blob that does not verify is fetched once more from scratch before failing), so nothing
incomplete or unverified is ever visible under the digest's name. Concurrent pulls of one digest on a host
serialize on its lock: the second finds the blob complete and downloads nothing. What dead pulls leave (partials,
part lists, temporaries, free locks, stamps of deleted blobs) is reclaimed by blob_leftovers.py.

A cache shared between users is writable by others, and what it holds is untrusted input: nothing here
follows a symlink (a link planted at a partial, part list, lock or blob is removed, never written through),
an entry that is not a regular file (a FIFO, a socket) is removed before use, a directory where a file
belongs is a one-line error, and part lists are read with a size bound and checked field by field.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ..core import settings
from ..core.errors import HiveError, IntegrityError
from ..core.hashing import sha256_stream
from ..core.paths import cache_root, exclusive_lock, read_small_file
from ..store import Store, blob_key
from . import blob_stamps
from .blob_parts import PartDownload

FILE_MODE = 0o644
PART_BYTES = 64 << 20  # bytes per ranged read: a killed pull loses at most this much per worker
PART_SIZE_ENV = settings.PULL_PART_SIZE.name
MIN_PART_BYTES = 64 << 10  # below this, requests cost more than a kill could lose (1 byte: 15 s for 256 KiB)
MAX_PART_LIST_BYTES = 64 << 20  # far above any real part list (a 10 GB blob in 64 KiB parts lists ~1 MB)
PART_WORKERS = 8  # ranged reads in flight per blob
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


class CachedBlob(NamedTuple):
    """A blob of the cache and the stat of the inode whose sha256 matched: what pull links into DIR must be that
    inode (a shared cache's name may be swapped meanwhile), at that size and mtime."""

    path: Path
    verified: os.stat_result


def blob_path(digest: str) -> Path:
    return cache_root() / "blobs" / "sha256" / digest[:2] / digest


def _sidecar(blob: Path, suffix: str) -> Path:
    return blob.with_name(f".{blob.name}.{suffix}")


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _regular_or_absent(path: Path) -> os.stat_result | None:
    """The lstat of `path` when it is a regular file; None when absent, or after removing a symlink, FIFO or
    socket found there (never a file of ours: removing the entry does not touch what a link points to). A
    directory is an OSError, which the pull reports in one line."""
    st = _lstat(path)
    if st is None or stat.S_ISREG(st.st_mode):
        return st
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "a directory is where the blob cache keeps a file", str(path))
    path.unlink()
    return None


def _complete(path: Path, digest: str, size: int) -> os.stat_result | None:
    """The stat of the verified blob under `path`, None when there is none.

    A cache hit is re-hashed unless stamped unchanged since it verified (blob_stamps.py): pulled files are hard
    links to cached blobs, so a file edited in a serving directory would otherwise poison later pulls. The hash
    reads the inode it checked, through one descriptor opened without following links."""
    st = _lstat(path)
    if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != size:
        return None
    if blob_stamps.trusted(path, st):
        return st
    try:
        f = open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), "rb")
    except OSError:
        return None  # swapped for a link or removed since the lstat: not a blob; the pull fetches it
    with f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size != size or sha256_stream(f) != digest:
            return None
    blob_stamps.record(path, st)
    return st


def _ensure_mode(path: Path) -> bool:
    """Give a cached blob the served mode (blobs cached by older versions were 0600); a blob we may not chmod
    (another user's cache) keeps its mode, and pull copies it instead of linking. Through an fd opened without
    following links: a symlink swapped in must not chmod a file elsewhere. Whether it changed the mode."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o777 != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
            return True
    except PermissionError:
        pass
    finally:
        os.close(fd)
    return False


def check_cache_dirs(digests: set[str] | frozenset[str] = frozenset()) -> None:
    """One line, before a pull reads the cache, when HIVE_AOT_CACHE or a level of the blob tree below it is not a
    directory (a file, /dev/null, a fan-out level someone replaced with a file): every lstat below would fail
    with ENOTDIR. A symlinked level is left to `_cache_dirs`, which replaces it."""
    root = cache_root()
    levels = [root, root / "blobs", root / "blobs" / "sha256", *sorted({blob_path(d).parent for d in digests})]
    for level in levels:
        try:
            st = os.lstat(level)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise HiveError(f"blob cache: cannot use {level} ({e.strerror or type(e).__name__}; HIVE_AOT_CACHE "
                            f"names the cache directory): nothing was pulled") from None
        # a link below the root is replaced by _cache_dirs; the root itself may be a link the operator made
        if stat.S_ISDIR(st.st_mode) or (stat.S_ISLNK(st.st_mode) and (level != root or os.path.isdir(level))):
            continue
        raise HiveError(f"blob cache: {level} is not a directory (HIVE_AOT_CACHE names the cache directory): "
                        f"nothing was pulled")


def _cache_dirs(dest: Path) -> None:
    """blobs/sha256/<2 hex>/ under the cache root as real directories: a symlinked level would put every
    write below it somewhere else (it is removed and made again; a file there is an error)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    level = root
    for part in dest.parent.relative_to(root).parts:
        level = level / part
        st = _lstat(level)
        if st is not None and stat.S_ISLNK(st.st_mode):
            level.unlink()
            st = None
        if st is None:
            try:
                level.mkdir()
            except FileExistsError:  # another pull made it meanwhile
                pass
            st = os.lstat(level)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "the blob cache expects a directory here", str(level))


def _read_part_list(path: Path) -> dict:
    """A part list as a dict (empty when absent or unusable: the download then starts over). Bounded, never
    through a link, and any shape but an object of the expected fields counts as unusable."""
    try:
        doc = json.loads(read_small_file(path, MAX_PART_LIST_BYTES, follow_symlinks=False))
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(doc, dict) or not isinstance(doc.get("done", []), list):
        return {}
    return doc


def _done_parts(saved: dict, count: int) -> set[int]:
    done = saved.get("done", [])
    return {i for i in done if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count}


def parts_of(size: int, part_bytes: int) -> list[tuple[int, int]]:
    """(start, length) of every part of a blob of `size` bytes."""
    return [(start, min(part_bytes, size - start)) for start in range(0, size, part_bytes)] or [(0, 0)]


def missing_bytes(digest: str, size: int) -> int:
    """Bytes a pull of this blob still has to write into the cache: none when it is there (by size: the
    verification comes with the pull), the parts a killed pull did not finish otherwise."""
    dest = blob_path(digest)
    st = _lstat(dest)
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_size == size:
        return 0
    partial, state = _sidecar(dest, "partial"), _sidecar(dest, "parts")
    st = _lstat(partial)
    if st is None or not stat.S_ISREG(st.st_mode):
        return size
    saved = _read_part_list(state)
    part_bytes = saved.get("part_bytes")
    if not isinstance(part_bytes, int) or isinstance(part_bytes, bool) or part_bytes < MIN_PART_BYTES:
        return size
    parts = parts_of(size, part_bytes)
    # the partial is allocated sparse: its unwritten parts still take disk when they come
    return size - sum(parts[i][1] for i in _done_parts(saved, len(parts)))


def part_bytes_setting() -> int:
    from ..core.units import parse_size

    value = settings.PULL_PART_SIZE.get()
    return max(MIN_PART_BYTES, parse_size(value, PART_SIZE_ENV)) if value else PART_BYTES


def fetch_blob(store: Store, digest: str, size: int, progress=None, *, stats: TransferStats | None = None,
               part_bytes: int | None = None, workers: int = PART_WORKERS) -> Path:
    """The blob `digest` in the local cache, complete and verified: fetched from `store`, or resumed from a
    killed pull's partial, or found there."""
    return fetch_verified(store, digest, size, progress, stats=stats, part_bytes=part_bytes, workers=workers).path


def fetch_verified(store: Store, digest: str, size: int, progress=None, *, stats: TransferStats | None = None,
                   part_bytes: int | None = None, workers: int = PART_WORKERS) -> CachedBlob:
    """fetch_blob, with the stat of the inode that verified (what pull places in DIR)."""
    dest = blob_path(digest)
    try:
        return _fetch(store, digest, size, dest, progress, stats if stats is not None else TransferStats(),
                      part_bytes or part_bytes_setting(), workers)
    except (HiveError, KeyboardInterrupt):
        raise
    except OSError as e:  # the cache's file system, or what a shared cache holds: one line, the partial kept
        from ..core.host import disk_full_cause, disk_full_error

        code = disk_full_cause(e, dest.parent)
        if code is not None:
            raise disk_full_error(code, dest.parent, subject=f"pull of blob {digest[:12]}",
                                  outcome="what was downloaded is kept, and the next pull resumes it") from None
        raise HiveError(f"blob cache: cannot use {e.filename or dest} ({e.strerror or type(e).__name__}); "
                        f"the next pull resumes what was downloaded") from None


def _fetch(store: Store, digest: str, size: int, dest: Path, progress, stats: TransferStats, part_bytes: int,
           workers: int) -> CachedBlob:
    def hit(st: os.stat_result) -> CachedBlob:
        stats.add(cached=1)
        if progress is not None:
            progress.update(size)
        return CachedBlob(dest, st)

    if (st := _complete(dest, digest, size)) is not None:
        if _ensure_mode(dest):
            blob_stamps.restamp(dest, st)  # the chmod moved its ctime; bytes, inode and mtime are as verified
            st = _as_verified(dest, st)
        return hit(st)
    _cache_dirs(dest)
    with exclusive_lock(_sidecar(dest, "lock")):
        _regular_or_absent(dest)  # a link or FIFO under the digest's name is not a blob
        if (st := _complete(dest, digest, size)) is not None:  # another pull of this digest finished meanwhile
            return hit(st)
        mine = TransferStats()  # this blob's: `stats` may be shared with other blobs fetched at once
        try:
            st = _download(store, digest, size, dest, progress, mine, part_bytes, workers, resume=True)
        except IntegrityError:
            if not mine.resumed:
                raise
            # the parts kept from an earlier pull did not add up (a crash can lose written pages): once more
            # from nothing, and a second mismatch is the store's
            st = _download(store, digest, size, dest, progress, mine, part_bytes, workers, resume=False)
        finally:
            stats.add(fetched=mine.fetched, resumed=mine.resumed)
    return CachedBlob(dest, st)


def _download(store: Store, digest: str, size: int, dest: Path, progress, stats: TransferStats, part_bytes: int,
              workers: int, *, resume: bool) -> os.stat_result:
    """The blob fetched into its partial (the parts a killed pull listed kept, when `resume`), verified, and
    renamed to the digest's name."""
    partial, state_file = _sidecar(dest, "partial"), _sidecar(dest, "parts")
    key = blob_key(digest)
    state = {"version": STATE_VERSION, "digest": digest, "size": size, "part_bytes": part_bytes}
    parts = parts_of(size, part_bytes)
    done = _resumable_parts(partial, state_file, state, parts, resume=resume)
    fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (0 if done else os.O_TRUNC), 0o600)
    try:
        os.ftruncate(fd, size)
        kept = sum(parts[i][1] for i in done)
        stats.add(resumed=kept)
        if progress is not None and kept:
            progress.update(kept)

        def counted(fetched: int) -> None:
            stats.add(fetched=fetched)
            if progress is not None:
                progress.update(fetched)

        download = PartDownload(store, key, digest, size, fd, parts, part_bytes, done, counted,
                                hasher=hashlib.sha256(), hash_read=HASH_READ)
        download.fetch_missing(done, workers, state_file, state)
    except IntegrityError:
        _discard(partial, state_file)
        raise
    finally:
        os.close(fd)
    if os.path.getsize(partial) != size or not download.hashed():
        _discard(partial, state_file)
        raise IntegrityError(f"blob {digest[:12]} from {store.uri} does not match its manifest sha256")
    return _publish(partial, state_file, dest)


def _resumable_parts(partial: Path, state_file: Path, state: dict, parts: list[tuple[int, int]], *,
                     resume: bool) -> set[int]:
    """The parts of a killed pull's partial that its part list says are complete (none unless `resume` and the
    list describes this very download); the part list removed when nothing is kept."""
    done: set[int] = set()
    found = _regular_or_absent(partial)
    _regular_or_absent(state_file)
    if found is not None and found.st_nlink != 1:  # a hard link to a file elsewhere is never resumed into
        partial.unlink()
        found = None
    if resume and found is not None and found.st_size == state["size"]:
        saved = _read_part_list(state_file)
        if {k: saved.get(k) for k in state} == state:
            done = _done_parts(saved, len(parts))
    if not done:
        state_file.unlink(missing_ok=True)
    return done


def _publish(partial: Path, state_file: Path, dest: Path) -> os.stat_result:
    """The verified partial under the digest's name, in the served mode and stamped; the stat of its inode."""
    # Cached blobs are hard-linked into serving directories, so they carry the served mode. The stamp describes
    # the inode that was hashed, as the rename left it (a rename moves the ctime).
    os.chmod(partial, FILE_MODE)
    hashed = os.lstat(partial)
    os.replace(partial, dest)
    state_file.unlink(missing_ok=True)
    blob_stamps.restamp(dest, hashed)
    return _as_verified(dest, hashed)


def _as_verified(blob: Path, verified: os.stat_result) -> os.stat_result:
    """The blob's stat now when its name still holds the verified inode at its size and mtime (only the ctime
    moved: a rename, a chmod), else the verified stat itself, which pull then finds the name no longer holds."""
    now = _lstat(blob)
    return now if now is not None and blob_stamps.same_inode_and_bytes(now, verified) else verified


def _discard(partial: Path, state: Path) -> None:
    partial.unlink(missing_ok=True)
    state.unlink(missing_ok=True)


__all__ = ["PART_BYTES", "CachedBlob", "TransferStats", "blob_path", "check_cache_dirs", "fetch_blob", "fetch_verified",
           "missing_bytes", "parts_of"]
