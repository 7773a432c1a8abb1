"""`hive-aot modelcar` against the real registry of tests/support/oci_registry.py, checked with skopeo (an independent
client): the image's media types, its layer opened as a tar with every file under models/ and the bytes the
manifest names, a deterministic digest, a base image's layers and diff_ids carried, a chunked upload that
resumes after lost answers without duplicating bytes, and the bad input (nothing published, a store that is not
oci://, an image tag that would replace a ref, a killed upload)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import pytest
from factories import write_test_config

from pipelines.config.registry import Config
from pipelines.core.errors import StoreError
from pipelines.engine.build import build_and_publish
from pipelines.store import open_store

REPO = Path.cwd()
MODEL = "test-org/Tiny-Car"
SLUG_REPO = "test-org--tiny-car"


def _cli(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], capture_output=True, text=True,
                          timeout=300, env=full, cwd=REPO, **kw)


def _one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hive-aot: error: "), proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _skopeo(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    if shutil.which("skopeo") is None:
        pytest.fail("skopeo is missing: run `make setup` (requirements/system-packages.sh installs it)")
    proc = subprocess.run(["skopeo", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 or not ok, proc.stderr
    return proc


def _tags(repo: str) -> list[str]:
    listed = _skopeo("list-tags", "--tls-verify=false", f"docker://{repo}", ok=False)
    if listed.returncode != 0:  # Distribution answers 404 for a repository with no tag yet
        assert "404" in listed.stderr or "unknown" in listed.stderr.lower(), listed.stderr
        return []
    return json.loads(listed.stdout)["Tags"]


@pytest.fixture(scope="module")
def published(oci_registry, tiny_llama, tmp_path_factory):
    """The tiny model's gguf-f16 build published to a fresh oci:// store (one build for the module)."""
    root = tmp_path_factory.mktemp("modelcar-publish")
    name = f"hive-{uuid.uuid4().hex[:8]}"
    uri = f"oci://{oci_registry}/{name}"
    config = Config.load(write_test_config(root / "cfg", REPO))
    res = build_and_publish(str(tiny_llama), "gguf-f16", config, uri, MODEL)
    assert res.state == "published", res
    return {"uri": uri, "host": oci_registry, "res": res, "repo": f"{oci_registry}/{name}/{SLUG_REPO}",
            "files": {f["path"]: f for f in res.files}}


