"""LocalStore: atomic writes, verified blobs, confined keys, clear errors."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from pipelines.core.errors import HiveError, IntegrityError, StoreError
from pipelines.store import blob_key, manifest_key, open_store, ref_key, staging_key
from pipelines.store.local import LocalStore


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_open_store_uris(tmp_path, monkeypatch):
    s = open_store(f"file://{tmp_path}/a")
    assert isinstance(s, LocalStore) and s.root == tmp_path / "a" and s.uri == (tmp_path / "a").as_uri()
    monkeypatch.chdir(tmp_path)
    assert open_store("rel/store").root == tmp_path / "rel" / "store"
    monkeypatch.delenv("HIVE_AOT_STORE", raising=False)
    assert open_store().root == tmp_path / "artifacts"  # the embedded default
    monkeypatch.setenv("HIVE_AOT_STORE", str(tmp_path / "env"))
    assert open_store().root == tmp_path / "env"


def test_key_layout():
    d = "ab" + "0" * 62
    assert blob_key(d) == f"blobs/sha256/ab/{d}"
    assert manifest_key("org/name", "gguf-f16", d) == f"manifests/org--name/gguf-f16/{d}.json"
    assert ref_key("org/name", "gguf-f16", "latest") == "refs/org--name/gguf-f16/latest"
    assert staging_key(d) == f"staging/{d}.json"
    for bad in ("AB" + "0" * 62, "sha256:" + d, d[:-1], "../" + d[3:]):
        with pytest.raises(IntegrityError, match="not a bare lowercase sha256"):
            blob_key(bad)
    with pytest.raises(IntegrityError, match="not a valid tag"):
        ref_key("org/name", "gguf-f16", "../latest")


def test_write_read_list_delete(store_dir):
    s = LocalStore(store_dir)
    assert s.read_bytes("refs/x/y/latest") is None and not s.exists("refs/x/y/latest") and s.size("a/b") is None
    s.write_bytes("refs/x/y/latest", b'{"a": 1}')
    s.write_bytes("manifests/x/y/z.json", b"{}")
    assert s.read_json("refs/x/y/latest") == {"a": 1}
    assert s.size("refs/x/y/latest") == 8
    assert s.list("refs/") == ["refs/x/y/latest"]
    assert s.list("") == ["manifests/x/y/z.json", "refs/x/y/latest"]
    assert s.list("nothing/") == []
    s.write_bytes("refs/x/y/latest", b"new")  # overwrite is atomic, too
    assert s.read_bytes("refs/x/y/latest") == b"new"
    s.delete("refs/x/y/latest")
    s.delete("refs/x/y/latest")  # idempotent
    assert not s.exists("refs/x/y/latest")
    # a key below a regular file is simply absent for readers
    assert s.read_bytes("manifests/x/y/z.json/deeper") is None


def test_no_partial_file_is_visible_during_a_write(store_dir):
    s = LocalStore(store_dir)
    seen = {}

    def writer(f):
        f.write(b"x" * 1000)
        f.flush()
        # mid-write: the key does not exist yet and listings hide the temporary
        seen["exists"] = s.exists("refs/m/r/latest")
        seen["read"] = s.read_bytes("refs/m/r/latest")
        seen["list"] = s.list("")
        seen["tmp"] = [p.name for p in (store_dir / "refs/m/r").iterdir()]
        f.write(b"y")

    s._atomic_write(s._path("refs/m/r/latest"), writer)
    assert seen["exists"] is False and seen["read"] is None and seen["list"] == []
    assert len(seen["tmp"]) == 1 and seen["tmp"][0].startswith(".latest.") and seen["tmp"][0].endswith(".tmp")
    assert s.read_bytes("refs/m/r/latest") == b"x" * 1000 + b"y"
    assert _files(store_dir) == ["refs/m/r/latest"]
    assert (store_dir / "refs/m/r/latest").stat().st_mode & 0o777 == 0o644


def test_failure_mid_write_leaves_nothing(store_dir):
    s = LocalStore(store_dir)

    class Boom(RuntimeError):
        pass

    def writer(f):
        f.write(b"half of it")
        raise Boom("crash mid-write")

    with pytest.raises(Boom):
        s._atomic_write(s._path("refs/m/r/latest"), writer)
    assert not s.exists("refs/m/r/latest")
    assert _files(store_dir) == []  # no temporary left either

    # over an existing object: the old bytes survive whole
    s.write_bytes("refs/m/r/latest", b"old")
    with pytest.raises(Boom):
        s._atomic_write(s._path("refs/m/r/latest"), writer)
    assert s.read_bytes("refs/m/r/latest") == b"old"
    assert _files(store_dir) == ["refs/m/r/latest"]


def test_put_blob_stores_verified_content(tmp_path, store_dir):
    src = tmp_path / "artifact.gguf"
    src.write_bytes(os.urandom(10_000))
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    s = LocalStore(store_dir)
    assert s.put_blob(src) == digest
    assert s.read_bytes(blob_key(digest)) == src.read_bytes()
    assert _files(store_dir) == [f"blobs/sha256/{digest[:2]}/{digest}"]
    # content-addressed: a second put is a no-op
    before = (store_dir / blob_key(digest)).stat().st_mtime_ns
    assert s.put_blob(src, digest) == digest
    assert (store_dir / blob_key(digest)).stat().st_mtime_ns == before


def test_put_blob_with_wrong_digest_stores_nothing(tmp_path, store_dir):
    src = tmp_path / "artifact.gguf"
    src.write_bytes(b"real content")
    wrong = hashlib.sha256(b"other content").hexdigest()
    s = LocalStore(store_dir)
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        s.put_blob(src, wrong)
    assert not s.exists(blob_key(wrong))
    assert _files(store_dir) == []


@pytest.mark.parametrize("damage", [b"short", b"9876543210"], ids=["truncated", "same-size"])
def test_put_blob_repairs_a_damaged_existing_blob(tmp_path, store_dir, damage):
    """A blob already there is trusted only if intact (full sha256, remembered per file stamp): a damaged
    one is replaced by the verified upload, even right after it was verified intact once."""
    src = tmp_path / "a"
    src.write_bytes(b"0123456789")
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    s = LocalStore(store_dir)
    s.put_blob(src, digest)
    assert s.blob_intact(digest, 10)  # hashed once, remembered
    (store_dir / blob_key(digest)).write_bytes(damage)
    assert not s.blob_intact(digest, 10)
    s.put_blob(src, digest)
    assert s.read_bytes(blob_key(digest)) == b"0123456789" and s.blob_intact(digest, 10)


@pytest.mark.parametrize("key", ["../escape", "/etc/passwd", "refs/../../escape", "refs/x/../../../escape",
                                 "refs\\..\\x", "refs/x/", "", "a:b", "refs/\x00"])
def test_keys_are_confined(store_dir, key):
    s = LocalStore(store_dir)
    for op in (lambda: s.write_bytes(key, b"x"), lambda: s.read_bytes(key), lambda: s.exists(key),
               lambda: s.delete(key)):
        with pytest.raises(HiveError, match="refusing store key"):
            op()
    assert not (store_dir.parent / "escape").exists()
    assert not store_dir.exists() or _files(store_dir) == []


def test_check_writable_ok_creates_root(store_dir):
    s = LocalStore(store_dir / "deep" / "er")
    s.check_writable()
    assert (store_dir / "deep" / "er").is_dir()
    assert list((store_dir / "deep" / "er").iterdir()) == []  # the probe is cleaned up


def test_check_writable_refuses_unwritable_location(tmp_path):
    # Tests run as root, so chmod 0o555 would not stop a write: a path below a regular file fails for everyone.
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    s = LocalStore(blocker / "sub")
    with pytest.raises(StoreError, match=rf"store {blocker / 'sub'} is not writable \(") as ei:
        s.check_writable()
    assert "\n" not in str(ei.value)
    with pytest.raises(StoreError, match="cannot write latest"):
        s.write_bytes("refs/m/r/latest", b"x")


def test_check_writable_refuses_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    try:
        probe = ro / "probe"
        try:
            probe.write_text("x")
        except PermissionError:
            pass
        else:
            probe.unlink()
            pytest.skip("running as root: mode 0o555 does not stop writes (covered by the path-below-a-file test)")
        with pytest.raises(StoreError, match="is not writable"):
            LocalStore(ro).check_writable()
    finally:
        os.chmod(ro, 0o755)


def test_download_file(tmp_path, store_dir):
    s = LocalStore(store_dir)
    s.write_bytes("blobs/x", b"abc")
    s.download_file("blobs/x", tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == b"abc"
    with pytest.raises(StoreError, match="blobs/y is missing"):
        s.download_file("blobs/y", tmp_path / "out2")
    assert s.local_path("blobs/x") == store_dir / "blobs/x" and s.local_path("blobs/y") is None


def test_store_uris_dispatch():
    from pipelines.store.local import LocalStore
    from pipelines.store.s3 import S3Store

    s3 = open_store("s3://bucket/some/prefix")
    assert isinstance(s3, S3Store) and (s3.bucket, s3.prefix, s3.uri) == ("bucket", "some/prefix", "s3://bucket/some/prefix")
    assert isinstance(open_store("file:///tmp/x"), LocalStore) and isinstance(open_store("rel/dir"), LocalStore)
    with pytest.raises(StoreError, match="is not s3://bucket"):
        open_store("s3:///prefix")


def test_stale_temporaries_of_killed_writers_are_reclaimed(store_dir):
    """A writer killed between write and rename leaves `.<name>.<random>.tmp`: old ones go, fresh ones stay."""
    import os
    import time

    s = LocalStore(store_dir)
    s.write_bytes("refs/m/r/latest", b"{}")
    stale = store_dir / "refs" / "m" / "r" / ".latest.abc.tmp"
    fresh = store_dir / "refs" / "m" / "r" / ".latest.def.tmp"
    for p in (stale, fresh):
        p.write_bytes(b"half")
    past = time.time() - 7200
    os.utime(stale, (past, past))
    assert s.reclaim_temporaries(3600, dry_run=True) == ["refs/m/r/.latest.abc.tmp"] and stale.exists()
    assert s.reclaim_temporaries(3600) == ["refs/m/r/.latest.abc.tmp"]
    assert not stale.exists() and fresh.exists() and s.read_bytes("refs/m/r/latest") == b"{}"
