"""Which cached blobs are known verified: a blob's (inode, size, mtime) recorded when its sha256 last matched.

A cache hit used to be re-hashed on every pull (pulled files are hard links to cached blobs, so a file edited in a
serving directory would otherwise poison later pulls of its digest): 5 s per cached re-pull of 4 GiB here. The
policy is now the one `pull._present` applies to DIR's files, which are the very same inodes: a blob whose
(inode, size, mtime) equals the stamp written when it verified is trusted without reading it, since any write
through the file system moves the mtime; anything else is re-hashed, and stamped again when it matches.

A cache shared between users is untrusted input: a stamp counts only when the blob and its stamp are regular
files owned by this user (another user's blob is re-hashed, as before), and stamps are read without following
links, with a size bound.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from .paths import read_small_file, replace_with_json

MAX_STAMP_BYTES = 256


def stamp_path(blob: Path) -> Path:
    return blob.with_name(f".{blob.name}.verified")


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def trusted(blob: Path, st: os.stat_result) -> bool:
    """Whether `blob` (whose lstat is `st`) is unchanged since its sha256 last matched."""
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        return False
    stamp = stamp_path(blob)
    try:
        if os.lstat(stamp).st_uid != os.getuid():
            return False
        return json.loads(read_small_file(stamp, MAX_STAMP_BYTES, follow_symlinks=False)) == _stamp(st)
    except (OSError, ValueError, RecursionError):
        return False


def record(blob: Path) -> None:
    """Stamp `blob` as verified as it is now (the caller has just matched its sha256). Best effort: a cache that
    cannot hold the stamp is re-hashed next time, as before."""
    try:
        st = os.lstat(blob)
        if st.st_uid != os.getuid():
            return  # another user's blob is never trusted on a stamp (see `trusted`): nothing to record
        replace_with_json(stamp_path(blob), _stamp(st))
    except OSError:
        pass
