"""A store in a local directory (or a shared file system mount)."""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from ..core.errors import HiveError, IntegrityError, StoreError
from ..core.hashing import CHUNK, DigestCache, sha256_file
from ..core.host import disk_full_error, is_disk_full
from ..core.paths import safe_relpath
from .base import Entry, Store
from .faults import store_event
from .layout import blob_key


class LocalStore(Store):
    def __init__(self, root: Path):
        self.root = root
        self.uri = root.as_uri()

    def _path(self, key: str) -> Path:
        try:
            return self.root / safe_relpath(key, what="store key")
        except HiveError as e:
            raise StoreError(str(e)) from None

    def _key_of(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def _io_error(self, what: str, e: OSError, where: Path | None = None) -> HiveError:
        if is_disk_full(e):  # a DiskFull (ResourceError) line: the build names its step around it
            return disk_full_error(e.errno, where or self.root, subject=f"store {self.root}: cannot {what}",
                                   outcome="the partial file was removed")
        return StoreError(f"{self.root}: cannot {what} ({e.strerror or type(e).__name__})")

    def check_writable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".write-check-", dir=self.root)
            os.close(fd)
            os.unlink(tmp)
        except OSError as e:
            raise StoreError(f"store {self.root} is not writable ({e.strerror or type(e).__name__})") from None

    def check_exists(self) -> None:
        if not self.root.is_dir():
            what = "is not a directory" if self.root.exists() else "does not exist"
            raise StoreError(f"store {self.root} {what} (check --store or $HIVE_AOT_STORE)")

    def read_bytes(self, key: str) -> bytes | None:
        """The object's bytes. What the directory holds is untrusted: a directory, FIFO or device where a
        document belongs (which would raise, block forever or never end) is one IntegrityError line."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise StoreError(f"{self.root}: cannot read {key} ({e.strerror or type(e).__name__})") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # fdopen of a directory raises: check the fd first
                raise IntegrityError(f"{self.uri}: {key} is not a regular file: the store is damaged")
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read()
        finally:
            os.close(fd)

    def _atomic_write(self, dest: Path, writer) -> None:
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        except OSError as e:
            raise self._io_error(f"write {dest.name}", e, dest.parent) from None
        try:
            with os.fdopen(fd, "wb") as f:
                writer(f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            store_event("temp", self._key_of(dest))
            os.replace(tmp, dest)
            store_event("done", self._key_of(dest))
        except OSError as e:
            raise self._io_error(f"write {dest.name}", e, dest.parent) from None
        finally:
            # Whatever failed (a full disk included), the temporary goes: never a partial blob or record.
            if os.path.exists(tmp):
                os.unlink(tmp)

    def write_bytes(self, key: str, data: bytes) -> None:
        self._atomic_write(self._path(key), lambda f: f.write(data))

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            return None

    def modified(self, key: str) -> float | None:
        try:
            return self._path(key).stat().st_mtime
        except (FileNotFoundError, NotADirectoryError):
            return None

    def list(self, prefix: str) -> list[str]:
        return [e.key for e in self.list_entries(prefix, stat=False)]

    def list_entries(self, prefix: str, stat: bool = True) -> list[Entry]:
        base = self.root / prefix if prefix else self.root
        if not base.exists():
            return []
        out = []
        for dirpath, _dirs, files in os.walk(base):
            for fn in files:
                if fn.startswith("."):
                    continue  # in-flight temporaries
                path = Path(dirpath, fn)
                key = str(path.relative_to(self.root)).replace(os.sep, "/")
                if not stat:
                    out.append(Entry(key, 0, 0.0))
                    continue
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue  # removed while listing
                out.append(Entry(key, st.st_size, st.st_mtime))
        return sorted(out, key=lambda e: e.key)

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return
        store_event("delete", key)

    def adopt_file(self, key: str, path: Path, sha256: str, hashed: bool = False) -> None:
        if not self._link_into_place(path, self._path(key), None if hashed else sha256):
            self.upload_file(key, path, sha256)

    def upload_file(self, key: str, path: Path, sha256: str) -> None:
        dest = self._path(key)

        def copy(f):
            h = hashlib.sha256()
            with open(path, "rb") as src:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    f.write(chunk)
            if h.hexdigest() != sha256:
                raise IntegrityError(f"{path.name}: content changed while uploading (sha256 mismatch)")

        self._atomic_write(dest, copy)

    def _link_into_place(self, path: Path, dest: Path, sha256: str | None) -> bool:
        """Hard-link a build's file into the store when both are on one file system: a 16 GB artifact then
        needs 16 GB of disk, not 32. The caller deletes its name right after (adopt_file), so the blob is then
        the file's only name. Only a file that is the build's own (one link): a file linked from a source
        snapshot or another artifact shares its inode with them, and the store's blob must not change when
        they do. The link goes to a temporary name (reclaimed by gc like any temporary), is verified
        against `sha256` (None: the caller computed it from this file just now) and made 0644, then renamed
        into place. False (the caller copies) on any OSError:
        another file system (EXDEV), a file system without hard links, protected_hardlinks (EPERM)."""
        try:
            st = path.stat()
            if st.st_nlink != 1:
                return False
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.parent.stat().st_dev != st.st_dev:
                return False
            tmp = dest.parent / f".{dest.name}.{secrets.token_hex(6)}.tmp"
            os.link(path, tmp)
        except OSError:
            return False
        try:
            with open(tmp, "rb") as f:
                if sha256 is not None:
                    h = hashlib.sha256()
                    while chunk := f.read(CHUNK):
                        h.update(chunk)
                    if h.hexdigest() != sha256:
                        raise IntegrityError(f"{path.name}: content changed while uploading (sha256 mismatch)")
                os.fsync(f.fileno())  # the build wrote it without fsync: durable before it becomes a blob
            if st.st_mode & 0o777 != 0o644:
                os.chmod(tmp, 0o644)
            store_event("temp", self._key_of(dest))
            os.replace(tmp, dest)
            store_event("done", self._key_of(dest))
        except OSError as e:
            raise self._io_error(f"write {dest.name}", e, dest.parent) from None
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        return True

    def download_file(self, key: str, dest: Path, progress=None) -> None:
        src = self._path(key)
        if not src.is_file():
            raise StoreError(f"{self.root}: {key} is missing")
        with open(src, "rb") as s, open(dest, "wb") as d:
            while chunk := s.read(CHUNK):
                d.write(chunk)
                if progress is not None:
                    progress.update(len(chunk))

    def iter_range(self, key: str, start: int, length: int) -> Iterator[bytes]:
        src = self._path(key)
        try:
            f = open(src, "rb")
        except FileNotFoundError:
            raise StoreError(f"{self.root}: {key} is missing") from None
        with f:
            f.seek(start)
            while length > 0 and (chunk := f.read(min(CHUNK, length))):
                length -= len(chunk)
                yield chunk

    def blob_intact(self, digest: str, size: int) -> bool:
        """Size and full sha256; the digest is remembered with the file's (inode, mtime, ctime) stamp, so a
        blob is hashed once and again only after something wrote to it (skipped builds stay cheap)."""
        path = self._path(blob_key(digest))
        try:
            if path.stat().st_size != size:
                return False
        except OSError:
            return False
        cache = DigestCache()
        known = cache.get(path)
        if known is None:
            known = sha256_file(path)
            cache.put(path, known)
            cache.save()
        return known == digest

    def reclaim_temporaries(self, min_age_s: float, dry_run: bool = False) -> list[str]:
        # _atomic_write's `.<name>.<random>.tmp` and check_writable's `.write-check-*`: a live writer's are
        # seconds old, so age tells a dead writer's apart.
        now, out = time.time(), []
        for dirpath, _dirs, files in os.walk(self.root):
            for fn in files:
                if not (fn.startswith(".") and (fn.endswith(".tmp") or fn.startswith(".write-check-"))):
                    continue
                path = Path(dirpath, fn)
                try:
                    if now - path.stat().st_mtime <= min_age_s:
                        continue
                    if not dry_run:
                        path.unlink()
                except FileNotFoundError:
                    continue
                out.append(str(path.relative_to(self.root)))
        return sorted(out)

    def local_path(self, key: str) -> Path | None:
        p = self._path(key)
        return p if p.is_file() else None
