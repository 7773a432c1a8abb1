"""A signed build in an OCI store survives a registry mirror: its model repository copied with skopeo (what Harbor
replication, regsync and `skopeo sync` do) to another repository name pulls and verifies there, the OMS signature
travelling as a referrer of each artifact; the pulled directory verifies with the OpenSSF reference implementation
(`model_signing verify key`, in its own venv); and the bad input: a signature listed for one manifest whose
subject is another, a copy without the signature, a bundle signed by an untrusted key."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from factories import ecdsa_keypair, write_test_config

from pipelines.client.pull import pull
from pipelines.config.registry import Config
from pipelines.core.errors import IntegrityError
from pipelines.engine.build import build_and_publish
from pipelines.store import open_store
from pipelines.store.oci_client import INDEX_TYPE, Registry
from pipelines.store.oci_referrers import BUNDLE_TYPE, referrers_tag

REPO = Path.cwd()
MODEL, SLUG_REPO, CPU = "test-org/Mirrored", "test-org--mirrored", "llm-llamacpp-cpu"


def _skopeo(*args: str) -> None:
    if shutil.which("skopeo") is None:
        pytest.fail("skopeo is missing: run `make setup` (requirements/system-packages.sh installs it)")
    proc = subprocess.run(["skopeo", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _copy(host: str, src: str, dst: str, tags: list[str]) -> None:
    """skopeo copy of these tags, digests kept; a referrers index (`sha256-*`) without --preserve-digests: skopeo
    1.9 rewrites an index whose entries carry artifactType (dropping the field), which readers must tolerate."""
    for tag in tags:
        keep = [] if tag.startswith("sha256-") else ["--preserve-digests"]
        _skopeo("copy", "--all", *keep, "--src-tls-verify=false", "--dest-tls-verify=false",
                f"docker://{host}/{src}:{tag}", f"docker://{host}/{dst}:{tag}")


def _sync(host: str, src: str, dest_prefix: str) -> None:
    """`skopeo sync` of a whole repository (every tag), as a mirror job runs it: lands in <dest_prefix>/<name>."""
    _skopeo("sync", "--all", "--src", "docker", "--dest", "docker", "--src-tls-verify=false",
            "--dest-tls-verify=false", f"{host}/{src}", f"{host}/{dest_prefix}")


@pytest.fixture(scope="module")
def signed_oci(oci_registry, tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("oci-mirror")
    priv, pub = ecdsa_keypair(root, "publisher")
    _, other = ecdsa_keypair(root, "other")
    store_root = f"hive-{uuid.uuid4().hex[:8]}"
    uri = f"oci://{oci_registry}/{store_root}"
    config = Config.load(write_test_config(root / "cfg", REPO))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HIVE_AOT_SIGNING_KEY", str(priv))
        res = build_and_publish(str(tiny_llama), "gguf-f16", config, uri, MODEL)
    assert res.state == "published", res
    registry = Registry(oci_registry)
    tags = registry.tags(f"{store_root}/{SLUG_REPO}")
    return {"host": oci_registry, "root": store_root, "uri": uri, "res": res, "pub": pub, "other": other,
            "registry": registry, "tags": tags}


def test_every_artifact_of_the_build_carries_the_signature_as_a_referrer(signed_oci):
    reg, repo = signed_oci["registry"], f"{signed_oci['root']}/{SLUG_REPO}"
    shown = [t for t in signed_oci["tags"] if not t.startswith("sha256-")]
    assert any(t.startswith("_m.") for t in shown) and "gguf-f16.latest" in shown
    assert not any(t.startswith("_s.") for t in signed_oci["tags"])  # no hive-aot-only signature tag any more
    for tag in shown:
        digest = reg.get_manifest(repo, tag)[1]
        index = json.loads(reg.get_manifest(repo, referrers_tag(digest), accept=INDEX_TYPE)[0])
        assert [m["artifactType"] for m in index["manifests"]] == [BUNDLE_TYPE], tag
        referrer = json.loads(reg.get_manifest(repo, index["manifests"][0]["digest"])[0])
        assert referrer["subject"]["digest"] == digest and referrer["layers"][0]["mediaType"] == BUNDLE_TYPE


def test_a_mirrored_repository_pulls_and_verifies_there(signed_oci, tmp_path):
    host, mirror = signed_oci["host"], f"mirror-{uuid.uuid4().hex[:8]}"
    _sync(host, f"{signed_oci['root']}/{SLUG_REPO}", mirror)
    # the copy has no blob pool: every layer is read from the model's own repository
    assert not open_store(f"oci://{host}/{mirror}").registry.tags(f"{mirror}/blobs")
    dest = tmp_path / "m"
    res = pull(MODEL, CPU, dest, store_uri=f"oci://{host}/{mirror}", trusted=str(signed_oci["pub"]))
    assert res.build_id == signed_oci["res"].build_id and res.signed_by
    manifest = (dest / "hive-aot.manifest.json").read_bytes()
    assert json.loads(manifest)["build_id"] == res.build_id
    assert json.loads((dest / "model.sig").read_bytes())["mediaType"] == BUNDLE_TYPE
    _reference_verifier(dest, signed_oci["pub"])


def _reference_verifier(dest: Path, public_key: Path, ok: bool = True) -> subprocess.CompletedProcess:
    venv = os.environ.get("HIVE_AOT_MODEL_SIGNING_VENV", str(REPO / ".venvs" / "model-signing"))
    exe = Path(venv) / "bin" / "model_signing"
    if not exe.exists():
        pytest.fail(f"{exe} is missing: run `make setup` (it makes the model-signing venv)")
    proc = subprocess.run([str(exe), "verify", "key", "--signature", str(dest / "model.sig"), "--public_key",
                           str(public_key), str(dest)], capture_output=True, text=True, timeout=120)
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr
    return proc


def test_the_reference_implementation_refuses_a_tampered_pulled_directory(signed_oci, tmp_path):
    dest = tmp_path / "t"
    pull(MODEL, CPU, dest, store_uri=signed_oci["uri"], trusted=str(signed_oci["pub"]))
    _reference_verifier(dest, signed_oci["pub"])
    _reference_verifier(dest, signed_oci["other"], ok=False)  # another key
    served = json.loads((dest / "hive-aot.manifest.json").read_bytes())
    served["serving"] = {"llm-llamacpp-cpu": {"command": ["sh", "-c", "evil"]}}
    (dest / "hive-aot.manifest.json").write_text(json.dumps(served))  # the serving config is signed too
    _reference_verifier(dest, signed_oci["pub"], ok=False)


def test_a_copy_of_one_ref_pulls_and_its_signature_needs_its_own_referrers_tag(signed_oci, tmp_path):
    host, mirror = signed_oci["host"], f"one-{uuid.uuid4().hex[:8]}"
    src, dst = f"{signed_oci['root']}/{SLUG_REPO}", f"{mirror}/{SLUG_REPO}"
    _copy(host, src, dst, ["gguf-f16.latest"])  # no _m. tag: the ref artifact carries the manifest
    uri = f"oci://{host}/{mirror}"
    assert pull(MODEL, CPU, tmp_path / "a", store_uri=uri).build_id == signed_oci["res"].build_id
    with pytest.raises(IntegrityError, match="is not signed"):
        pull(MODEL, CPU, tmp_path / "b", store_uri=uri, trusted=str(signed_oci["pub"]))
    assert not (tmp_path / "b").exists()
    digest = signed_oci["registry"].get_manifest(src, "gguf-f16.latest")[1]
    _copy(host, src, dst, [referrers_tag(digest)])
    assert pull(MODEL, CPU, tmp_path / "c", store_uri=uri, trusted=str(signed_oci["pub"])).signed_by


def test_a_signature_whose_subject_is_another_manifest_is_refused(signed_oci, tmp_path):
    """Someone with push rights lists the bundle signed for the ref artifact under the build's manifest artifact:
    its subject names the other manifest, so it is refused, not taken as the build's signature."""
    host, mirror = signed_oci["host"], f"moved-{uuid.uuid4().hex[:8]}"
    src, dst = f"{signed_oci['root']}/{SLUG_REPO}", f"{mirror}/{SLUG_REPO}"
    reg = signed_oci["registry"]
    build_tag = next(t for t in signed_oci["tags"] if t.startswith("_m."))
    _copy(host, src, dst, [build_tag])  # the build's manifest only, without its referrers
    ref_digest = reg.get_manifest(src, "gguf-f16.latest")[1]
    ref_index = reg.get_manifest(src, referrers_tag(ref_digest), accept=INDEX_TYPE)[0]
    _copy(host, src, dst, [referrers_tag(ref_digest)])  # the ref's signature artifact, pushed to the mirror
    build_digest = reg.get_manifest(dst, build_tag)[1]
    reg.put_manifest(dst, referrers_tag(build_digest), ref_index, media_type=INDEX_TYPE)  # listed for the build
    with pytest.raises(IntegrityError, match="has subject .*another manifest"):
        pull(f"{MODEL}@{signed_oci['res'].build_id}", CPU, tmp_path / "d", store_uri=f"oci://{host}/{mirror}",
             trusted=str(signed_oci["pub"]))
    assert not (tmp_path / "d").exists()


