"""The `oci-layout:///DIR/NAME` store (pipelines/store/oci_dir.py): the OCI store's mapping on a directory of OCI image
layouts, one per repository. Checked with an independent reader (skopeo's `oci:` transport): the store contract; a
build published straight into a layout, pulled, verified, listed and retired through the CLI, each model's
directory a layout skopeo reads and pushes; concurrent tag writers losing nothing; a Modelcar image streamed into a
layout; the URI rules; and what a damaged directory holds (an index.json that is no index, a manifest or blob
whose bytes changed, a manifest naming a missing blob): one line each."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from factories import store_contract, write_test_config

from pipelines.cli.main import main
from pipelines.client.pull import pull
from pipelines.config.registry import Config
from pipelines.core.errors import IntegrityError, StoreError
from pipelines.engine.build import build_and_publish
from pipelines.store import blob_key, manifest_key, open_store
from pipelines.store.oci import OciStore
from pipelines.store.oci_dir import LayoutRegistry
from pipelines.store.oci_dir_index import ref_name, tag_of
from pipelines.store.oci_modelpack import EMPTY, EMPTY_BYTES, MODEL_ARTIFACT

REPO = Path.cwd()
MODEL, CPU, RECIPE = "test-org/Tiny-Layout", "llm-llamacpp-cpu", "gguf-f16"
SLUG_REPO = "test-org--tiny-layout"


def _skopeo(*args: str) -> str:
    proc = subprocess.run(["skopeo", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def published(tiny_llama, tmp_path_factory):
    """The tiny model's gguf-f16 build published straight into an oci-layout store."""
    root = tmp_path_factory.mktemp("layout-publish")
    uri = f"oci-layout://{root}/airgap/hive"
    config = Config.load(write_test_config(root / "cfg", REPO))
    res = build_and_publish(str(tiny_llama), RECIPE, config, uri, MODEL)
    assert res.state == "published", res
    return {"uri": uri, "dir": root / "airgap" / "hive", "res": res}


def test_store_contract(tmp_path):
    store = open_store(f"oci-layout://{tmp_path}/s/hive")
    assert isinstance(store, OciStore) and store.uri == f"oci-layout://{tmp_path}/s/hive"
    store_contract(store, "refs/m--x/r/latest")
    f = tmp_path / "blob.bin"
    f.write_bytes(os.urandom(300_000))
    digest = store.put_blob(f)
    assert store.read_bytes(blob_key(digest)) == f.read_bytes()
    assert b"".join(store.iter_range(blob_key(digest), 1000, 5000)) == f.read_bytes()[1000:6000]
    assert store.blob_intact(digest, 300_000) and store.list("blobs/") == [blob_key(digest)]
    store.delete(blob_key(digest))
    assert store.size(blob_key(digest)) is None and store.list("blobs/") == []
    layout = tmp_path / "s" / "hive" / "m--x"
    assert json.loads((layout / "oci-layout").read_bytes()) == {"imageLayoutVersion": "1.0.0"}
    tagged = json.loads((layout / "index.json").read_bytes())["manifests"]
    assert [e["annotations"]["org.opencontainers.image.ref.name"] for e in tagged] == ["r.latest"]
    # the ref was written twice: the artifact the tag moved off is gone, the one it names is a blob
    manifests = [p.name for p in (layout / "blobs" / "sha256").iterdir() if p.name != EMPTY["digest"][7:]]
    assert manifests == [tagged[0]["digest"][7:]]


def test_uri_rules(tmp_path):
    for uri, needle in ((f"oci-layout://{tmp_path.name}/x", "absolute directory"), ("oci-layout:///", "absolute"),
                        (f"oci-layout://{tmp_path}/Upper", "not an OCI repository name"),
                        (f"oci-layout://u:p@{tmp_path}/x", "no user-info"),
                        (f"oci-layout://{tmp_path}/x?a=b", "no user-info")):
        with pytest.raises(StoreError, match=needle):
            open_store(uri)
    assert not any(tmp_path.iterdir())


def test_ref_names_follow_the_image_spec_grammar():
    for tag, name in ((f"_m.gguf-f16.{'a' * 64}", f"hive-aot+m.gguf-f16.{'a' * 64}"),
                      ("gguf-f16.latest", "gguf-f16.latest"), (f"sha256-{'b' * 64}", f"sha256-{'b' * 64}"),
                      ("r.v1-", "hive-aot@" + b"r.v1-".hex()), ("a__b", "hive-aot@" + b"a__b".hex())):
        assert ref_name(tag) == name and tag_of(name) == tag


def test_a_build_published_into_a_layout_pulls_and_skopeo_reads_it(published, oci_registry, tmp_path, capsys):
    res, layout = published["res"], published["dir"] / SLUG_REPO
    got = pull(MODEL, CPU, tmp_path / "m", recipe=RECIPE, store_uri=published["uri"])
    assert got.build_id == res.build_id
    manifest = json.loads(open_store(published["uri"]).read_bytes(manifest_key(MODEL, RECIPE, res.build_id)))
    for f in manifest["files"]:
        assert hashlib.sha256((tmp_path / "m" / f["path"]).read_bytes()).hexdigest() == f["sha256"]
        assert (layout / "blobs" / "sha256" / f["sha256"]).is_file()  # every layer in the model's own layout
    assert main(["verify", MODEL, "--deep", "--store", published["uri"]]) == 0
    assert main(["ls", "--store", published["uri"], "--json"]) == 0
    assert res.build_id in capsys.readouterr().out
    raw = _skopeo("inspect", "--raw", f"oci:{layout}:{RECIPE}.latest")
    doc = json.loads(raw)
    assert doc["artifactType"] == MODEL_ARTIFACT
    assert {la["digest"][7:] for la in doc["layers"]} >= {f["sha256"] for f in manifest["files"]}
    mirror = f"{oci_registry}/from-layout-{os.urandom(4).hex()}"
    _skopeo("copy", "--preserve-digests", "--dest-tls-verify=false", f"oci:{layout}:{RECIPE}.latest",
            f"docker://{mirror}/{SLUG_REPO}:{RECIPE}.latest")
    assert hashlib.sha256(_skopeo("inspect", "--raw", "--tls-verify=false",
                                  f"docker://{mirror}/{SLUG_REPO}:{RECIPE}.latest").encode()).digest() == \
        hashlib.sha256(raw.encode()).digest()


