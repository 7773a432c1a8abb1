"""sha256 of files and canonical JSON, in one place."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, BinaryIO

from .paths import cache_root, replace_with_json

CHUNK = 4 * 1024 * 1024


def sha256_file(path: Path, progress=None) -> str:
    with open(path, "rb") as f:
        return sha256_stream(f, progress)


def sha256_stream(f: BinaryIO, progress=None) -> str:
    """sha256 of what is left to read in an open file (a caller that checked the file's fstat hashes that very
    inode, whatever its name points at meanwhile)."""
    h = hashlib.sha256()
    while chunk := f.read(CHUNK):
        h.update(chunk)
        if progress is not None:
            progress.update(len(chunk))
    return h.hexdigest()


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj)).hexdigest()


class DigestCache:
    """sha256 of local files keyed by (real path, size, inode, mtime_ns, ctime_ns), like git's index.

    Every Dagster step re-resolves its snapshot, and every skipped build verifies the blobs it relies on;
    for local files that would re-hash the whole model each time. ctime cannot be set by user code, so
    any write to a file misses the cache.
    """

    def __init__(self) -> None:
        self.path = cache_root() / "digests.json"
        try:
            self.entries: dict[str, list] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self.dirty = False

    @staticmethod
    def _key(p: Path) -> tuple[str, list]:
        st = p.stat()
        return str(p.resolve()), [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]

    def get(self, p: Path) -> str | None:
        real, sig = self._key(p)
        hit = self.entries.get(real)
        return hit[1] if hit and hit[0] == sig else None

    def put(self, p: Path, digest: str) -> None:
        real, sig = self._key(p)
        self.entries[real] = [sig, digest]
        self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_with_json(self.path, self.entries)
        except OSError:
            pass  # a cache that cannot be written only costs time