def test_signing_again_adds_no_second_referrer(signed_oci):
    """The referrer carries no time: a retried publish (or a second copy) of the same bundle lists it once."""
    store, repo = open_store(signed_oci["uri"]), f"{signed_oci['root']}/{SLUG_REPO}"
    key = f"signatures/test-org--Mirrored/gguf-f16/{signed_oci['res'].build_id}.json.sig"
    bundle = store.read_bytes(key)
    assert bundle is not None and json.loads(bundle)["mediaType"] == BUNDLE_TYPE
    store.write_bytes(key, bundle)
    reg = signed_oci["registry"]
    digest = reg.get_manifest(repo, f"_m.gguf-f16.{signed_oci['res'].build_id}")[1]
    index = json.loads(reg.get_manifest(repo, referrers_tag(digest), accept=INDEX_TYPE)[0])
    assert len(index["manifests"]) == 1 and store.read_bytes(key) == bundle


def test_a_hive_aot_artifact_pulls_by_reference_from_any_name_and_verifies(signed_oci, tmp_path):
    """`hive-aot pull oci://HOST/ANY/NAME:TAG`, the ModelPack pull, reads a mirrored hive-aot artifact whatever the
    repository is called: its layers are the build's files and its manifest, which is exactly what the bundle
    signs, so the signature verifies and the reference implementation accepts the directory."""
    from pipelines.client.foreign_pull import pull_foreign

    host, renamed = signed_oci["host"], f"elsewhere-{uuid.uuid4().hex[:8]}/tiny"
    src = f"{signed_oci['root']}/{SLUG_REPO}"
    digest = signed_oci["registry"].get_manifest(src, "gguf-f16.latest")[1]
    _copy(host, src, renamed, ["gguf-f16.latest", referrers_tag(digest)])
    dest = tmp_path / "f"
    res = pull_foreign(f"oci://{host}/{renamed}:gguf-f16.latest", dest, trusted=str(signed_oci["pub"]))
    assert res["signed_by"]
    manifest = json.loads((dest / "hive-aot.manifest.json").read_bytes())
    assert manifest["build_id"] == signed_oci["res"].build_id
    for f in manifest["files"]:
        assert hashlib.sha256((dest / f["path"]).read_bytes()).hexdigest() == f["sha256"]
    _reference_verifier(dest, signed_oci["pub"])
    with pytest.raises(IntegrityError, match="not among the trusted keys|not trusted"):
        pull_foreign(f"oci://{host}/{renamed}:gguf-f16.latest", tmp_path / "g", trusted=str(signed_oci["other"]))
    assert not (tmp_path / "g").exists()
