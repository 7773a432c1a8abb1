"""The S3 store against a real S3 server (SeaweedFS on loopback): the same layout and guarantees as
the local store, a CLI build + pull round trip through s3://, and gc by object age."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from factories import store_contract, write_test_config

from pipelines.client.pull import pull
from pipelines.config.registry import Config
from pipelines.core.errors import IntegrityError, StoreError
from pipelines.core.hashing import sha256_file
from pipelines.engine.build import build_and_publish
from pipelines.store import blob_key, open_store
from pipelines.store.s3 import S3Store

REPO = Path.cwd()
MODEL = "test-org/tiny-s3"


def test_store_contract(s3_uri, tmp_path):
    store = open_store(s3_uri)
    assert isinstance(store, S3Store) and store.uri == s3_uri
    store_contract(store, "refs/m/r/latest")
    f = tmp_path / "blob.bin"
    f.write_bytes(os.urandom(300_000))
    digest = store.put_blob(f)
    assert digest == sha256_file(f) and store.size(blob_key(digest)) == 300_000
    assert store.put_blob(f) == digest  # content-addressed: second put is a no-op
    out = tmp_path / "back.bin"
    store.download_file(blob_key(digest), out)
    assert out.read_bytes() == f.read_bytes()
    with pytest.raises(IntegrityError):
        store.upload_file(blob_key("0" * 64), f, "0" * 64)  # wrong digest: refused before anything is written
    assert not store.exists(blob_key("0" * 64))
    with pytest.raises(StoreError, match="store key"):
        store.read_bytes("../escape")
    store.delete("refs/m/r/latest")
    store.delete("refs/m/r/latest")  # idempotent
    assert store.list("refs/") == []


def test_missing_bucket_is_one_line(s3_server):
    with pytest.raises(StoreError) as ei:
        open_store("s3://no-such-bucket-here/p").check_writable()
    assert "not writable" in str(ei.value) and "\n" not in str(ei.value)
    with pytest.raises(StoreError, match="is not s3://bucket"):
        open_store("s3://")


def test_build_publish_pull_round_trip_through_s3(s3_uri, tiny_llama, tmp_path):
    config = Config.load(write_test_config(tmp_path / "cfg", REPO))
    res = build_and_publish(str(tiny_llama), "gguf-f16", config, s3_uri, MODEL)
    assert res.state == "published" and res.manifest.startswith(f"{s3_uri}/manifests/test-org--tiny-s3/gguf-f16/")
    store = open_store(s3_uri)
    slug = "test-org--tiny-s3"
    assert f"refs/{slug}/gguf-f16/latest" in store.list(f"refs/{slug}/gguf-f16/")
    manifest = json.loads(store.read_bytes(f"manifests/{slug}/gguf-f16/{res.build_id}.json"))
    assert manifest["validation"]["passed"] is True and store.list("staging/") == []
    again = build_and_publish(str(tiny_llama), "gguf-f16", config, s3_uri, MODEL)
    assert again.skipped is True and again.build_id == res.build_id
    # the light client, with only the store's profiles.json (no registry): subprocess in an empty cwd
    env = {k: v for k, v in os.environ.items() if k != "HIVE_AOT_REGISTRY"}
    env["HIVE_AOT_CACHE"] = str(tmp_path / "pull-cache")
    dest = tmp_path / "serve"
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "pull", MODEL, "--target", "llm-llamacpp-cpu",
                           "--dest", str(dest), "--store", s3_uri, "--json"], capture_output=True, text=True,
                          timeout=300, env={**env, "PYTHONPATH": str(REPO)}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["build_id"] == res.build_id
    for f in manifest["files"]:
        assert sha256_file(dest / f["path"]) == f["sha256"]
    assert json.loads((dest / "hive-aot.json").read_text())["build_id"] == res.build_id


def test_corrupt_s3_blob_is_caught_by_pull(s3_uri, tiny_llama, tmp_path, monkeypatch):
    config = Config.load(write_test_config(tmp_path / "cfg", REPO))
    res = build_and_publish(str(tiny_llama), "gguf-f16", config, s3_uri, MODEL)
    store = open_store(s3_uri)
    key = blob_key(res.files[0]["sha256"])
    store.write_bytes(key, b"not the gguf")  # someone overwrote the object behind our back
    monkeypatch.setenv("HIVE_AOT_CACHE", str(tmp_path / "fresh-cache"))  # nothing cached from the build
    with pytest.raises(IntegrityError):
        pull(MODEL, "llm-llamacpp-cpu", tmp_path / "serve", store_uri=s3_uri, registry=str(REPO / "registry.yaml"))
    assert not (tmp_path / "serve").exists()


def test_gc_on_s3_keeps_referenced_and_young_blobs(s3_uri, tmp_path):
    from pipelines.client.inventory import gc

    store = open_store(s3_uri)
    young = tmp_path / "young.bin"
    young.write_bytes(b"in-flight build")
    digest = store.put_blob(young)
    assert gc(s3_uri, min_age_s=3600)["blobs"] == []  # too young: may belong to a build in flight
    removed = gc(s3_uri, min_age_s=0)
    assert removed["blobs"] == [blob_key(digest)] and not store.exists(blob_key(digest))


def test_ranged_reads_over_presigned_urls_match_botocore_and_say_what_is_missing(s3_uri, tmp_path, monkeypatch):
    """S3Store.iter_range reads through http.client over a presigned URL (s3_ranges.py): any range gives the
    object's bytes, a range past a short object's end gives what it has (the caller judges the shortfall), a
    missing key is one line; behind a proxy the store reads through botocore, with the same answers."""
    import pipelines.store.s3 as s3_module

    data = os.urandom((3 << 20) + 12345)
    for via_proxy in (False, True):
        if via_proxy:
            monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # never reached: botocore is not asked to
            monkeypatch.setattr(s3_module, "http_usable", lambda: False)
        store = open_store(s3_uri)
        store.write_bytes("ranges/object.bin", data)
        for start, length in ((0, len(data)), (1, 1 << 20), ((2 << 20) - 7, (1 << 20) + 100), (len(data) - 1, 1)):
            got = b"".join(store.iter_range("ranges/object.bin", start, length))
            assert got == data[start:start + length], (via_proxy, start, length)
        assert b"".join(store.iter_range("ranges/object.bin", len(data) - 10, 100)) == data[-10:]
        with pytest.raises(StoreError, match="ranges/missing.bin is missing"):
            b"".join(store.iter_range("ranges/missing.bin", 0, 10))
        assert (store._ranges is None) == via_proxy  # which reader answered
    assert store._ranges is None  # the proxied store never built the http.client reader


def _unfinished_uploads(store) -> list[str]:
    prefix = store.prefix + "/"
    return [u["Key"] for page in store.client.get_paginator("list_multipart_uploads").paginate(
        Bucket=store.bucket, Prefix=prefix) for u in page.get("Uploads", [])]


def _sent_in_parts(monkeypatch, tmp_path: Path, parts: int, tail: int) -> tuple[int, Path]:
    """(part size, file): S3's smallest part size made the store's, and a file of `parts` of them plus `tail` bytes,
    so a test's blob goes up through the multipart path (s3_upload.py) without a 64 MiB file."""
    import pipelines.store.s3 as s3_module
    import pipelines.store.s3_upload as s3_upload

    part = 5 << 20
    monkeypatch.setattr(s3_module, "CHUNK", part)
    monkeypatch.setattr(s3_upload, "PART_BYTES", part)
    f = tmp_path / "big.bin"
    f.write_bytes(os.urandom(parts * part + tail))
    return part, f


