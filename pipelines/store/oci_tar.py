"""The Modelcar's layer: a deterministic, uncompressed tar of an artifact's files under `models/`, streamed.

Every header is computed up front from the manifest's file list (paths and sizes are known), so the layer's
size is known before a byte is read, and its bytes depend on nothing but that list and the files' contents:
entries `models/` and every parent directory first (sorted, mode 0755), then the files (sorted by path, mode
0644), owner 0:0 with no user or group names, mtime 0 (the epoch, as reproducible image builders use), PAX
headers only where ustar cannot hold a field (paths over 100 bytes or not ASCII, files of 8 GiB and more), and
the two zero blocks that end an archive, without tarfile's padding to a 10 KiB record. The same artifact
gives the same layer digest, whoever makes it and whenever.

Not compressed: the weights do not compress, and a `tar` layer's digest is its diff_id, so nothing is hashed
twice. The bytes are made on the fly, in chunks of a bounded size, from any offset (an upload that lost its
place resumes where the registry says it stands), each file's sha256 checked as its bytes go by.
"""

from __future__ import annotations

import hashlib
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath

from ..core.errors import HiveError, IntegrityError, StoreError
from ..core.paths import safe_relpath

ROOT = "models"
BLOCK = 512
MTIME = 0
FILE_MODE, DIR_MODE = 0o644, 0o755
TRAILER = b"\0" * (2 * BLOCK)

Reader = Callable[[str, int, int], Iterator[bytes]]  # (sha256 hex, start, length) -> the file's bytes


@dataclass(frozen=True)
class Entry:
    header: bytes
    path: str = ""  # the file's path in the artifact; "" for a directory
    sha256: str = ""
    size: int = 0

    @property
    def padded(self) -> int:
        return -(-self.size // BLOCK) * BLOCK

    @property
    def length(self) -> int:
        return len(self.header) + self.padded


def _header(name: str, size: int, directory: bool) -> bytes:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    info.mode = DIR_MODE if directory else FILE_MODE
    info.size = 0 if directory else size
    info.mtime, info.uid, info.gid, info.uname, info.gname = MTIME, 0, 0, "", ""
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def plan(files: list[tuple[str, str, int]]) -> list[Entry]:
    """The layer's entries for (path, sha256 hex, size) files; one line for a path that would leave models/."""
    dirs, seen = {ROOT}, set()
    for path, _, _ in files:
        try:
            safe_relpath(path, what="artifact file path")
        except HiveError as e:
            raise StoreError(str(e)) from None
        if path in seen:
            raise StoreError(f"artifact file path {path!r} is listed twice")
        seen.add(path)
        dirs.update(f"{ROOT}/{p}" for p in map(str, PurePosixPath(path).parents) if p != ".")
    entries = [Entry(_header(d, 0, True)) for d in sorted(dirs)]
    return entries + [Entry(_header(f"{ROOT}/{path}", size, False), path, sha, size)
                      for path, sha, size in sorted(files)]


def layer_size(entries: list[Entry]) -> int:
    return sum(e.length for e in entries) + len(TRAILER)


def _pieces(entries: list[Entry], read: Reader, start: int) -> Iterator[bytes]:
    """The layer's bytes from offset `start`: a file read from its start is checked against its sha256."""
    at = 0
    for e in entries:
        if at + e.length <= start:
            at += e.length
            continue
        skip = max(0, start - at)
        if skip < len(e.header):
            yield e.header[skip:]
        if e.path:
            first = max(0, skip - len(e.header))
            if first < e.size:
                yield from _file(e, read, first)
            pad = e.padded - e.size
            into = max(0, skip - len(e.header) - e.size)
            if pad > into:
                yield b"\0" * (pad - into)
        at += e.length
    yield TRAILER[max(0, start - at):]


def _file(e: Entry, read: Reader, first: int) -> Iterator[bytes]:
    h = hashlib.sha256() if first == 0 else None  # a resumed file's head went out in an earlier try
    got = 0
    for chunk in read(e.sha256, first, e.size - first):
        got += len(chunk)
        if got > e.size - first:
            raise IntegrityError(f"{e.path}: the store sent more than its {e.size} bytes")
        if h is not None:
            h.update(chunk)
        yield chunk
    if got != e.size - first:
        raise IntegrityError(f"{e.path}: the store sent {got + first} of its {e.size} bytes")
    if h is not None and h.hexdigest() != e.sha256:
        raise IntegrityError(f"{e.path}: the store's bytes do not match its sha256 {e.sha256[:12]} (refused)")


def chunks(entries: list[Entry], read: Reader, size: int, start: int = 0) -> Iterator[bytes]:
    """The layer from `start` in chunks of `size` bytes (the last one shorter): what each PATCH carries."""
    buf = bytearray()
    for piece in _pieces(entries, read, start):
        buf += piece
        while len(buf) >= size:
            yield bytes(buf[:size])
            del buf[:size]
    if buf:
        yield bytes(buf)
