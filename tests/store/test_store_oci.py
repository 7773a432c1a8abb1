"""The OCI store against a real registry (Debian's docker-registry, Distribution 2.8, on loopback), checked with an
independent client (skopeo): the store contract, a build published and pulled back through the CLI as a CNCF
ModelPack artifact whose layer digests are the pulled files' sha256, ls/tag/retire/gc, and the bad input: wrong
or missing credentials (401), a missing repository or tag (404), a tampered blob, a killed push, model ids that
differ only in case, a manifest whose layers were rewritten, a damaged blob no push can repair (the client against
a hostile server: test_oci_hostile.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from factories import store_contract, write_test_config
from oci_registry import PASSWORD, USER, data_dir

from pipelines.config.registry import Config
from pipelines.core.errors import IntegrityError, StoreError
from pipelines.core.hashing import sha256_file
from pipelines.engine.build import build_and_publish
from pipelines.store import blob_key, open_store
from pipelines.store.oci import OciStore
from pipelines.store.oci_modelpack import MODEL_ARTIFACT, MODEL_CONFIG

REPO = Path.cwd()
MODEL = "test-org/Tiny-OCI"  # an uppercase letter: repositories are lowercase, the store keeps the spelling
SLUG_REPO = "test-org--tiny-oci"


def _cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    full.pop("HIVE_AOT_REGISTRY", None) if cwd is not None else None
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], capture_output=True, text=True,
                          timeout=300, env=full, cwd=cwd or REPO)


def _one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hive-aot: error: "), proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _skopeo(*args: str) -> str:
    if shutil.which("skopeo") is None:
        pytest.fail("skopeo is missing: run `make setup` (requirements/system-packages.sh installs it)")
    proc = subprocess.run(["skopeo", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def published(oci_registry, tiny_llama, tmp_path_factory):
    """The tiny model's gguf-f16 build published to a fresh oci:// store (one build for the module)."""
    root = tmp_path_factory.mktemp("oci-publish")
    uri = f"oci://{oci_registry}/hive-{uuid.uuid4().hex[:8]}"
    config = Config.load(write_test_config(root / "cfg", REPO))
    res = build_and_publish(str(tiny_llama), "gguf-f16", config, uri, MODEL)
    assert res.state == "published", res
    return {"uri": uri, "host": oci_registry, "res": res, "config": config, "root": root}


def test_store_contract(oci_uri, tmp_path):
    store = open_store(oci_uri)
    assert isinstance(store, OciStore) and store.uri == oci_uri
    store_contract(store, "refs/m--x/r/latest")
    store.write_bytes("profiles.json", b"\xff\x00 not utf-8")  # any bytes, exactly
    assert store.read_bytes("profiles.json") == b"\xff\x00 not utf-8"
    f = tmp_path / "blob.bin"
    f.write_bytes(os.urandom(300_000))
    digest = store.put_blob(f)
    assert digest == sha256_file(f) and store.size(blob_key(digest)) == 300_000
    assert store.put_blob(f) == digest  # content-addressed: second put is a no-op
    assert b"".join(store.iter_range(blob_key(digest), 1000, 5000)) == f.read_bytes()[1000:6000]
    out = tmp_path / "back.bin"
    store.download_file(blob_key(digest), out)
    assert out.read_bytes() == f.read_bytes()
    assert [e.key for e in store.list_entries("blobs/")] == [blob_key(digest)]
    with pytest.raises(IntegrityError):  # the registry checks the digest: nothing lands under a wrong one
        store.upload_file(blob_key("0" * 64), f, "0" * 64)
    assert not store.exists(blob_key("0" * 64))
    with pytest.raises(StoreError, match="store key"):
        store.read_bytes("../escape")
    with pytest.raises(StoreError, match="no place in an OCI registry"):
        store.write_bytes("other/thing", b"x")
    with pytest.raises(StoreError, match="does not accept this artifact .400 MANIFEST_INVALID") as ei:
        store.write_bytes("profiles.json", b"x" * (5 << 20))  # Distribution refuses manifests over 4 MiB
    assert "\n" not in str(ei.value) and store.read_bytes("profiles.json") == b"\xff\x00 not utf-8"  # unchanged
    with pytest.raises(StoreError, match="recipe 'a.b' holds a '.'"):
        store.write_bytes("refs/m--x/a.b/latest", b"{}")
    store.delete("refs/m--x/r/latest")
    store.delete("refs/m--x/r/latest")  # idempotent
    assert store.list("refs/") == []
    store.delete(blob_key(digest))
    assert store.list("blobs/") == [] and not store.exists(blob_key(digest))


