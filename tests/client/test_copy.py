"""`hive-aot copy` between real stores (a local directory, SeaweedFS S3, a docker-registry OCI store, an OCI image
layout directory): one tiny signed build copied local -> s3 -> oci -> oci-layout -> local pulls byte-identical files
under the same build id with its signature verified; a copy killed mid-way (the store's own fault events) leaves no
ref in the destination and a rerun completes, skipping the blobs already there; a tampered source blob, a manifest
that is not what its ref records, a destination holding another manifest are one line with nothing referenced."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from factories import ecdsa_keypair, write_test_config

from pipelines.cli.main import main
from pipelines.client.copy import parse_spec
from pipelines.client.pull import pull
from pipelines.config.registry import Config
from pipelines.core.errors import HiveError
from pipelines.engine.build import build_and_publish
from pipelines.store import manifest_key, open_store, ref_key
from pipelines.store.faults import KILL_ENV
from pipelines.store.signing import signature_key

REPO = Path.cwd()
MODEL, CPU, RECIPE = "test-org/Copied", "llm-llamacpp-cpu", "gguf-f16"


@pytest.fixture(scope="module")
def published(tiny_llama, tmp_path_factory):
    """The tiny model's gguf-f16 build, signed, in a local store (one build for the module)."""
    root = tmp_path_factory.mktemp("copy-src")
    priv, pub = ecdsa_keypair(root, "publisher")
    config = Config.load(write_test_config(root / "cfg", REPO))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HIVE_AOT_SIGNING_KEY", str(priv))
        res = build_and_publish(str(tiny_llama), RECIPE, config, str(root / "store"), MODEL)
    assert res.state == "published", res
    key = manifest_key(MODEL, RECIPE, res.build_id)
    store = open_store(str(root / "store"))
    assert store.read_bytes(signature_key(key)) is not None
    return {"store": root / "store", "pub": pub, "build_id": res.build_id, "key": key, "root": root,
            "manifest": store.read_bytes(key)}


@pytest.fixture(scope="module")
def three_files(published, tmp_path_factory):
    """A build of three files (the tiny build's manifest with other files, published by hand in a local store):
    enough blobs for a copy killed between two of them."""
    from pipelines.store.layout import ref_document
    from pipelines.store.manifest import Manifest

    root = tmp_path_factory.mktemp("copy-three")
    store = open_store(str(root / "store"))
    store.check_writable()
    doc = json.loads(published["manifest"])
    doc["model"]["id"], doc["build_id"], doc["files"] = "test-org/three", hashlib.sha256(b"three").hexdigest(), []
    for i in range(3):
        f = root / f"part-{i}.bin"
        f.write_bytes(os.urandom(200_000 + i))
        doc["files"].append({"path": f.name, "sha256": store.put_blob(f), "size": f.stat().st_size})
    m = Manifest.parse(doc, "three")
    store.write_bytes(manifest_key(m.model.id, RECIPE, m.build_id), m.to_bytes())
    store.write_bytes(ref_key(m.model.id, RECIPE, "latest"), ref_document(m.model.id, RECIPE, m))
    return {"store": root / "store", "model": m.model.id, "build_id": m.build_id}


def _copy(capsys, *args: str) -> tuple[int, dict]:
    code = main(["copy", *args, "--json"])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out.strip() else {"stderr": out.err})


def _files(d: Path) -> dict[str, str]:
    """What a pull placed, but the pull marker (it records the store pulled from and the files' inodes)."""
    assert (d / "hive-aot.json").is_file()
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and p.name != "hive-aot.json"}


def _nothing_referenced(uri: str) -> None:
    store = open_store(uri)
    assert store.list("refs/") == [] and store.list("manifests/") == [], uri


def test_the_spec_grammar():
    assert parse_spec("a/b") == ("a/b", None, "latest")
    assert parse_spec("a/b:prod") == ("a/b", None, "prod")
    assert parse_spec("a/b@" + "c" * 12) == ("a/b", "c" * 12, "latest")
    for bad in ("a/b@c1:x", "a/b@xyz", "a/b:bad/tag", "nope"):
        with pytest.raises(HiveError):
            parse_spec(bad)


def test_local_s3_oci_layout_local_gives_the_same_build(published, s3_uri, oci_uri, tmp_path, capsys):
    layout = f"oci-layout://{tmp_path}/airgap/hive"
    chain = [str(published["store"]), s3_uri, oci_uri, layout, str(tmp_path / "back")]
    for src, dst in zip(chain, chain[1:]):
        code, rep = _copy(capsys, MODEL, "--from", src, "--to", dst)
        assert code == 0, rep
        assert [b["build_id"] for b in rep["builds"]] == [published["build_id"]]
        assert rep["builds"][0]["signature"] == "copied" and "latest" in rep["builds"][0]["tags"]
        assert rep["blobs_skipped"] == 0 and rep["bytes_sent"] > 0
        assert open_store(dst).read_bytes(published["key"]) == published["manifest"], dst  # same bytes: same id
    again_code, again = _copy(capsys, MODEL, "--from", chain[-2], "--to", chain[-1])  # a rerun sends nothing
    assert again_code == 0 and again["bytes_sent"] == 0 and again["blobs_copied"] == 0
    assert again["blobs_skipped"] == len(json.loads(published["manifest"])["files"])
    assert again["builds"][0]["signature"] == "already there"
    first = pull(MODEL, CPU, tmp_path / "first", recipe=RECIPE, store_uri=chain[0], trusted=str(published["pub"]))
    for i, uri in enumerate(chain[1:]):
        got = pull(MODEL, CPU, tmp_path / f"p{i}", recipe=RECIPE, store_uri=uri, trusted=str(published["pub"]))
        assert got.build_id == first.build_id == published["build_id"] and got.signed_by, uri
        assert _files(tmp_path / f"p{i}") == _files(tmp_path / "first"), uri