def _modelcar(published, *args: str) -> dict:
    proc = _cli("modelcar", MODEL, "--store", published["uri"], "--json", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _layout(image: str, dest: Path) -> tuple[dict, dict, Path]:
    """skopeo copies the image into an OCI layout: (manifest, config, the blobs directory)."""
    # skopeo gzips an uncompressed layer into an OCI layout unless told not to; keep the bytes as pushed
    _skopeo("copy", "--src-tls-verify=false", "--dest-oci-accept-uncompressed-layers", "--preserve-digests",
            f"docker://{image}", f"oci:{dest}:car")
    blobs = dest / "blobs" / "sha256"
    index = json.loads((dest / "index.json").read_text())
    manifest = json.loads((blobs / index["manifests"][0]["digest"][7:]).read_bytes())
    config = json.loads((blobs / manifest["config"]["digest"][7:]).read_bytes())
    return manifest, config, blobs


def _models_layer(blob: Path, files: dict) -> list[str]:
    """The layer's entries; each file's bytes are checked against the artifact manifest's sha256 and size."""
    with tarfile.open(blob, "r:") as tar:
        members = tar.getmembers()
        for m in members:
            assert m.name == "models" or m.name.startswith("models/"), m.name
            assert (m.uid, m.gid, m.mtime) == (0, 0, 0), m
            if m.isdir():
                assert m.mode == 0o755
                continue
            assert m.isfile() and m.mode == 0o644, m
            f = files[m.name[len("models/"):]]
            data = tar.extractfile(m).read()
            assert hashlib.sha256(data).hexdigest() == f["sha256"] and len(data) == f["size"]
    assert members[0].name == "models" and members[0].isdir()  # directories first
    assert sorted(m.name[len("models/"):] for m in members if m.isfile()) == sorted(files)
    return [m.name for m in members]


def test_modelcar_image_checked_with_skopeo_and_deterministic(published, tmp_path):
    res = _modelcar(published)
    assert res["tag"] == "gguf-f16.latest-modelcar" and res["image"] == f"{published['repo']}:gguf-f16.latest-modelcar"
    assert res["storage_uri"] == f"oci://{res['image']}" and res["already_present"] is False
    assert res["build_id"] == published["res"].build_id
    # an image: skopeo's non-raw inspect reads it (it refuses the ModelPack artifact)
    seen = json.loads(_skopeo("inspect", "--tls-verify=false", f"docker://{res['image']}").stdout)
    assert seen["Architecture"] == "amd64" and seen["Os"] == "linux" and seen["Digest"] == res["digest"]
    assert seen["Layers"] == [res["layer"]] and seen["Labels"]["io.hive-aot.build"] == res["build_id"]
    raw = json.loads(_skopeo("inspect", "--raw", "--tls-verify=false", f"docker://{res['image']}").stdout)
    assert raw["mediaType"] == "application/vnd.oci.image.manifest.v1+json" and "artifactType" not in raw
    assert raw["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    assert [la["mediaType"] for la in raw["layers"]] == ["application/vnd.oci.image.layer.v1.tar"]
    manifest, config, blobs = _layout(res["image"], tmp_path / "layout")
    assert manifest == raw  # skopeo kept the digest: the same bytes
    assert config["rootfs"] == {"type": "layers", "diff_ids": [res["layer"]]}  # uncompressed: digest = diff_id
    layer = blobs / res["layer"][7:]
    assert hashlib.sha256(layer.read_bytes()).hexdigest() == res["layer"][7:] and layer.stat().st_size == res["layer_size"]
    _models_layer(layer, published["files"])
    # deterministic: made again under another tag, the same layer and manifest digest; the same tag is left alone
    again = _modelcar(published, "--image-tag", "pinned-modelcar")
    assert (again["digest"], again["layer"], again["already_present"]) == (res["digest"], res["layer"], False)
    assert _modelcar(published)["already_present"] is True
    by_build = _modelcar(published, "--build", res["build_id"])
    assert by_build["tag"] == f"gguf-f16.{res['build_id']}-modelcar" and by_build["digest"] == res["digest"]
    # the store does not mistake the images for refs: ls lists the refs only, and pull still works
    ls = _cli("ls", "--store", published["uri"], "--json")
    assert ls.returncode == 0, ls.stderr
    rows = json.loads(ls.stdout)
    rows = rows if isinstance(rows, list) else rows.get("artifacts", rows)
    assert rows and not [r for r in rows if "modelcar" in r["tag"]]
    refs = open_store(published["uri"]).list("refs/")
    assert len(refs) == 2 and not [k for k in refs if "modelcar" in k]


def _push_base(host: str, repo: str) -> tuple[str, str]:
    """A tiny base image (one gzip-less tar layer holding bin/hello), pushed with the store's client:
    (its layer digest, its config's Env entry)."""
    from pipelines.store.oci_client import MANIFEST_TYPE, Registry

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        data = b"#!/bin/sh\necho hello\n"
        info = tarfile.TarInfo("bin/hello")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
    layer = buf.getvalue()
    ld = "sha256:" + hashlib.sha256(layer).hexdigest()
    env = "BASE_ENV=from-base"
    cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Env": [env], "Cmd": ["/bin/hello"]},
                      "rootfs": {"type": "layers", "diff_ids": [ld]},
                      "history": [{"created_by": "test base"}]}).encode()
    cd = "sha256:" + hashlib.sha256(cfg).hexdigest()
    reg = Registry(host)
    reg.upload_blob(repo, ld, len(layer), layer)
    reg.upload_blob(repo, cd, len(cfg), cfg)
    body = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST_TYPE,
                       "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd,
                                  "size": len(cfg)},
                       "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": ld,
                                   "size": len(layer)}]}).encode()
    reg.put_manifest(repo, "1", body)
    return ld, env


def test_modelcar_on_a_base_image(published, tmp_path):
    host = published["host"]
    base_repo = f"base-{uuid.uuid4().hex[:8]}/busybox"
    base_layer, env = _push_base(host, base_repo)
    for base in (f"{base_repo}:1", f"oci://{host}/{base_repo}:1"):  # the store's registry, or named in full
        res = _modelcar(published, "--base", base, "--image-tag", "on-base-modelcar")
        assert res["base"] == f"{host}/{base_repo}:1"
    manifest, config, blobs = _layout(res["image"], tmp_path / "layout")
    assert [la["digest"] for la in manifest["layers"]] == [base_layer, res["layer"]]  # base + models
    assert config["rootfs"]["diff_ids"] == [base_layer, res["layer"]]
    assert config["config"]["Env"] == [env] and config["config"]["Cmd"] == ["/bin/hello"]
    assert len(config["history"]) == 2 and manifest["annotations"]["org.opencontainers.image.base.name"] == res["base"]
    with tarfile.open(blobs / base_layer[7:]) as tar:
        assert tar.getnames() == ["bin/hello"]
    _models_layer(blobs / res["layer"][7:], published["files"])
    plain = _modelcar(published)
    assert plain["layer"] == res["layer"]  # the models layer does not depend on the base