def test_uris_that_are_not_a_registry_repository_are_one_line(oci_registry):
    for bad, needle in (("oci://", "is not oci://host"), (f"oci://{oci_registry}", "is not oci://host"),
                        (f"oci://user:pw@{oci_registry}/hive", r"\*\*\*@.*never the URI"),
                        (f"oci://{oci_registry}/Hive", "not an OCI repository name")):
        with pytest.raises(StoreError, match=needle) as ei:
            open_store(bad)
        assert "pw" not in str(ei.value)  # a password in the URI is never echoed


def test_publish_pull_with_cli_and_check_with_skopeo(published, tmp_path):
    uri, host, res = published["uri"], published["host"], published["res"]
    repo = f"{host}/{uri.rsplit('/', 1)[1]}/{SLUG_REPO}"
    assert res.manifest == f"{uri}/manifests/test-org--Tiny-OCI/gguf-f16/{res.build_id}.json"
    # the light client, with only the store's profiles.json (no registry): a subprocess in an empty cwd
    dest = tmp_path / "serve"
    proc = _cli("pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(dest), "--store", uri, "--json",
                env={"HIVE_AOT_CACHE": str(tmp_path / "pull-cache")}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["build_id"] == res.build_id
    # skopeo, an independent client, reads the ref's tag: a ModelPack artifact whose layers are the pulled files
    raw = json.loads(_skopeo("inspect", "--raw", "--tls-verify=false", f"docker://{repo}:gguf-f16.latest"))
    assert raw["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert raw["artifactType"] == MODEL_ARTIFACT and raw["config"]["mediaType"] == MODEL_CONFIG
    pulled = {f["path"]: f for f in json.loads((dest / "hive-aot.json").read_text())["manifest"]["files"]}
    # the build's files, then its manifest (the exact bytes the pulled DIR holds): OMS signs both
    assert [x["annotations"]["org.cncf.model.filepath"] for x in raw["layers"]] == [*pulled, "hive-aot.manifest.json"]
    assert json.loads((dest / "hive-aot.manifest.json").read_bytes())["build_id"] == res.build_id
    for layer in raw["layers"]:
        path = layer["annotations"]["org.cncf.model.filepath"]
        assert layer["annotations"]["org.opencontainers.image.title"] == path
        assert layer["digest"] == "sha256:" + sha256_file(dest / path) and layer["size"] == (dest / path).stat().st_size
        assert layer["mediaType"] == ("application/vnd.cncf.model.weight.v1.raw" if path.endswith(".gguf") else
                                      "application/vnd.cncf.model.weight.config.v1.raw")
    config = json.loads(_skopeo("inspect", "--raw", "--config", "--tls-verify=false",
                                f"docker://{repo}:gguf-f16.latest"))
    assert set(config) == {"descriptor", "config", "modelfs"} and config["config"]["format"] == "gguf"
    assert config["modelfs"] == {"type": "layers", "diffIds": [layer["digest"] for layer in raw["layers"]]}
    assert config["descriptor"]["name"] == MODEL
    notes = raw["annotations"]
    assert json.loads(notes["io.hive-aot.document"])["build_id"] == res.build_id
    assert json.loads(notes["io.hive-aot.manifest"])["build_id"] == res.build_id
    tags = json.loads(_skopeo("list-tags", "--tls-verify=false", f"docker://{repo}"))["Tags"]
    commit = json.loads(notes["io.hive-aot.manifest"])["model"]["commit"]
    assert sorted(tags) == sorted(["gguf-f16.latest", f"gguf-f16.{commit}", f"_m.gguf-f16.{res.build_id}"])


def test_ls_tag_and_a_second_build_skipped(published, tmp_path, tiny_llama):
    uri, res = published["uri"], published["res"]
    again = build_and_publish(str(tiny_llama), "gguf-f16", published["config"], uri, MODEL)
    assert again.skipped is True and again.build_id == res.build_id
    ls = _cli("ls", "--store", uri, "--json")
    assert ls.returncode == 0, ls.stderr
    rows = json.loads(ls.stdout)
    rows = rows if isinstance(rows, list) else rows.get("artifacts", rows)
    assert {(r["model_id"], r["recipe"], r["tag"]) for r in rows} >= {(MODEL, "gguf-f16", "latest")}
    tagged = _cli("tag", f"{MODEL}@{res.build_id}", "stable", "--store", uri, "--json")
    assert tagged.returncode == 0, tagged.stderr
    store = open_store(uri)
    assert store.read_ref("refs/test-org--Tiny-OCI/gguf-f16/stable")["build_id"] == res.build_id
    served = _cli("serve", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "srv"), "--store", uri,
                  "--dry-run", env={"HIVE_AOT_CACHE": str(tmp_path / "serve-cache")})
    assert served.returncode == 0 and "llama-server" in served.stdout, served.stderr[-2000:]


def test_missing_repository_or_tag_and_wrong_store_are_one_line(published, oci_registry, tmp_path):
    uri = published["uri"]
    cache = {"HIVE_AOT_CACHE": str(tmp_path / "cache")}
    _one_line(_cli("pull", "test-org/never-built", "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "a"),
                   "--store", uri, env=cache), "test-org/never-built: nothing published with tag 'latest'")
    _one_line(_cli("pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "b"), "--tag", "v9",
                   "--store", uri, env=cache), f"{MODEL}: nothing published with tag 'v9'")
    _one_line(_cli("ls", "--store", "oci://127.0.0.1:1/hive", env=cache), "127.0.0.1:1", "unreachable")
    store = open_store(uri)
    with pytest.raises(StoreError, match="not found .404 BLOB_UNKNOWN") as ei:
        list(store.iter_range(blob_key("1" * 64), 0, 10))
    assert "\n" not in str(ei.value)
    assert not any((tmp_path / d).exists() for d in "ab")


def test_tampered_blob_is_refused_and_nothing_is_written(published, tmp_path):
    """Someone with disk access changes a layer's bytes in the registry's storage: the registry serves them
    under the old digest, and pull refuses them (sha256), leaving nothing at the destination."""
    uri, host, res = published["uri"], published["host"], published["res"]
    gguf = next(f for f in res.files if f["path"].endswith(".gguf"))
    stored = data_dir(host) / "docker/registry/v2/blobs/sha256" / gguf["sha256"][:2] / gguf["sha256"] / "data"
    original = stored.read_bytes()
    try:
        stored.write_bytes(original[:-4] + bytes(b ^ 0xFF for b in original[-4:]))  # same size, other bytes
        dest = tmp_path / "serve"
        line = _one_line(_cli("pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(dest), "--store", uri,
                              env={"HIVE_AOT_CACHE": str(tmp_path / "fresh-cache")}), "sha256")
        assert gguf["sha256"][:12] in line
        assert not dest.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith("serve")]
    finally:
        stored.write_bytes(original)