def test_a_layout_copy_is_what_skopeo_reads_and_pushes(published, oci_registry, oci_uri, tmp_path, capsys):
    """The layout a copy writes is read by skopeo as the registry's own (same manifest digest), and a model
    repository pushed from it to a registry with skopeo pulls there under the same build id."""
    layout_dir = tmp_path / "airgap" / "hive"
    for dst in (oci_uri, f"oci-layout://{layout_dir}"):
        assert _copy(capsys, MODEL, "--from", str(published["store"]), "--to", dst)[0] == 0
    repo = "test-org--copied"
    tag = f"_m.{RECIPE}.{published['build_id']}"
    name = f"hive-aot+m.{RECIPE}.{published['build_id']}"  # a ref.name cannot start with '_' (oci_dir.ref_name)
    host_repo = oci_uri[len("oci://"):]

    def skopeo(*args: str) -> str:
        proc = subprocess.run(["skopeo", *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    from_layout = skopeo("inspect", "--raw", f"oci:{layout_dir}/{repo}:{name}")
    from_registry = skopeo("inspect", "--raw", "--tls-verify=false", f"docker://{host_repo}/{repo}:{tag}")
    assert hashlib.sha256(from_layout.encode()).hexdigest() == hashlib.sha256(from_registry.encode()).hexdigest()
    mirror = f"{oci_registry}/mirror-{os.urandom(4).hex()}"
    for src_name, t in ((name, tag), (f"{RECIPE}.latest", f"{RECIPE}.latest")):
        skopeo("copy", "--preserve-digests", "--dest-tls-verify=false", f"oci:{layout_dir}/{repo}:{src_name}",
               f"docker://{mirror}/{repo}:{t}")
    # the signature travels with each artifact it is attached to: the referrers tag of each copied one. skopeo 1.9
    # rewrites a referrers index (it drops the entries' artifactType), so it refuses --preserve-digests there;
    # copied without, hive-aot still reads it
    for src_name in (name, f"{RECIPE}.latest"):
        digest = hashlib.sha256(skopeo("inspect", "--raw", f"oci:{layout_dir}/{repo}:{src_name}").encode()).hexdigest()
        skopeo("copy", "--all", "--dest-tls-verify=false", f"oci:{layout_dir}/{repo}:sha256-{digest}",
               f"docker://{mirror}/{repo}:sha256-{digest}")
    got = pull(MODEL, CPU, tmp_path / "mirrored", recipe=RECIPE, store_uri=f"oci://{mirror}",
               trusted=str(published["pub"]))
    assert got.build_id == published["build_id"] and got.signed_by


def _killed_copy(model: str, src: str, dst: str, kill_at: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), KILL_ENV: kill_at}
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "copy", model, "--from", src, "--to", dst, "--json"],
                          env=env, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr)


@pytest.mark.parametrize("kind", ["local", "oci-layout"])
def test_an_interrupted_copy_references_nothing_and_a_rerun_resumes(kind, three_files, tmp_path, capsys):
    dst = str(tmp_path / "dst") if kind == "local" else f"oci-layout://{tmp_path}/dst/hive"
    src, model = str(three_files["store"]), three_files["model"]
    _killed_copy(model, src, dst, "temp:blobs#1")  # mid-blob: the first one complete, not yet in place
    _nothing_referenced(dst)
    assert open_store(dst).list("blobs/") == []
    _killed_copy(model, src, dst, "done:blobs#2")  # two blobs landed, the third did not
    _nothing_referenced(dst)
    code, rep = _copy(capsys, model, "--from", src, "--to", dst)
    assert code == 0, rep
    assert (rep["blobs_skipped"], rep["blobs_copied"]) == (2, 1) and rep["builds"][0]["tags"] == ["latest"]
    assert open_store(dst).read_ref(ref_key(model, RECIPE, "latest"))["build_id"] == three_files["build_id"]
    assert main(["verify", model, "--deep", "--store", dst]) == 0
    assert main(["gc", "--store", dst, "--min-age", "0"]) == 0  # the killed writers' temporaries go
    left = [p for p in (tmp_path / "dst").rglob("*") if p.is_file() and (p.name.startswith((".", "tmp-")))]
    assert left == [], left


