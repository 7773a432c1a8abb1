"""DIR as a pull leaves it: assembled from verified cache blobs in a sibling temporary directory, renamed into
place whole (never over files an earlier pull did not make), and recognised later as already holding a build.

Serving processes often run as another user than the puller: what a pull leaves is world-readable (files 0644,
directories 0755), and DIR's files are hard links of the cache's blobs wherever the modes allow.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from contextlib import suppress
from pathlib import Path
from typing import Any

from ..core.errors import HiveError, IntegrityError
from ..core.hashing import sha256_stream
from ..store.manifest import Manifest
from . import blob_stamps
from .blob_cache import CachedBlob, blob_path

MARKER = "hive-aot.json"
FILE_MODE, DIR_MODE = 0o644, 0o755


def place(blob: CachedBlob, out: Path) -> None:
    """out = the blob's verified content, mode FILE_MODE: a hard link of the very inode that verified when it has
    that mode, else a copy read from it. A shared cache's name may be swapped for another inode after the
    verification (a group member renaming another blob of the same size onto it): what lands in DIR is checked
    to be the verified inode, unchanged in size and mtime, or the pull stops in one line."""
    verified = blob.verified
    try:
        fd = os.open(blob.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        raise _swapped(blob) from None
    with open(fd, "rb") as src:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not blob_stamps.same_inode_and_bytes(st, verified):
            raise _swapped(blob)
        if st.st_mode & 0o777 == FILE_MODE and _hardlink(blob.path, out):
            if blob_stamps.same_inode_and_bytes(out.lstat(), verified):
                return
            out.unlink()  # the name was swapped between the check above and the link
            raise _swapped(blob)
        with open(out, "xb") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)
    os.chmod(out, FILE_MODE)


def _hardlink(src: Path, out: Path) -> bool:
    """Whether `out` is now a hard link of `src` (False on another file system, or where links are refused)."""
    try:
        out.hardlink_to(src)
        return True
    except OSError:
        return False


def _swapped(blob: CachedBlob) -> IntegrityError:
    return IntegrityError(f"blob cache: {blob.path} changed after it was verified (another process writes the "
                          f"cache): nothing was placed; pull again")


def _mkdirs(root: Path, rel_dir: Path) -> None:
    """Create rel_dir's components under root with DIR_MODE whatever the umask."""
    path = root
    for part in rel_dir.parts:
        path = path / part
        if not path.is_dir():
            path.mkdir()
            os.chmod(path, DIR_MODE)


def _not_ours(dest: Path) -> list[str]:
    """Entries under dest that the pull which made it did not create: anything but its marker, the files its
    marker's manifest lists and their directories (only the marker when that is unreadable)."""
    owned = {MARKER}
    try:
        doc = json.loads((dest / MARKER).read_text())
        owned.update(n for n in doc.get("beside", []) if isinstance(n, str) and "/" not in n)
        for f in doc["manifest"]["files"]:
            parts = f["path"].split("/")
            owned.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    foreign = []

    def fail(e: OSError) -> None:
        raise e  # an unreadable subdirectory may hold anything: never replace what we could not inspect

    for root, dirs, files in os.walk(dest, onerror=fail):
        rel = Path(root).relative_to(dest)
        foreign += sorted(str(rel / n) for n in files + dirs if str(rel / n) not in owned)
        dirs[:] = [d for d in dirs if str(rel / d) in owned]  # a foreign directory is reported once
    return foreign


def _swap_into_place(tmp: Path, dest: Path) -> None:
    if dest.exists():
        if not dest.is_dir():
            raise HiveError(f"{dest} exists and is not a directory")
        foreign = _not_ours(dest)
        if foreign and not (dest / MARKER).is_file():
            raise HiveError(f"{dest} is not empty and was not made by hive-aot pull: refusing to replace it")
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise HiveError(f"{dest} holds files an earlier pull did not create ({shown}): refusing to replace it "
                            f"(move them elsewhere, or pull into another directory)")
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)


