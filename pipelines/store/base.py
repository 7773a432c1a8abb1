"""The store interface every backend implements, plus verified blob transfer on top of it."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from ..errors import IntegrityError
from ..hashing import sha256_file
from .layout import blob_key


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

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def upload_file(self, key: str, path: Path, sha256: str) -> None:
        """Copy a local file to key, verifying its sha256 on the way; atomic."""

    @abstractmethod
    def download_file(self, key: str, dest: Path, progress=None) -> None:
        """Copy key to a local path (the caller verifies and renames)."""

    @abstractmethod
    def check_writable(self) -> None:
        """Raise StoreError with a clear message unless the store accepts writes."""

    def check_exists(self) -> None:
        """Raise StoreError when the store itself is missing (a typo in --store), before reading it.

        Remote stores report a missing bucket on their first request, so only local ones check here."""

    def local_path(self, key: str) -> Path | None:
        """A path readers can use in place, for stores on the local file system."""
        return None

    # --- helpers shared by every backend ---
    def read_json(self, key: str) -> Any | None:
        raw = self.read_bytes(key)
        return None if raw is None else json.loads(raw)

    def put_blob(self, path: Path, sha256: str | None = None) -> str:
        digest = sha256 or sha256_file(path)
        key = blob_key(digest)
        size = self.size(key)
        if size is not None:
            if size != path.stat().st_size:
                raise IntegrityError(f"{self.uri}: blob {digest} exists with a different size (corrupt store?)")
            return digest  # content-addressed: already there
        self.upload_file(key, path, digest)
        return digest

    def __str__(self) -> str:
        return self.uri