def test_retire_and_gc_empty_a_layout(published, tmp_path):
    src = tmp_path / "copy"
    shutil.copytree(published["dir"], src / "hive")
    uri = f"oci-layout://{src}/hive"
    leftover = src / "hive" / SLUG_REPO / "ingest" / "tmp-killed"
    leftover.write_bytes(b"half a blob")
    os.utime(leftover, (1, 1))
    assert main(["retire", MODEL, "--store", uri]) == 0
    assert main(["gc", "--store", uri, "--min-age", "0"]) == 0
    store = open_store(uri)
    assert store.list("refs/") == [] and store.list("manifests/") == [] and store.list("blobs/") == []
    assert not leftover.exists()
    assert json.loads((src / "hive" / SLUG_REPO / "index.json").read_bytes())["manifests"] == []


def test_concurrent_tag_writers_lose_nothing(tmp_path):
    """Each writer with its own LayoutRegistry (as separate processes would be): index.json is read-modify-written
    under a lock file, so every tag survives."""
    repo = "hive/m--x"
    LayoutRegistry(tmp_path, "hive").upload_blob(repo, EMPTY["digest"], EMPTY["size"], EMPTY_BYTES)
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        reg = LayoutRegistry(tmp_path, "hive")
        try:
            for i in range(15):
                body = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                                   "config": EMPTY, "layers": [], "annotations": {"n": f"{n}.{i}"}}).encode()
                reg.put_manifest(repo, f"t{n}.{i}", body)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert LayoutRegistry(tmp_path, "hive").tags(repo) == sorted(f"t{n}.{i}" for n in range(4) for i in range(15))


def test_a_modelcar_image_streams_into_a_layout(published, tmp_path):
    from pipelines.store.oci_modelcar import push_modelcar

    store = open_store(published["uri"])
    key = manifest_key(MODEL, RECIPE, published["res"].build_id)
    files = [(f["path"], f["sha256"], f["size"]) for f in json.loads(store.read_bytes(key))["files"]]
    out = push_modelcar(store, key, files, published["res"].build_id, labels={}, name="latest", chunk=1 << 16)
    layout = published["dir"] / SLUG_REPO
    image = json.loads(_skopeo("inspect", "--raw", f"oci:{layout}:{out['tag']}"))
    assert image["layers"][-1]["digest"] == out["layer"]
    _skopeo("copy", f"oci:{layout}:{out['tag']}", f"dir:{tmp_path / 'image'}")  # a runnable image's layout
    assert not list((layout / "ingest").glob("upload-*"))


def test_damage_is_one_line(published, tmp_path, monkeypatch, capsys):
    src = tmp_path / "copy"
    shutil.copytree(published["dir"], src / "hive")
    uri, layout = f"oci-layout://{src}/hive", src / "hive" / SLUG_REPO
    key = manifest_key(MODEL, RECIPE, published["res"].build_id)
    index = json.loads((layout / "index.json").read_bytes())
    m_entry = next(e for e in index["manifests"]
                   if e["annotations"]["org.opencontainers.image.ref.name"].startswith("hive-aot+m."))
    manifest_blob = layout / "blobs" / "sha256" / m_entry["digest"][7:]
    saved = manifest_blob.read_bytes()
    manifest_blob.write_bytes(saved.replace(b'"schemaVersion":2', b'"schemaVersion": 2'))
    with pytest.raises(IntegrityError, match="does not match its digest: the layout is damaged"):
        open_store(uri).read_bytes(key)
    manifest_blob.write_bytes(saved)
    f = json.loads(open_store(uri).read_bytes(key))["files"][0]
    layer = layout / "blobs" / "sha256" / f["sha256"]
    layer.unlink()  # a hard link of the pool's: the copy gets its own bytes
    layer.write_bytes(b"\0" * f["size"])
    monkeypatch.setenv("HIVE_AOT_CACHE", str(tmp_path / "cache"))  # nothing pulled before: read from the layout
    assert main(["pull", MODEL, "--target", CPU, "--recipe", RECIPE, "--dest", str(tmp_path / "p"),
                 "--store", uri]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f["sha256"][:12] in err, err
    assert not (tmp_path / "p").exists()
    (layout / "index.json").write_bytes(b"not json")
    with pytest.raises(IntegrityError, match="index.json is not an OCI image index: the layout is damaged"):
        open_store(uri).list("refs/")
    reg = LayoutRegistry(tmp_path, "hive")
    body = json.dumps({"schemaVersion": 2, "config": EMPTY, "layers": [EMPTY]}).encode()
    with pytest.raises(StoreError, match="MANIFEST_BLOB_UNKNOWN"):
        reg.put_manifest("hive/m--y", "t", body)
    assert reg.tags("hive/m--y") == []
    with pytest.raises(StoreError, match="not a repository of the store"):
        reg.blob_size("other/m--y", EMPTY["digest"])