def assemble(dest: Path, m: Manifest, blobs: dict[str, CachedBlob], marker_doc: dict[str, Any],
             beside: dict[str, bytes] | None = None) -> None:
    """`beside`: small files DIR holds besides the build's (the manifest's exact bytes, the OMS signature),
    name -> content."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        for f in m.files:
            out = tmp / f.path
            _mkdirs(tmp, Path(f.path).parent)
            place(blobs[f.sha256], out)
        for name, data in (beside or {}).items():
            (tmp / name).write_bytes(data)
            os.chmod(tmp / name, FILE_MODE)
        # Linking moved the blobs' ctimes: their cache stamps follow (the inodes this pull verified), so the next
        # pull into another DIR is not a re-hash.
        for blob in blobs.values():
            blob_stamps.restamp(*blob)
        # Renaming DIR into place moves no file's stat, so the stamps taken here describe DIR's files.
        _write_marker(tmp, {**marker_doc, "beside": sorted(beside or {}),
                            "stamps": {f.path: blob_stamps.identity((tmp / f.path).lstat()) for f in m.files}})
        os.chmod(tmp, DIR_MODE)
        _swap_into_place(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _write_marker(directory: Path, doc: dict[str, Any]) -> None:
    """Atomically: a marker cut short by a crash would disown DIR's files (see _not_ours)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{MARKER}.", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, directory / MARKER)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def present(dest: Path, m: Manifest, beside: dict[str, bytes] | None = None) -> bool:
    """DIR already holds build m: every file a regular file at its size and served mode, and unmodified.

    Policy for "unmodified" (issue 7 item 5, issue 39 item 1): a file whose (device, inode, size, mtime, ctime)
    equals the stamp the pull recorded in the marker is trusted without reading it, and so is a file that is the
    very inode of its blob in the cache while the cache's stamp trusts that (blob_stamps.py: linking the blob into
    another DIR moves the ctime of every link, and the pull that linked it re-stamps the blob). mtime alone is not
    evidence: `cp --preserve=timestamps` over a pulled file writes it and sets the mtime back; ctime only the
    kernel sets. Any other file (a copied or restored DIR, a marker from an older version, a file rewritten) is
    re-hashed, and a mismatch means DIR is pulled again; after a successful re-hash the new stamps are recorded,
    so the next check is cheap again. HIVE_AOT_CACHE_VERIFY=rehash re-hashes every file every time."""
    rehash = blob_stamps.rehash_always()
    try:
        if any((dest / name).read_bytes() != data for name, data in (beside or {}).items()):
            return False  # small: compared whole (a DIR pulled before they were kept, or another signature)
        doc = json.loads((dest / MARKER).read_text())
        if not isinstance(doc, dict) or doc.get("build_id") != m.build_id:
            return False
        stamps = doc.get("stamps") if isinstance(doc.get("stamps"), dict) else {}
        fresh = {}
        for f in m.files:
            p = dest / f.path
            st = p.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_size != f.size or stat.S_IMODE(st.st_mode) != FILE_MODE:
                return False
            fresh[f.path] = blob_stamps.identity(st)
            if not rehash and (stamps.get(f.path) == fresh[f.path] or _is_trusted_blob(f.sha256, st)):
                continue
            if _sha256_of_inode(p, st) != f.sha256:
                return False
    except (OSError, ValueError):
        return False
    if fresh != stamps:
        with suppress(OSError):  # a read-only DIR stays valid; it is just re-hashed next time
            _write_marker(dest, {**doc, "stamps": fresh})
    return True


def _is_trusted_blob(digest: str, st: os.stat_result) -> bool:
    """`st` (a DIR file's lstat) is the cached blob of `digest` itself, which its cache stamp trusts."""
    blob = blob_path(digest)
    try:
        cached = os.lstat(blob)
    except OSError:
        return False
    return blob_stamps.identity(cached) == blob_stamps.identity(st) and blob_stamps.trusted(blob, cached)


def _sha256_of_inode(path: Path, st: os.stat_result) -> str | None:
    """sha256 of the file at `path` when it is still the inode `st` describes (read through one descriptor, not
    following links), None otherwise."""
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
        if blob_stamps.identity(os.fstat(f.fileno())) != blob_stamps.identity(st):
            return None
        return sha256_stream(f)
