"""pipelines/core/hashing.py: file and canonical-JSON digests, and the digest cache keyed by file identity.

The digests are checked against hashlib on the same bytes, the canonical form against the JSON a reader
writes by hand (it is part of every build id: a change would rebuild every published model), and the cache
against real file-system changes that keep a file's size and mtime but not its bytes.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from pipelines.core.hashing import DigestCache, canonical_json, sha256_file, sha256_json


class Counter:
    """The progress protocol sha256_file reports to (`update(n)`), totalled."""

    def __init__(self) -> None:
        self.total, self.calls = 0, 0

    def update(self, n: int) -> None:
        self.total += n
        self.calls += 1


@pytest.mark.parametrize("size", [0, 1, 4 * 1024 * 1024 - 1, 9 * 1024 * 1024 + 7])  # empty, tiny, several reads
def test_sha256_file_is_hashlib_of_the_bytes_and_reports_every_byte(tmp_path, size):
    data = os.urandom(size)
    path = tmp_path / "blob"
    path.write_bytes(data)
    progress = Counter()
    assert sha256_file(path, progress) == hashlib.sha256(data).hexdigest()
    assert progress.total == size
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()  # no progress object: same digest


def test_sha256_file_of_a_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        sha256_file(tmp_path / "absent")


def test_canonical_json_is_sorted_compact_utf8():
    """Written out by hand: keys sorted at every depth, no spaces, non-ASCII as UTF-8 (not \\u escapes)."""
    doc = {"z": [3, {"b": "é", "a": None}], "a": True, "m": 1.5}
    assert canonical_json(doc) == '{"a":true,"m":1.5,"z":[3,{"a":null,"b":"é"}]}'.encode()
    # the same document built in another order is the same bytes
    assert canonical_json({"m": 1.5, "a": True, "z": [3, {"a": None, "b": "é"}]}) == canonical_json(doc)
    # and the bytes are JSON that reads back as the document
    assert json.loads(canonical_json(doc)) == doc


def test_sha256_json_is_the_digest_of_the_canonical_bytes():
    doc = {"files": [["b.safetensors", "00"], ["a.safetensors", "ff"]], "name": "ünïcode"}
    expected = hashlib.sha256('{"files":[["b.safetensors","00"],["a.safetensors","ff"]],"name":"ünïcode"}'
                              .encode()).hexdigest()
    assert sha256_json(doc) == expected
    assert sha256_json({"name": "ünïcode", "files": doc["files"]}) == expected  # key order is not content
    assert sha256_json({**doc, "files": doc["files"][::-1]}) != expected  # list order is


# --- DigestCache --------------------------------------------------------------------------------------------

@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """The digest cache lives in the cache root; each test gets an empty one."""
    root = tmp_path / "cache"
    monkeypatch.setenv("HIVE_AOT_CACHE", str(root))
    return root


def test_a_saved_digest_is_found_by_the_next_process(cache_dir, tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"weights")
    digest = hashlib.sha256(b"weights").hexdigest()
    first = DigestCache()
    assert first.get(path) is None
    first.put(path, digest)
    first.save()
    assert DigestCache().get(path) == digest  # read back from disk by a fresh instance
    # reached through a symlink: the same real file, the same entry
    link = tmp_path / "link.bin"
    link.symlink_to(path)
    assert DigestCache().get(link) == digest


def test_rewriting_a_file_in_place_misses_even_with_size_and_mtime_restored(cache_dir, tmp_path):
    """The attack on a size+mtime cache: same length, same mtime, other bytes. ctime cannot be set back."""
    path = tmp_path / "weights.bin"
    path.write_bytes(b"AAAA")
    cache = DigestCache()
    cache.put(path, hashlib.sha256(b"AAAA").hexdigest())
    before = path.stat()
    with open(path, "r+b") as f:  # same inode, same size
        f.write(b"BBBB")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns
    assert cache.get(path) is None


def test_replacing_a_file_by_rename_misses(cache_dir, tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"AAAA")
    cache = DigestCache()
    cache.put(path, hashlib.sha256(b"AAAA").hexdigest())
    other = tmp_path / "other.bin"
    other.write_bytes(b"BBBB")
    st = path.stat()
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)  # another inode under the same name
    assert cache.get(path) is None


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b""])
def test_a_damaged_cache_file_is_an_empty_cache(cache_dir, tmp_path, content):
    cache_dir.mkdir(parents=True)
    (cache_dir / "digests.json").write_bytes(content)
    path = tmp_path / "f"
    path.write_bytes(b"x")
    cache = DigestCache()
    assert cache.get(path) is None
    cache.put(path, "ab" * 32)
    cache.save()  # and the damaged file is replaced by a good one
    assert DigestCache().get(path) == "ab" * 32


def test_save_writes_nothing_without_changes_and_never_fails(cache_dir, tmp_path):
    DigestCache().save()
    assert not (cache_dir / "digests.json").exists()
    # a cache root that cannot be created (a file is in the way) only costs the cache
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    cache_dir.write_bytes(b"a file, not a directory")
    path = tmp_path / "f"
    path.write_bytes(b"x")
    cache = DigestCache()
    cache.put(path, "cd" * 32)
    cache.save()
    assert cache_dir.read_bytes() == b"a file, not a directory"
