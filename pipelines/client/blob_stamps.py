"""Which cached blobs are known verified: the digest a blob matched and its (device, inode, size, mtime, ctime) then.

A cache hit used to be re-hashed on every pull (pulled files are hard links to cached blobs, so a file edited in a
serving directory would otherwise poison later pulls of its digest): 5 s per cached re-pull of 4 GiB here. A blob
whose stat still equals the stamp written when its sha256 matched is trusted without reading it.

Why ctime: mtime can be set back from user space (`os.utime`, `cp --preserve=timestamps` over a pulled file, which
writes the blob's own inode), ctime cannot, and every write, chmod, rename or link moves it. Why the digest in the
stamp: a group member of a shared cache may rename another user's blob and stamp onto a second digest of the same
size; the stamp then names the digest it was written for, and the rename moved the ctime as well.

Linking a blob into a serving directory moves its ctime too: `restamp` re-stamps a blob the pull itself verified
(same inode, size and mtime) after placing it, so the next pull into another directory is still cheap.

What a stamp cannot promise: a process of the pulling uid can write a blob and a fresh stamp for it, so a cache
shared by one uid (sibling containers) is only as trustworthy as every process of that uid. `HIVE_AOT_CACHE_VERIFY=
rehash` re-hashes every cached blob and DIR file on every pull instead (`rehash_always`). A stamp counts only when
the blob and its stamp are regular files owned by this user (another user's blob is re-hashed), and stamps are read
without following links, with a size bound.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from ..core import settings
from ..core.paths import read_small_file, replace_with_json

MAX_STAMP_BYTES = 512
STAMP_SUFFIX = ".verified"


def stamp_path(blob: Path) -> Path:
    return blob.with_name(f".{blob.name}{STAMP_SUFFIX}")


def rehash_always() -> bool:
    """HIVE_AOT_CACHE_VERIFY=rehash: no stamp (the cache's or a pulled DIR's marker) spares a re-hash."""
    return settings.CACHE_VERIFY.choice(("stamps", "rehash")) == "rehash"


def identity(st: os.stat_result) -> list[int]:
    """What any write to a file's bytes changes, ctime included (only the kernel sets it)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def same_inode_and_bytes(a: os.stat_result, b: os.stat_result) -> bool:
    """One inode at one size and mtime: what linking it elsewhere leaves alone (only its ctime moves)."""
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns) == (b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns)


def trusted(blob: Path, st: os.stat_result) -> bool:
    """Whether `blob` (whose lstat is `st`) is unchanged since its sha256 last matched the digest it is named for."""
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or rehash_always():
        return False
    stamp = stamp_path(blob)
    try:
        if os.lstat(stamp).st_uid != os.getuid():
            return False
        doc = json.loads(read_small_file(stamp, MAX_STAMP_BYTES, follow_symlinks=False))
    except (OSError, ValueError, RecursionError):
        return False
    return doc == {"digest": blob.name, "stat": identity(st)}


def record(blob: Path, verified: os.stat_result) -> None:
    """Stamp `blob` as verified. `verified` is its stat taken before the sha256 that matched was read: a write
    during the hash moved the ctime, so such a stamp never matches and the blob is hashed again next time. Best
    effort: a cache that cannot hold the stamp is re-hashed next time."""
    if verified.st_uid != os.getuid():
        return  # another user's blob is never trusted on a stamp (see `trusted`): nothing to record
    try:
        replace_with_json(stamp_path(blob), {"digest": blob.name, "stat": identity(verified)})
    except OSError:
        pass


def restamp(blob: Path, verified: os.stat_result) -> None:
    """Re-stamp `blob` after this pull renamed or linked it (which moved its ctime), when it is still the inode the
    pull verified at the same size and mtime; otherwise leave the stamp stale, so the next pull re-hashes it."""
    try:
        now = os.lstat(blob)
    except OSError:
        return
    if same_inode_and_bytes(now, verified):
        record(blob, now)


def orphaned(stamp: Path) -> bool:
    """A stamp whose blob is gone, or is no longer the inode it describes (what `gc` reclaims)."""
    blob = stamp.with_name(stamp.name[1:-len(STAMP_SUFFIX)])
    try:
        st = os.lstat(blob)
        doc = json.loads(read_small_file(stamp, MAX_STAMP_BYTES, follow_symlinks=False))
    except FileNotFoundError:
        return True
    except (OSError, ValueError, RecursionError):
        return True  # unreadable or malformed: it can never make a blob trusted, and serves nothing
    stamped = doc.get("stat") if isinstance(doc, dict) else None
    return not (isinstance(stamped, list) and len(stamped) == 5 and stamped[:2] == [st.st_dev, st.st_ino])
