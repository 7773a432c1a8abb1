"""`hive-aot verify MODEL` (issue 39 items 11 and 12): a published build checked in the store without pulling it,
by the store's own policy and with --deep by hashing what the store holds, on a local store and on S3. (The OCI
store's case, a manifest whose layers were rewritten, is in tests/store/test_store_oci.py.)"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from pipelines.cli.main import main
from pipelines.store import blob_key, open_store
from pipelines.store.layout import manifest_key, ref_key
from pipelines.store.manifest import FileEntry, Manifest, ModelInfo, RecipeInfo

MODEL = "test-org/verified"
SIZES = (300_000, 5_000)


def _publish(uri: str, tmp_path: Path) -> Manifest:
    """A hand-made build of two files (no conversion: what verify reads is the store's documents and blobs)."""
    store = open_store(uri)
    files = []
    for i, size in enumerate(SIZES):
        f = tmp_path / f"f{i}.bin"
        f.write_bytes(random.Random(i).randbytes(size))
        files.append(FileEntry(path=f"part-{i}.bin", sha256=store.put_blob(f), size=size))
    m = Manifest(build_id="ab" * 32, model=ModelInfo(id=MODEL, revision="r", commit="c", source="s",
                                                     content_digest="cd" * 32),
                 recipe=RecipeInfo(id="gguf-f16", kind="gguf", digest="ef" * 32, options={}),
                 runtime_profiles=["llm-llamacpp-cpu"], format="gguf", files=files, toolchain={})
    raw = m.to_bytes()
    key = manifest_key(MODEL, "gguf-f16", m.build_id)
    store.write_bytes(key, raw)
    store.write_bytes(ref_key(MODEL, "gguf-f16", "latest"), json.dumps(
        {"build_id": m.build_id, "manifest": key, "manifest_sha256": hashlib.sha256(raw).hexdigest(),
         "created_at": "now"}).encode())
    return m


def _verify(capfd, uri: str, *extra: str) -> tuple[int, dict, str]:
    capfd.readouterr()
    rc = main(["verify", MODEL, "--store", uri, "--json", *extra])
    out = capfd.readouterr()
    return rc, json.loads(out.out), out.err


def _states(doc: dict) -> list[str]:
    return [f["state"] for b in doc["builds"] for f in b["files"]]


def test_an_intact_build_then_a_damaged_and_a_missing_blob_on_a_local_store(tmp_path, capfd):
    uri = str(tmp_path / "store")
    m = _publish(uri, tmp_path)
    for deep in ((), ("--deep",)):
        rc, doc, err = _verify(capfd, uri, *deep)
        assert rc == 0 and doc["intact"] and _states(doc) == ["intact", "intact"] and err == ""
    blob = tmp_path / "store" / blob_key(m.files[0].sha256)
    data = bytearray(blob.read_bytes())
    data[100] ^= 1
    blob.write_bytes(bytes(data))  # same size, one bit
    (tmp_path / "store" / blob_key(m.files[1].sha256)).unlink()
    for deep in ((), ("--deep",)):
        rc, doc, err = _verify(capfd, uri, *deep)
        assert rc == 1 and not doc["intact"] and _states(doc) == ["damaged", "missing"]
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("hive-aot: error: test-org/verified: gguf-f16 abababababab")


def test_nothing_published_is_one_line(tmp_path, capfd):
    rc = main(["verify", MODEL, "--store", str(tmp_path / "empty")])
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "hive-aot: error:" in err[0]


def test_s3_policy_and_deep_both_see_a_blob_replaced_with_its_metadata_copied(s3_uri, tmp_path, capfd):
    """S3's cheap policy compares the evidence the verified upload left (S3's SHA-256 checksum here); --deep reads
    and hashes. Both find the blob someone replaced at the same size with the recorded sha256 copied."""
    m = _publish(s3_uri, tmp_path)
    assert _verify(capfd, s3_uri)[0] == 0
    store = open_store(s3_uri)
    k = store._key(blob_key(m.files[1].sha256))
    head = store.client.head_object(Bucket=store.bucket, Key=k)
    store.client.put_object(Bucket=store.bucket, Key=k, Body=bytes(head["ContentLength"]), Metadata=head["Metadata"])
    for deep in ((), ("--deep",)):
        rc, doc, _err = _verify(capfd, s3_uri, *deep)
        assert rc == 1 and _states(doc) == ["intact", "damaged"], deep


@pytest.mark.parametrize("flag", ["--recipe", "--tag"])
def test_recipe_and_tag_select_what_is_checked(flag, tmp_path, capfd):
    uri = str(tmp_path / "store")
    _publish(uri, tmp_path)
    rc = main(["verify", MODEL, "--store", uri, flag, "other"])
    err = capfd.readouterr().err
    assert rc == 1 and "nothing published" in err