def test_a_copy_killed_after_its_manifest_writes_no_ref(published, tmp_path, capsys):
    dst = f"oci-layout://{tmp_path}/dst/hive"
    _killed_copy(MODEL, str(published["store"]), dst, "done:manifests#1")  # blobs and manifest: still no ref
    assert open_store(dst).list("refs/") == [] and open_store(dst).list("manifests/")
    code, rep = _copy(capsys, MODEL, "--from", str(published["store"]), "--to", dst)
    assert code == 0 and rep["blobs_copied"] == 0 and rep["blobs_skipped"] == 1, rep
    assert pull(MODEL, CPU, tmp_path / "p", recipe=RECIPE, store_uri=dst, trusted=str(published["pub"])).signed_by


def test_a_tampered_source_blob_is_one_line_and_nothing_is_referenced(published, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(published["store"], src)
    f = json.loads(published["manifest"])["files"][0]
    blob = src / "blobs" / "sha256" / f["sha256"][:2] / f["sha256"]
    blob.chmod(0o644)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    blob.write_bytes(bytes(data))
    dst = f"oci-layout://{tmp_path}/dst/hive"
    assert main(["copy", MODEL, "--from", str(src), "--to", dst]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"blob {f['sha256'][:12]} of {f['path']}" in err and "nothing of it is " \
        "referenced" in err, err
    _nothing_referenced(dst)


def test_a_manifest_that_is_not_what_its_ref_records_copies_nothing(published, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(published["store"], src)
    mpath = src / published["key"]
    mpath.chmod(0o644)
    mpath.write_bytes(published["manifest"].replace(b'"format"', b' "format"', 1))
    assert main(["copy", MODEL, "--from", str(src), "--to", str(tmp_path / "dst")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not match the sha256 its ref records" in err, err
    assert not (tmp_path / "dst" / "blobs").exists()


def test_a_destination_holding_another_manifest_is_refused(published, tmp_path, capsys):
    dst = tmp_path / "dst"
    (dst / published["key"]).parent.mkdir(parents=True)
    (dst / published["key"]).write_bytes(b"{}")
    assert main(["copy", f"{MODEL}@{published['build_id'][:10]}", "--from", str(published["store"]),
                 "--to", str(dst)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds another manifest" in err, err
    assert not (dst / "refs").exists()


def test_by_build_prefix_adds_tags_but_never_moves_one(published, tmp_path, capsys):
    dst = str(tmp_path / "dst")
    other = json.dumps({"build_id": "f" * 64, "manifest": "x", "manifest_sha256": "0" * 64}).encode()
    store = open_store(dst)
    store.check_writable()
    store.write_bytes(ref_key(MODEL, RECIPE, "latest"), other)  # production's latest names another build
    code, rep = _copy(capsys, f"{MODEL}@{published['build_id'][:12]}", "--from", str(published["store"]), "--to", dst)
    assert code == 0 and rep["builds"][0]["build_id"] == published["build_id"], rep
    assert "latest" not in rep["builds"][0]["tags"] and rep["builds"][0]["tags"]  # the revision tag was added
    assert store.read_bytes(ref_key(MODEL, RECIPE, "latest")) == other
    # the tag asked for moves
    code, rep = _copy(capsys, f"{MODEL}:latest", "--from", str(published["store"]), "--to", dst)
    assert code == 0 and rep["builds"][0]["tags"] == ["latest"] and rep["blobs_skipped"] > 0
    assert store.read_ref(ref_key(MODEL, RECIPE, "latest"))["build_id"] == published["build_id"]


def test_bad_requests_are_one_line(published, tmp_path, capsys):
    src = str(published["store"])
    for args, needle in (([MODEL + ":nope", "--from", src, "--to", str(tmp_path / "d")], "no tag 'nope'"),
                         ([MODEL, "--from", src, "--to", src], "are the same store"),
                         ([MODEL + "@" + "0" * 12, "--from", src, "--to", str(tmp_path / "d")],
                          "no published build"),
                         ([MODEL, "--from", str(tmp_path / "missing"), "--to", str(tmp_path / "d")],
                          "does not exist")):
        assert main(["copy", *args]) != 0
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, (args, err)
    assert not (tmp_path / "d").exists()


def test_quiet_silences_the_bars_of_copy_and_verify(published, tmp_path, capsys, monkeypatch):
    """Bars forced on (HIVE_AOT_PROGRESS, as a terminal would have them): copy and verify --deep draw them, and
    --quiet leaves stderr empty."""
    monkeypatch.setenv("HIVE_AOT_PROGRESS", "1")
    src = str(published["store"])
    for quiet in ((), ("--quiet",)):
        dst = str(tmp_path / f"dst{len(quiet)}")
        assert main(["copy", MODEL, "--from", src, "--to", dst, *quiet]) == 0
        assert main(["verify", MODEL, "--deep", "--store", dst, *quiet]) == 0
        err = capsys.readouterr().err
        assert ("%|" in err) is not bool(quiet), err  # tqdm's bar: `copy ...:  40%|####  |`
        if quiet:
            assert err == ""