def test_a_killed_push_leaves_no_tag(oci_registry, tiny_llama, tmp_path):
    """SIGKILL a publish just before its ref tag is pushed (the manifest and blobs are there): no ref tag is
    visible, skopeo sees no ModelPack tag, pull says nothing is published; the next build completes."""
    uri = f"oci://{oci_registry}/hive-{uuid.uuid4().hex[:8]}"
    reg = write_test_config(tmp_path / "cfg", REPO)
    cmd = ("build", str(tiny_llama), "--recipe", "gguf-f16", "--model-id", MODEL, "--store", uri,
           "--registry", str(reg), "--json")
    env = {"HIVE_AOT_CACHE": str(tmp_path / "cache")}
    for event in ("temp:manifests", "temp:refs"):
        full = {**os.environ, "PYTHONPATH": str(REPO), **env, "HIVE_AOT_STORE_KILL": event}
        proc = subprocess.run([sys.executable, "-m", "pipelines.cli", *cmd], env=full, capture_output=True,
                              text=True, timeout=300, start_new_session=True)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        store = open_store(uri)
        assert store.list("refs/") == []
        listed = subprocess.run(["skopeo", "list-tags", "--tls-verify=false",
                                 f"docker://{oci_registry}/{uri.rsplit('/', 1)[1]}/{SLUG_REPO}"],
                                capture_output=True, text=True, timeout=120)
        if listed.returncode != 0:  # Distribution answers 404 for a repository with no tag yet
            assert "404" in listed.stderr, listed.stderr
        else:
            tags = json.loads(listed.stdout)["Tags"]
            assert [t for t in tags if not t.startswith("_")] == [], tags
        _one_line(_cli("pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "d"), "--store", uri,
                       env=env), "nothing published")
    done = _cli(*cmd, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["state"] in ("published", "skipped")
    store = open_store(uri)
    assert len(store.list("refs/")) == 2
    for key in store.list("refs/"):  # every ref names a manifest whose blobs are all there
        ref = store.read_ref(key)
        raw = store.read_bytes(ref["manifest"])
        assert hashlib.sha256(raw).hexdigest() == ref["manifest_sha256"]
        for f in json.loads(raw)["files"]:
            assert store.size(blob_key(f["sha256"])) == f["size"]


def test_basic_auth_wrong_and_missing_credentials_are_one_line(oci_auth_registry, tmp_path):
    uri = f"oci://{oci_auth_registry}/hive"
    wrong = "wrong-secret-5d0e"
    none = {"HIVE_AOT_OCI_USERNAME": "", "HIVE_AOT_OCI_PASSWORD": "", "DOCKER_CONFIG": str(tmp_path / "nodocker")}
    line = _one_line(_cli("ls", "--store", uri, env=none), "needs credentials", "401")
    line = _one_line(_cli("ls", "--store", uri, env={**none, "HIVE_AOT_OCI_USERNAME": USER,
                                                     "HIVE_AOT_OCI_PASSWORD": wrong}), "credentials refused", "401")
    assert wrong not in line and PASSWORD not in line
    good = {**none, "HIVE_AOT_OCI_USERNAME": USER, "HIVE_AOT_OCI_PASSWORD": PASSWORD}
    ok = _cli("ls", "--store", uri, "--json", env=good)
    assert ok.returncode == 0, ok.stderr
    # docker's config.json (what `docker login` writes) serves as well
    import base64

    docker = tmp_path / "docker"
    docker.mkdir()
    (docker / "config.json").write_text(json.dumps({"auths": {oci_auth_registry: {
        "auth": base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}}}))
    os.environ.pop("HIVE_AOT_OCI_USERNAME", None)
    store_env = {**none, "DOCKER_CONFIG": str(docker)}
    f = tmp_path / "blob.bin"
    f.write_bytes(b"authenticated bytes")
    old = {k: os.environ.get(k) for k in store_env}
    os.environ.update(store_env)
    try:
        store = open_store(uri)
        digest = store.put_blob(f)
        assert b"".join(store.iter_range(blob_key(digest), 0, f.stat().st_size)) == f.read_bytes()
        (docker / "config.json").write_text(json.dumps({"auths": {oci_auth_registry: {
            "auth": base64.b64encode(f"{USER}:{wrong}".encode()).decode()}}}))
        with pytest.raises(StoreError) as ei:
            open_store(uri).exists(blob_key(digest))
        assert "credentials refused" in str(ei.value) and wrong not in str(ei.value)
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def test_retire_then_gc_collects_the_blobs(oci_registry, tiny_llama, tmp_path):
    uri = f"oci://{oci_registry}/hive-{uuid.uuid4().hex[:8]}"
    config = Config.load(write_test_config(tmp_path / "cfg", REPO))
    res = build_and_publish(str(tiny_llama), "gguf-f16", config, uri, MODEL)
    store = open_store(uri)
    blobs = sorted(blob_key(f["sha256"]) for f in res.files)
    assert sorted(store.list("blobs/")) == blobs
    kept = _cli("gc", "--min-age", "0", "--store", uri, "--json")
    assert kept.returncode == 0, kept.stderr
    assert json.loads(kept.stdout)["blobs"] == []  # all referenced
    retired = _cli("retire", MODEL, "--store", uri, "--json")
    assert retired.returncode == 0, retired.stderr
    assert store.list("refs/") == [] and store.list("manifests/") == []
    gc = _cli("gc", "--min-age", "0", "--store", uri, "--json")
    assert gc.returncode == 0, gc.stderr
    assert sorted(json.loads(gc.stdout)["blobs"]) == blobs and store.list("blobs/") == []


def test_bearer_token_flow_and_credential_helpers(oci_registry, tmp_path, monkeypatch):
    """A registry that answers with a Bearer challenge: the token comes from its realm for the configured
    credentials (here from a docker credential helper), wrong ones are one line without the secret."""
    from oci_registry import token_proxy

    secret = "helper-secret-4e1b"
    helper = tmp_path / "bin" / "docker-credential-hivetest"
    helper.parent.mkdir()
    helper.write_text('#!/bin/sh\nread host\n'
                      f'echo "{{\\"Username\\": \\"bob\\", \\"Secret\\": \\"$(cat {tmp_path}/secret)\\"}}"\n')
    helper.chmod(0o755)
    (tmp_path / "secret").write_text(secret)
    monkeypatch.setenv("PATH", f"{helper.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    monkeypatch.delenv("HIVE_AOT_OCI_USERNAME", raising=False)
    monkeypatch.delenv("HIVE_AOT_OCI_PASSWORD", raising=False)
    with token_proxy(oci_registry, "bob", secret) as front:
        (tmp_path / "docker").mkdir()
        (tmp_path / "docker" / "config.json").write_text(json.dumps({"credHelpers": {front: "hivetest"}}))
        uri = f"oci://{front}/hive-{uuid.uuid4().hex[:8]}"
        store = open_store(uri)
        f = tmp_path / "blob.bin"
        f.write_bytes(os.urandom(5000))
        digest = store.put_blob(f)
        store.write_bytes("profiles.json", b'{"runtime_profiles": []}')
        assert store.read_json("profiles.json") == {"runtime_profiles": []}
        assert b"".join(store.iter_range(blob_key(digest), 10, 100)) == f.read_bytes()[10:110]
        (tmp_path / "secret").write_text("wrong-secret-77aa")
        with pytest.raises(StoreError, match="credentials refused by the token service") as ei:
            open_store(uri).exists(blob_key(digest))
        assert "wrong-secret-77aa" not in str(ei.value) and secret not in str(ei.value)
        (tmp_path / "docker" / "config.json").write_text("{}")
        with pytest.raises(StoreError, match="credentials refused|answered 401|token") as ei:
            open_store(uri).read_bytes("profiles.json")  # anonymous: the realm refuses a token
        assert "\n" not in str(ei.value)


def test_model_ids_that_differ_only_in_case_cannot_share_an_oci_store(published, tiny_llama, tmp_path):
    """test-org/Tiny-OCI and TEST-ORG/tiny-oci map to one repository (OCI names are lowercase): publishing the
    second is refused in one line naming both, the first is untouched and pulls, and the other spelling finds
    nothing (as on a local or S3 store, where the two are different models)."""
    uri, res = published["uri"], published["res"]
    other = "TEST-ORG/tiny-oci"
    with pytest.raises(StoreError) as ei:
        build_and_publish(str(tiny_llama), "gguf-f16", published["config"], uri, other)
    line = str(ei.value)
    assert "\n" not in line and f"'{other}' differs only in case from '{MODEL}'" in line, line
    store = open_store(uri)
    assert store.read_ref("refs/test-org--Tiny-OCI/gguf-f16/latest")["build_id"] == res.build_id
    assert store.read_bytes("refs/TEST-ORG--tiny-oci/gguf-f16/latest") is None
    assert not store.exists("refs/TEST-ORG--tiny-oci/gguf-f16/latest")
    assert store.list("refs/TEST-ORG--tiny-oci/") == [] and store.list("manifests/TEST-ORG--tiny-oci/") == []
    dest = tmp_path / "serve"
    pulled = _cli("pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(dest), "--store", uri, "--json",
                  env={"HIVE_AOT_CACHE": str(tmp_path / "cache")})
    assert pulled.returncode == 0, pulled.stderr[-2000:]
    assert json.loads(pulled.stdout)["build_id"] == res.build_id
    for f in res.files:
        assert sha256_file(dest / f["path"]) == f["sha256"]


def test_a_manifest_whose_layers_were_rewritten_is_refused(published, tmp_path):
    """The registry accepts a manifest whose ModelPack layers name other blobs than the files its hive-aot document
    lists (any other OCI client would pull those): reading it through the store (pull, verify) is one
    IntegrityError line, for the build's manifest and for a ref's artifact alike, and nothing is delivered."""
    uri, res = published["uri"], published["res"]
    store = open_store(uri)
    reg, repo = store.registry, f"{uri.rsplit('/', 1)[1]}/{SLUG_REPO}"
    foreign = os.urandom(4096)  # another model's weights, in the repository already
    digest = "sha256:" + hashlib.sha256(foreign).hexdigest()
    reg.upload_blob(repo, digest, len(foreign), foreign)
    for tag in (f"_m.gguf-f16.{res.build_id}", "gguf-f16.latest"):
        raw, _ = reg.get_manifest(repo, tag)
        rewritten = json.loads(raw)
        layer = next(la for la in rewritten["layers"] if la["annotations"]["org.cncf.model.filepath"].endswith(".gguf"))
        layer["digest"], layer["size"] = digest, len(foreign)  # the document annotation is left as it was
        reg.put_manifest(repo, tag, json.dumps(rewritten).encode())
        try:
            if tag.startswith("_m."):
                dest = tmp_path / "serve"
                _one_line(_cli("pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(dest), "--store", uri,
                               env={"HIVE_AOT_CACHE": str(tmp_path / "cache")}),
                          f"{tag}: its layers are not the files its document names")
                assert not dest.exists()
                _one_line(_cli("verify", f"{MODEL}@{res.build_id}", "--store", uri),
                          f"{tag}: its layers are not the files its document names")
            else:
                with pytest.raises(IntegrityError, match="its layers are not the files its document names") as ei:
                    open_store(uri).read_ref("refs/test-org--Tiny-OCI/gguf-f16/latest")
                assert "\n" not in str(ei.value)
        finally:
            reg.put_manifest(repo, tag, raw)
    assert open_store(uri).read_ref("refs/test-org--Tiny-OCI/gguf-f16/latest")["build_id"] == res.build_id


def test_a_damaged_blob_a_deep_check_sees_and_a_rebuild_cannot_repair_says_so(published, tiny_llama):
    """Bytes changed in the registry's storage: at the same size only a full read sees it (blob_content_intact;
    blob_intact trusts the size and the registry's digest check at push); at another size a rebuild sees it and
    pushes the blob again, which Distribution answers 201 while keeping its damaged copy: the build says so in one
    line naming the fix, instead of reporting it repaired."""
    uri, host, res = published["uri"], published["host"], published["res"]
    gguf = next(f for f in res.files if f["path"].endswith(".gguf"))
    stored = data_dir(host) / "docker/registry/v2/blobs/sha256" / gguf["sha256"][:2] / gguf["sha256"] / "data"
    original = stored.read_bytes()
    store = open_store(uri)
    assert store.blob_content_intact(gguf["sha256"], gguf["size"])
    try:
        stored.write_bytes(original[:-4] + bytes(b ^ 0xFF for b in original[-4:]))  # same size, other bytes
        assert store.blob_intact(gguf["sha256"], gguf["size"])  # what the cheap check cannot see (documented)
        assert not store.blob_content_intact(gguf["sha256"], gguf["size"])
        deep = _cli("verify", MODEL, "--recipe", "gguf-f16", "--deep", "--json", "--store", uri)
        files = {f["path"]: f["state"] for f in json.loads(deep.stdout)["builds"][0]["files"]}
        assert deep.returncode == 1 and files[gguf["path"]] == "damaged", deep.stderr
        assert _cli("verify", MODEL, "--recipe", "gguf-f16", "--store", uri).returncode == 0  # the cheap policy
        stored.write_bytes(original[:-4])  # four bytes short: the cheap check sees it, a rebuild tries to repair
        assert not store.blob_intact(gguf["sha256"], gguf["size"])
        with pytest.raises(IntegrityError) as ei:
            build_and_publish(str(tiny_llama), "gguf-f16", published["config"], uri, MODEL)
        line = str(ei.value)
        assert "\n" not in line and f"blob {gguf['sha256'][:12]} is damaged in the registry" in line, line
        assert "pushing it again does not replace it" in line and "garbage-collect" in line, line
    finally:
        stored.write_bytes(original)
    assert store.blob_content_intact(gguf["sha256"], gguf["size"])
