"""What dead pulls leave in the blob cache, reclaimed (at the start of every pull, and by `gc`).

A killed pull leaves its partial download and part list (kept a day for the next pull to resume), part-list and
stamp temporaries, and lock files; a blob deleted by hand (or replaced by another inode) leaves its stamp. Nothing
here is removed while a live pull holds the digest's lock, or while anything of that digest was written recently.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..core.paths import cache_root, lock_is_free, release_lock, try_lock
from . import blob_stamps
from .blob_cache import FILE_MODE, _lstat, _regular_or_absent, _sidecar

PARTIAL_MAX_AGE_S = 24 * 3600.0  # a dead pull's partial waits this long for a pull to resume it


def reclaim_partials(max_age_s: float = PARTIAL_MAX_AGE_S, keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Remove what dead pulls left in the cache: partials older than `max_age_s` that no pull is resuming
    (their lock is free) with their part lists, part lists and part-list temporaries whose partial is gone,
    lock files nobody holds, and the random-named partials of older versions, which cannot be resumed. A
    digest in `keep` (the pull about to resume it) is left alone. Returns the removed entries' names."""
    removed: list[str] = []
    root = cache_root() / "blobs" / "sha256"
    if not root.is_dir() or root.is_symlink():
        return removed
    now = time.time()
    digests: dict[Path, str] = {}  # one directory entry per digest with leftovers: its blob path
    for entry in sorted(root.glob("*/.*")):
        name = entry.name[1:]
        if name.endswith(blob_stamps.STAMP_SUFFIX) and name.count(".") == 1:
            # a stamp whose blob is gone (deleted by hand, or replaced): nothing can use it any more
            digest = name.split(".", 1)[0]
            st = _lstat(entry)
            if digest not in keep and st is not None and now - st.st_mtime > max_age_s and blob_stamps.orphaned(entry):
                entry.unlink(missing_ok=True)
                removed.append(entry.name)
            continue
        if name.endswith(".partial") and "." in name[:-len(".partial")]:
            # `.<digest12>.<random>.partial` (before resumable pulls): flock on the file itself
            if entry.is_file() and not entry.is_symlink() and lock_is_free(entry):
                entry.unlink(missing_ok=True)
                removed.append(entry.name)
            continue
        digest = name.split(".", 1)[0]
        if digest not in keep and len(digest) == 64:
            digests[entry.with_name(digest)] = digest
    for blob in digests:
        removed += _reclaim_leftovers(blob, now, max_age_s)
    return removed


def _reclaim_leftovers(blob: Path, now: float, max_age_s: float) -> list[str]:
    partial, state, lock = _sidecar(blob, "partial"), _sidecar(blob, "parts"), _sidecar(blob, "lock")
    temporaries = [*blob.parent.glob(f".{blob.name}.parts.*.tmp"), *blob.parent.glob(f".{blob.name}.verified.*.tmp")]
    found = {p: st for p in (partial, state, *temporaries) if (st := _lstat(p)) is not None}
    if any(now - st.st_mtime <= max_age_s for st in found.values()):
        return []  # a recent write: its pull may be alive, or may resume soon
    leftovers = list(found)
    had_lock = _lstat(lock) is not None
    if not had_lock and not leftovers:
        return []
    fd = _take_free_lock(lock)
    if fd is None:
        return []  # a live pull holds it
    try:
        for p in leftovers:
            p.unlink(missing_ok=True)
        return [p.name for p in leftovers] + ([lock.name] if had_lock else [])
    finally:
        release_lock(lock, fd)


def _take_free_lock(lock: Path) -> int | None:
    """The digest's lock taken without waiting (made if absent), or None while a live pull holds it. A link or
    FIFO at the lock's name is no lock: it is removed first."""
    if _lstat(lock) is not None:
        _regular_or_absent(lock)
    try:
        os.close(os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE))
    except FileExistsError:
        pass
    return try_lock(lock)


__all__ = ["PARTIAL_MAX_AGE_S", "reclaim_partials"]
