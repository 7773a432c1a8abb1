"""Cached blobs stamped when they verify (blob_stamps.py): a later pull trusts an unchanged blob without reading
it, and re-hashes (then fetches again) anything else: a blob written to since, a stamp that is a link, a blob or
stamp another user owns."""

from __future__ import annotations

import os
import random

import pytest

import pipelines.blob_cache as blob_cache
from pipelines.blob_cache import TransferStats, fetch_blob
from pipelines.blob_stamps import stamp_path, trusted
from pipelines.hashing import sha256_file
from pipelines.store import open_store


@pytest.fixture
def cached(tmp_path, monkeypatch):
    """(store, digest, size, blob path) of a blob fetched once into an empty cache."""
    monkeypatch.setenv("HIVE_AOT_CACHE", str(tmp_path / "cache"))
    store = open_store(str(tmp_path / "store"))
    f = tmp_path / "blob.bin"
    f.write_bytes(random.Random(7).randbytes(300_000))
    digest = store.put_blob(f)
    path = fetch_blob(store, digest, 300_000)
    return store, digest, 300_000, path


def _counting_hashes(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = blob_cache.sha256_file

    def counted(path, *a, **kw):
        calls.append(str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(blob_cache, "sha256_file", counted)
    return calls


def test_an_unchanged_verified_blob_is_a_hit_without_reading_it(cached, monkeypatch):
    store, digest, size, path = cached
    assert stamp_path(path).is_file() and trusted(path, os.lstat(path))
    hashed, stats = _counting_hashes(monkeypatch), TransferStats()
    assert fetch_blob(store, digest, size, stats=stats) == path
    assert hashed == [] and stats.cached_blobs == 1 and stats.fetched == 0


def test_a_blob_written_to_since_is_rehashed_and_fetched_again(cached, monkeypatch):
    store, digest, size, path = cached
    with open(path, "r+b") as f:  # an edit through a serving directory's hard link: same inode, same size
        f.write(b"\0" * 100)
    hashed, stats = _counting_hashes(monkeypatch), TransferStats()
    assert fetch_blob(store, digest, size, stats=stats) == path
    assert str(path) in hashed and stats.fetched == size and sha256_file(path) == digest
    assert trusted(path, os.lstat(path))  # stamped again once it verified


def test_a_linked_or_foreign_stamp_is_not_trusted(cached, monkeypatch, tmp_path):
    store, digest, size, path = cached
    stamp = stamp_path(path)
    elsewhere = tmp_path / "planted"
    elsewhere.write_bytes(stamp.read_bytes())  # the right content, behind a link
    stamp.unlink()
    stamp.symlink_to(elsewhere)
    assert not trusted(path, os.lstat(path))
    hashed = _counting_hashes(monkeypatch)
    fetch_blob(store, digest, size)
    assert hashed == [str(path)] and not stamp.is_symlink() and trusted(path, os.lstat(path))
    if os.getuid() != 0:
        return  # only root can hand the stamp to another user here
    os.chown(stamp, 12345, -1)
    assert not trusted(path, os.lstat(path))
    os.chown(stamp, 0, -1)
    os.chown(path, 12345, -1)  # another user's blob in a shared cache: re-hashed, as before stamps
    assert not trusted(path, os.lstat(path))
