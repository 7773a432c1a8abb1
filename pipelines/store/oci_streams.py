"""Byte streams of the OCI store: an upload hashed as it is read, and the blob reads of one model repository."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from typing import BinaryIO

from ..core.errors import StoreError
from .oci_layout import place


class HashingReader:
    """A file read by the upload, hashed on the way: a registry that failed to check the digest is caught."""

    def __init__(self, f: BinaryIO):
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def read(self, size: int = -1) -> bytes:
        chunk = self.f.read(size)
        self.h.update(chunk)
        self.n += len(chunk)
        return chunk

    def close(self) -> None:
        self.f.close()


class BytesReader:
    def __init__(self, data: bytes):
        self._f = io.BytesIO(data)

    def read(self, size: int = -1) -> bytes:
        return self._f.read(size)

    def close(self) -> None:
        pass


class ModelBlobs:
    """The blob reads pull makes (iter_range), from one model repository of an OCI store."""

    def __init__(self, store, repo: str):
        self.store, self.repo = store, repo
        self.uri = f"{store.uri.split('://', 1)[0]}://{store.host}/{repo}"

    def iter_range(self, key: str, start: int, length: int) -> Iterator[bytes]:
        p = place(key)
        if p is None or p.kind != "blob":
            raise StoreError(f"{self.uri}: {key} is not a blob")
        if length > 0:
            yield from self.store.registry.blob_stream(self.repo, p.digest, start, length)