def test_a_chunked_upload_resumes_after_lost_answers(published, monkeypatch):
    """Small chunks; one PATCH's answer is lost after the registry appended it, another fails before sending:
    the upload asks the registry where it stands and goes on (or begins again), never re-sending blind, so the
    layer is the same bytes (no duplicate)."""
    from pipelines.client.modelcar import modelcar
    from pipelines.store import oci_modelcar
    from pipelines.store.oci_client import Registry

    real, calls = Registry.patch_upload, {"n": 0}

    def flaky(self, repo, location, start, data):
        calls["n"] += 1
        if calls["n"] == 2:
            real(self, repo, location, start, data)
            raise StoreError("answer lost after the append")
        if calls["n"] == 4:
            raise StoreError("connection lost before the append")
        return real(self, repo, location, start, data)

    real_start, starts = Registry.start_upload, []

    def counted(self, repo):
        starts.append(repo)
        return real_start(self, repo)

    monkeypatch.setattr(Registry, "patch_upload", flaky)
    monkeypatch.setattr(Registry, "start_upload", counted)
    monkeypatch.setattr(oci_modelcar, "CHUNK", 1 << 16)
    clean = _modelcar(published, "--image-tag", "clean-modelcar")
    res = modelcar(MODEL, store_uri=published["uri"], image_tag="resumed-modelcar")
    assert calls["n"] > 5 and res["layer"] == clean["layer"] and res["digest"] == clean["digest"]
    # Distribution's upload Location carries a signed `_state` with the offset: after a lost answer the old one no
    # longer matches, so that upload begins again (once); the PATCH that failed before sending resumed in place
    assert len(starts) == 2


def test_bad_input_is_one_line(published, tmp_path):
    uri = published["uri"]
    _one_line(_cli("modelcar", "test-org/never-built", "--store", uri), "test-org/never-built",
              "nothing published with tag 'latest'")
    _one_line(_cli("modelcar", MODEL, "--tag", "v9", "--store", uri), "nothing published with tag 'v9'")
    _one_line(_cli("modelcar", MODEL, "--store", str(tmp_path / "local")), "modelcar needs an oci:// store")
    _one_line(_cli("modelcar", MODEL, "--store", uri, "--image-tag", "gguf-f16.latest"), "store's own tags")
    _one_line(_cli("modelcar", MODEL, "--store", uri, "--base", "nowhere/none:1"), "no such image")
    _one_line(_cli("modelcar", MODEL, "--store", uri, "--base", f"{uri.rsplit('/', 1)[1]}/{SLUG_REPO}:gguf-f16.latest"),
              "is not a runnable image")  # the ModelPack artifact: no image config
    assert "gguf-f16.latest" in _tags(published["repo"])  # the ref's tag is untouched


def test_a_killed_upload_leaves_no_tag(published):
    """SIGKILL mid-layer (after the first PATCH) and after the manifest is pushed by digest, before its tag:
    no Modelcar tag is visible either time; the next run pushes it."""
    for event in ("temp:modelcar", "temp:modelcar#2"):
        tag = f"killed-{event[-1]}-modelcar"
        proc = _cli("modelcar", MODEL, "--store", published["uri"], "--image-tag", tag,
                    env={"HIVE_AOT_STORE_KILL": event}, start_new_session=True)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        assert tag not in _tags(published["repo"])
        assert _skopeo("inspect", "--tls-verify=false", f"docker://{published['repo']}:{tag}", ok=False).returncode != 0
    done = _modelcar(published, "--image-tag", tag)
    assert tag in _tags(published["repo"]) and done["already_present"] is False


def test_retire_takes_the_modelcar_images_down_with_the_build(oci_registry, tiny_llama, tmp_path):
    """A licence takedown leaves no pullable copy: retire deletes the Modelcar images made from the builds it
    retires (every tag of the image), lists them under --dry-run without touching them, and leaves another
    model's image alone."""
    name = f"hive-{uuid.uuid4().hex[:8]}"
    uri = f"oci://{oci_registry}/{name}"
    config = Config.load(write_test_config(tmp_path / "cfg", REPO))
    builds = {}
    for model in (MODEL, "test-org/Other-Car"):
        assert build_and_publish(str(tiny_llama), "gguf-f16", config, uri, model).state == "published"
        proc = _cli("modelcar", model, "--store", uri, "--json")
        assert proc.returncode == 0, proc.stderr[-2000:]
        builds[model] = json.loads(proc.stdout)["build_id"]
        # a second tag of the same image: the build's own
        assert _cli("modelcar", f"{model}@{builds[model]}", "--store", uri, "--json").returncode == 0
    repo, other = f"{oci_registry}/{name}/{SLUG_REPO}", f"{oci_registry}/{name}/test-org--other-car"
    images = sorted(t for t in _tags(repo) if t.endswith("-modelcar"))
    assert images == sorted(["gguf-f16.latest-modelcar", f"gguf-f16.{builds[MODEL]}-modelcar"])

    dry = _cli("retire", MODEL, "--store", uri, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert sorted(json.loads(dry.stdout)["images"]) == sorted(f"{repo}:{t}" for t in images)
    assert sorted(t for t in _tags(repo) if t.endswith("-modelcar")) == images  # a dry run deletes nothing

    done = _cli("retire", MODEL, "--store", uri, "--json")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["images"]) == 2
    assert [t for t in _tags(repo) if t.endswith("-modelcar")] == []
    assert _skopeo("inspect", "--tls-verify=false", f"docker://{repo}:gguf-f16.latest-modelcar", ok=False).returncode != 0
    assert sorted(t for t in _tags(other) if t.endswith("-modelcar")) == sorted(  # another model's stay
        ["gguf-f16.latest-modelcar", f"gguf-f16.{builds['test-org/Other-Car']}-modelcar"])