def test_multipart_upload_hashes_as_it_sends_and_completes_only_a_match(s3_uri, tmp_path, monkeypatch):
    """A blob above the part size goes up in parts over presigned URLs (s3_upload.py) while its sha256 follows:
    the object appears, with the digest in its metadata, only when the digest matches and the file did not change;
    a mismatch, a change meanwhile, or a part the server refuses leaves nothing visible and no unfinished upload."""
    import pipelines.store.s3_upload as s3_upload

    part, f = _sent_in_parts(monkeypatch, tmp_path, 3, 12345)
    store = open_store(s3_uri)
    digest = store.put_blob(f)
    assert digest == sha256_file(f) and store._uploads is not None  # the parts path answered
    head = store.client.head_object(Bucket=store.bucket, Key=store._key(blob_key(digest)))
    assert head["Metadata"]["sha256"] == digest and head["ContentLength"] == f.stat().st_size
    assert store.blob_intact(digest, f.stat().st_size)
    assert b"".join(store.iter_range(blob_key(digest), 0, f.stat().st_size)) == f.read_bytes()

    wrong = "0" * 64
    with pytest.raises(IntegrityError, match="does not match sha256 000000000000"):
        store.upload_file(blob_key(wrong), f, wrong)
    assert not store.exists(blob_key(wrong)) and _unfinished_uploads(store) == []

    sent = s3_upload.MultipartUpload._send_part
    touched = []

    f2 = tmp_path / "big2.bin"
    f2.write_bytes(os.urandom(2 * part + 1))

    def touch_first(self, *args):  # the file is written to (same bytes) while its parts go out
        if not touched:
            st = f2.stat()
            touched.append(os.utime(f2, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9)))
        return sent(self, *args)

    monkeypatch.setattr(s3_upload.MultipartUpload, "_send_part", touch_first)
    d2 = sha256_file(f2)
    with pytest.raises(IntegrityError, match="changed while uploading"):
        store.upload_file(blob_key(d2), f2, d2)
    assert not store.exists(blob_key(d2)) and _unfinished_uploads(store) == []
    monkeypatch.setattr(s3_upload.MultipartUpload, "_send_part", sent)

    presign = store.client.generate_presigned_url

    def forged(*args, **kwargs):  # a part's signature the server does not accept
        url = presign(*args, **kwargs)
        return re.sub(r"Signature=[^&]+", "Signature=Zm9yZ2Vk", url) if args[0] == "upload_part" else url

    monkeypatch.setattr(store.client, "generate_presigned_url", forged)
    with pytest.raises(StoreError) as refused:
        store.upload_file(blob_key(d2), f2, d2)
    assert "access denied" in str(refused.value) and "Signature" not in str(refused.value)
    assert "\n" not in str(refused.value)
    assert not store.exists(blob_key(d2)) and _unfinished_uploads(store) == []


