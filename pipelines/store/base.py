"""The store interface every backend implements, plus verified blob transfer on top of it."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import IntegrityError
from ..core.hashing import sha256_file
from .layout import blob_key, is_digest


@dataclass(frozen=True)
class Entry:
    """One object of a listing, with what the listing itself tells (S3 returns size and LastModified with
    each key: gc needs no HEAD per blob)."""

    key: str
    size: int
    modified: float  # epoch seconds


class Store(ABC):
    uri: str

    @abstractmethod
    def read_bytes(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""

    @abstractmethod
    def write_bytes(self, key: str, data: bytes) -> None:
        """Write atomically: readers see the old object, or the whole new one."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def size(self, key: str) -> int | None: ...

    @abstractmethod
    def modified(self, key: str) -> float | None:
        """Last-modified time (epoch seconds), or None when the object does not exist."""

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys under prefix (recursive), sorted."""

    def list_entries(self, prefix: str) -> list[Entry]:
        """`list` with each object's size and last-modified time (backends take them from the listing)."""
        return [Entry(k, self.size(k) or 0, self.modified(k) or 0.0) for k in self.list(prefix)]

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def upload_file(self, key: str, path: Path, sha256: str) -> None:
        """Copy a local file to key, verifying its sha256 on the way; atomic."""

    def adopt_file(self, key: str, path: Path, sha256: str, hashed: bool = False) -> None:
        """upload_file for a file the caller deletes right after (a build's output in its work dir): a local
        store may take the file itself (a hard link) instead of a second copy. `hashed`: `sha256` was just
        computed from this very file, so taking it needs no second read."""
        self.upload_file(key, path, sha256)

    @abstractmethod
    def download_file(self, key: str, dest: Path, progress=None) -> None:
        """Copy key to a local path (the caller verifies and renames)."""

    @abstractmethod
    def iter_range(self, key: str, start: int, length: int) -> Iterator[bytes]:
        """Bytes [start, start + length) of an object, in chunks: a pull fetches (and resumes) part by part.
        A missing object is a StoreError; the caller checks that `length` bytes came."""

    @abstractmethod
    def check_writable(self) -> None:
        """Raise StoreError with a clear message unless the store accepts writes."""

    def check_exists(self) -> None:
        """Raise StoreError when the store itself is missing (a typo in --store), before reading it.

        Remote stores report a missing bucket on their first request, so only local ones check here."""

    def reclaim_temporaries(self, min_age_s: float, dry_run: bool = False) -> list[str]:
        """Remove in-flight temporaries older than min_age_s that a killed writer left (local stores; S3
        writes are atomic per object and leave none)."""
        return []

    def delete_derived(self, manifest_keys: list[str], dry_run: bool = False) -> list[str]:
        """Delete what the store keeps beside these manifests outside its keys, made from them (an OCI store's
        Modelcar images): retire takes them down with the build, so no copy stays pullable. Their names (listed
        only, with `dry_run`). Nothing in stores that keep no such things."""
        return []

    def blobs_for(self, manifest_key: str) -> Store:
        """Where to read the blobs the build under `manifest_key` names: this store, except where a build's blobs
        sit beside its manifest (an OCI store reads them from the model's own repository, oci.py)."""
        return self

    def local_path(self, key: str) -> Path | None:
        """A path readers can use in place, for stores on the local file system."""
        return None

    # --- helpers shared by every backend ---
    def read_json(self, key: str) -> Any | None:
        """The decoded object, None when absent; undecodable bytes are one IntegrityError line."""
        raw = self.read_bytes(key)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise IntegrityError(f"{self.uri}: {key} is not valid JSON: the store is damaged") from None

    def read_ref(self, key: str) -> dict[str, Any] | None:
        """A ref ({build_id, manifest, manifest_sha256, created_at}); a malformed one is one IntegrityError line."""
        ref = self.read_json(key)
        if ref is None:
            return None
        build_id = ref.get("build_id") if isinstance(ref, dict) else None
        if not (is_digest(build_id) and isinstance(ref.get("manifest", ""), str)):
            raise IntegrityError(f"{self.uri}: ref {key} has no valid build_id (a sha256 hex digest): the store is damaged")
        return ref

    def blob_intact(self, digest: str, size: int) -> bool:
        """Whether the stored blob still holds its content, by this backend's verification policy
        (size here; LocalStore and S3Store check content too, see theirs)."""
        return self.size(blob_key(digest)) == size

    def blob_content_intact(self, digest: str, size: int, progress=None) -> bool:
        """Whether the stored blob's bytes hash to `digest` at `size`: read from the store and hashed, nothing kept
        (what `hive-aot verify --deep` asks of every store kind, whatever its cheap policy trusts)."""
        import hashlib

        if self.size(blob_key(digest)) != size:
            return False
        h, seen = hashlib.sha256(), 0
        for chunk in self.iter_range(blob_key(digest), 0, size):
            h.update(chunk)
            seen += len(chunk)
            if progress is not None:
                progress.update(len(chunk))
        return seen == size and h.hexdigest() == digest

    def put_blob(self, path: Path, sha256: str | None = None, *, handover: bool = False) -> str:
        """Upload a blob unless an intact copy is there; a damaged copy is replaced (repaired). `handover`: the
        caller deletes `path` right after, so the store may take the file itself (adopt_file). Without `sha256`
        the digest is computed here, and a file taken over is not read a second time."""
        digest = sha256 or sha256_file(path)
        if self.size(blob_key(digest)) is not None and self.blob_intact(digest, path.stat().st_size):
            return digest  # content-addressed: already there
        if handover:
            self.adopt_file(blob_key(digest), path, digest, hashed=sha256 is None)
        else:
            self.upload_file(blob_key(digest), path, digest)
        return digest

    def __str__(self) -> str:
        return self.uri
