"""Cached blobs stamped when they verify (blob_stamps.py): a later pull trusts an unchanged blob without reading
it, and re-hashes (then fetches again) anything else: a blob written to since, a stamp that is a link, a blob or
stamp another user owns."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import pipelines.client.blob_cache as blob_cache
from pipelines.client.blob_cache import TransferStats, fetch_blob
from pipelines.client.blob_leftovers import reclaim_partials
from pipelines.client.blob_stamps import stamp_path, trusted
from pipelines.core.hashing import sha256_file
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


def _counting_hashes(monkeypatch) -> list[int]:
    """One entry per sha256 the blob cache reads from a cached file."""
    calls: list[int] = []
    real = blob_cache.sha256_stream

    def counted(f, *a, **kw):
        calls.append(1)
        return real(f, *a, **kw)

    monkeypatch.setattr(blob_cache, "sha256_stream", counted)
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
    assert hashed and stats.fetched == size and sha256_file(path) == digest
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
    assert len(hashed) == 1 and not stamp.is_symlink() and trusted(path, os.lstat(path))
    if os.getuid() != 0:
        return  # only root can hand the stamp to another user here
    os.chown(stamp, 12345, -1)
    assert not trusted(path, os.lstat(path))
    os.chown(stamp, 0, -1)
    os.chown(path, 12345, -1)  # another user's blob in a shared cache: re-hashed, as before stamps
    assert not trusted(path, os.lstat(path))


def test_an_edit_with_its_mtime_set_back_is_rehashed(cached, monkeypatch):
    """Issue 39 item 1: mtime is the writer's to set (os.utime); ctime is not, and the stamp holds it."""
    store, digest, size, path = cached
    before = os.lstat(path)
    with open(path, "r+b") as f:
        f.write(b"\0" * 100)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.lstat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert not trusted(path, after)
    hashed, stats = _counting_hashes(monkeypatch), TransferStats()
    assert fetch_blob(store, digest, size, stats=stats) == path
    assert hashed and stats.fetched == size and sha256_file(path) == digest


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as a second member of the cache's group")
def test_a_group_member_renaming_blob_and_stamp_onto_another_digest_is_caught(tmp_path, monkeypatch):
    """Issue 39 item 2: a shared cache (group-writable, setgid, as docs/operations.md's recipe makes it); another member of
    the group renames the victim's blob of model A and its stamp onto the names of model B's blob of the same size.
    The victim's pull of B re-hashes (the stamp names A's digest, and the renames moved the ctime) and fetches B."""
    shared = Path(tempfile.mkdtemp(prefix="hive-aot-shared-cache-"))  # traversable: pytest's tmp dirs are 0700
    os.chmod(shared, 0o755)
    cache = shared / "cache"
    monkeypatch.setenv("HIVE_AOT_CACHE", str(cache))
    store = open_store(str(tmp_path / "store"))
    digests = []
    for seed in (1, 2):
        f = tmp_path / f"m{seed}.bin"
        f.write_bytes(random.Random(seed).randbytes(200_000))
        digests.append(store.put_blob(f))
    a, b = digests
    fetch_blob(store, a, 200_000)
    fetch_blob(store, b, 200_000)
    group = 4242
    for d in [cache, *cache.rglob("*")]:
        if d.is_dir():
            os.chown(d, -1, group)
            os.chmod(d, 0o2770)
    pa, pb = blob_cache.blob_path(a), blob_cache.blob_path(b)
    for src, dst in ((pa, pb), (stamp_path(pa), stamp_path(pb))):
        done = subprocess.run(["mv", "-f", str(src), str(dst)], user=12345, group=group, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr  # the member could do it: the directories are theirs to write
    assert sha256_file(pb) == a and os.lstat(pb).st_uid == 0  # B's name now holds A's bytes, still the victim's
    assert not trusted(pb, os.lstat(pb))
    stats = TransferStats()
    assert sha256_file(fetch_blob(store, b, 200_000, stats=stats)) == b and stats.fetched == 200_000
    shutil.rmtree(shared)


def test_a_name_swapped_after_verification_is_never_placed(cached, tmp_path):
    """What pull links into DIR must be the inode that verified: another blob renamed onto the name between the
    verification and the link (a shared cache's group member) stops the pull in one line, nothing placed."""
    from pipelines.client.blob_cache import fetch_verified
    from pipelines.client.pulled_dir import place
    from pipelines.core.errors import IntegrityError

    store, digest, size, path = cached
    blob = fetch_verified(store, digest, size)
    other = tmp_path / "other.bin"
    other.write_bytes(random.Random(9).randbytes(size))
    os.utime(other, ns=(blob.verified.st_atime_ns, blob.verified.st_mtime_ns))
    os.chmod(other, 0o644)
    os.replace(other, path)
    out = tmp_path / "dir" / "model.bin"
    out.parent.mkdir()
    with pytest.raises(IntegrityError, match="changed after it was verified") as ei:
        place(blob, out)
    assert "\n" not in str(ei.value) and not out.exists()


def test_gc_reclaims_stamps_whose_blob_is_gone(cached):
    """Issue 39 item 13: a blob deleted by hand (or replaced by another inode) leaves its stamp; `gc --min-age 0`
    (reclaim_partials) takes such stamps, and keeps the stamp of a blob that is there."""
    store, digest, size, path = cached
    other = random.Random(5).randbytes(1000)
    f = path.parent.parent / "x.bin"
    f.write_bytes(other)
    second = store.put_blob(f)
    f.unlink()
    kept = fetch_blob(store, second, 1000)
    path.unlink()
    removed = reclaim_partials(max_age_s=0)
    assert removed == [stamp_path(path).name]
    assert not stamp_path(path).exists() and stamp_path(kept).exists()