def test_gc_aborts_the_unfinished_uploads_of_killed_publishers(s3_uri):
    """A publisher killed mid-upload leaves an invisible multipart upload whose parts take space: gc aborts it once
    it is older than the age that protects publishes in flight, and lists it under `temporaries`."""
    from pipelines.client.inventory import gc

    store = open_store(s3_uri)
    k = store._key(blob_key("ab" * 32))
    upload = store.client.create_multipart_upload(Bucket=store.bucket, Key=k)["UploadId"]
    store.client.upload_part(Bucket=store.bucket, Key=k, UploadId=upload, PartNumber=1, Body=b"x" * 1000)
    assert store.reclaim_temporaries(3600) == [] and _unfinished_uploads(store) == [k]  # may be in flight
    named = [f"{blob_key('ab' * 32)} (unfinished upload)"]
    assert store.reclaim_temporaries(0, dry_run=True) == named and _unfinished_uploads(store) == [k]
    assert gc(s3_uri, min_age_s=0)["temporaries"] == named
    assert _unfinished_uploads(store) == [] and not store.exists(blob_key("ab" * 32))


def _overwrite_keeping_metadata(store, key: str) -> None:
    """Replace an object with other bytes of the same size, its metadata copied (a sync tool re-uploading a damaged
    local copy with `--metadata`, or a hand-made "fix"): what size and the recorded sha256 cannot tell apart."""
    k = store._key(key)
    head = store.client.head_object(Bucket=store.bucket, Key=k)
    data = bytearray(b"".join(store.iter_range(key, 0, head["ContentLength"])))
    data[len(data) // 2] ^= 0xFF
    store.client.put_object(Bucket=store.bucket, Key=k, Body=bytes(data), Metadata=head["Metadata"])


def test_a_blob_replaced_with_its_metadata_copied_is_repaired_by_the_next_build(s3_uri, tiny_llama, tmp_path,
                                                                               monkeypatch):
    """Issue 39 item 12: S3's blob_intact trusted size and the recorded sha256, so a replaced blob was left in place
    and the next build answered skipped. The upload's evidence (S3's SHA-256 checksum of a single PUT) tells it."""
    config = Config.load(write_test_config(tmp_path / "cfg", REPO))
    res = build_and_publish(str(tiny_llama), "gguf-f16", config, s3_uri, "test-org/tiny-s3-repair")
    store = open_store(s3_uri)
    for f in res.files:
        assert store.blob_intact(f["sha256"], f["size"])
        _overwrite_keeping_metadata(store, blob_key(f["sha256"]))
        assert not store.blob_intact(f["sha256"], f["size"])
    again = build_and_publish(str(tiny_llama), "gguf-f16", config, s3_uri, "test-org/tiny-s3-repair")
    assert again.state == "repaired" and again.build_id == res.build_id
    assert all(store.blob_intact(f["sha256"], f["size"]) for f in res.files)
    monkeypatch.setenv("HIVE_AOT_CACHE", str(tmp_path / "fresh-cache"))
    out = pull("test-org/tiny-s3-repair", "llm-llamacpp-cpu", tmp_path / "serve", store_uri=s3_uri,
               registry=str(REPO / "registry.yaml"))
    assert [sha256_file(Path(p)) for p in out.files] == [f["sha256"] for f in res.files]


def test_a_multipart_blob_replaced_with_its_metadata_copied_is_uploaded_again(s3_uri, tmp_path, monkeypatch):
    """The same for a blob sent in parts: its completion ETag, kept in an object tag, no longer matches."""
    _part, f = _sent_in_parts(monkeypatch, tmp_path, 2, 99)
    store = open_store(s3_uri)
    digest = store.put_blob(f)
    size = f.stat().st_size
    assert store._uploads is not None and store.blob_intact(digest, size)
    _overwrite_keeping_metadata(store, blob_key(digest))
    assert not store.blob_intact(digest, size)
    assert store.put_blob(f) == digest and store.blob_intact(digest, size)  # repaired: uploaded again
    assert sha256_file(f) == digest
    got = b"".join(store.iter_range(blob_key(digest), 0, size))
    assert got == f.read_bytes()
