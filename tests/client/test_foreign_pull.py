"""`hive-aot pull oci://HOST/REPO:TAG`: ModelPack artifacts pushed by another tool (oras-py, with the ModelPack media
types, as modctl and KitOps write them) into a directory, against the real registry fixture.

Good artifacts (raw layers, tar and tar+gzip layers, the v0.0.6 cnai names, by tag and by digest) pull with files
byte-identical to what was pushed; a second pull finds DIR present; a killed pull resumes. Bad ones (a layer whose
bytes differ from its digest, a missing layer, duplicate / `../` / absolute paths, links, a manifest over 4 MiB, a
plain image, zstd) are one line each, with nothing in DIR or beside it."""

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
import time
import uuid
from pathlib import Path

import pytest
from oci_registry import data_dir

from pipelines.client.blob_cache import missing_bytes
from pipelines.client.foreign_pull import pull_foreign
from pipelines.core.errors import HiveError, IntegrityError, StoreError
from pipelines.store.oci_artifact import parse_reference
from pipelines.store.oci_client import Registry

oras_provider = pytest.importorskip("oras.provider", reason="oras-py (the dev extra) pushes the foreign artifacts")

REPO = Path.cwd()
ARTIFACT, CONFIG = "application/vnd.cncf.model.manifest.v1+json", "application/vnd.cncf.model.config.v1+json"
PATH, TITLE = "org.cncf.model.filepath", "org.opencontainers.image.title"
META = "org.cncf.model.file.metadata+json"


def raw(path: str, data: bytes, kind: str = "weight", **notes: str) -> tuple[bytes, str, dict]:
    """A raw ModelPack layer as modctl writes it: both path annotations."""
    return data, f"application/vnd.cncf.model.{kind}.v1.raw", {PATH: path, TITLE: path, **notes}


def tar_layer(members: list[tuple[str, bytes | None, bytes]], gz: bool = False) -> tuple[bytes, str, dict]:
    """A tar (or tar+gzip) layer; members are (name, tar type, data)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w", format=tarfile.PAX_FORMAT) as t:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            info.type = kind or tarfile.REGTYPE
            if info.type == tarfile.SYMTYPE:
                info.linkname = "/etc/passwd"
            info.size = len(data) if info.isreg() else 0
            info.mode = 0o755 if info.isdir() else 0o644
            t.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue(), "application/vnd.cncf.model.code.v1.tar" + ("+gzip" if gz else ""), {}


def push(host: str, layers: list[tuple[bytes, str, dict]], tmp: Path, *, tag: str = "v1", repo: str | None = None,
         artifact_type: str | None = ARTIFACT, config_type: str = CONFIG, login: tuple[str, str] | None = None,
         sizes: dict[int, int] | None = None) -> tuple[str, str]:
    """Push an artifact with oras-py's blob and manifest calls (its push() has no artifactType): (repo, digest).
    `sizes`: layer index (from 0) -> the size its descriptor claims instead of the true one."""
    repo = repo or f"foreign/m-{uuid.uuid4().hex[:10]}"
    client = oras_provider.Registry(hostname=host, insecure=True, auth_backend="basic" if login else "token")
    if login:
        client.auth.set_basic_auth(*login)
    container = client.get_container(f"{host}/{repo}:{tag}")
    descriptors = []
    config = json.dumps({"descriptor": {"name": "tiny"}, "config": {"format": "safetensors"},
                         "modelfs": {"type": "layers", "diffIds": []}}).encode()
    for data, media_type, notes in [*layers, (config, config_type, {})]:
        blob = tmp / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        desc = {"mediaType": media_type, "digest": f"sha256:{blob.name}", "size": len(data),
                **({"annotations": notes} if notes else {})}
        assert client.upload_blob(str(blob), container, desc).status_code in (200, 201)
        descriptors.append(desc)
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": descriptors.pop(), "layers": descriptors}
    for index, size in (sizes or {}).items():
        descriptors[index] = {**descriptors[index], "size": size}
    if artifact_type:
        manifest["artifactType"] = artifact_type
    assert client.upload_manifest(manifest, container).status_code == 201
    got = client.do_request(f"http://{host}/v2/{repo}/manifests/{tag}", "HEAD",
                            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    return repo, got.headers["Docker-Content-Digest"]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache of the test's own: a blob cached by another test must not hide a tampered registry."""
    monkeypatch.setenv("HIVE_AOT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, cwd=REPO)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_an_artifact_pushed_with_oras_pulls_byte_identical(oci_registry, cache, tmp_path):
    """Raw weight, config and doc layers (one in a subdirectory): `hive-aot pull oci://...` gives exactly those
    files plus the marker; the JSON names files, sizes and the digest; a second pull and a pull by digest find
    DIR present."""
    weights = os.urandom(3 << 20)
    pushed = {"model.safetensors": weights, "config.json": b'{"architectures": ["X"]}',
              "docs/README.md": b"# tiny\n", "empty.txt": b""}
    repo, digest = push(oci_registry, [raw("model.safetensors", weights), raw("config.json", pushed["config.json"],
                                                                                "weight.config"),
                                       raw("docs/README.md", pushed["docs/README.md"], "doc"),
                                       raw("empty.txt", b"", "doc")], tmp_path)
    dest = tmp_path / "out" / "model"
    ref = f"oci://{oci_registry}/{repo}:v1"
    proc = _cli("pull", ref, "--dest", str(dest), "--json")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["digest"] == digest and res["reference"] == ref and res["already_present"] is False
    assert {f["path"]: f["size"] for f in res["files"]} == {p: len(d) for p, d in pushed.items()}
    assert {f["path"]: f["sha256"] for f in res["files"]} == {p: hashlib.sha256(d).hexdigest() for p, d in pushed.items()}
    got = _files(dest)
    marker = json.loads(got.pop("hive-aot.json"))
    assert got == pushed and marker["build_id"] == digest and marker["reference"] == ref
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model"]  # no lock, staging or partial left
    again = pull_foreign(ref, dest)
    assert again["already_present"] is True and "transfer" not in again
    by_digest = pull_foreign(f"oci://{oci_registry}/{repo}@{digest}", dest)
    assert by_digest["already_present"] is True and by_digest["digest"] == digest
    # written in place (through the hard link, the cached blob too): only that file is fetched again
    (dest / "config.json").write_bytes(b'{"architectures": ["Y"]}')
    fixed = pull_foreign(ref, dest)
    assert fixed["already_present"] is False and fixed["transfer"]["fetched_bytes"] == len(pushed["config.json"])
    assert _files(dest)["config.json"] == pushed["config.json"]


def test_tar_and_gzip_layers_and_legacy_cnai_names_unpack(oci_registry, cache, tmp_path):
    """KitOps-style tar layers (a `./` root, directories, files) and a tar+gzip one unpack to DIR; the v0.0.6
    `vnd.cnai.model` names are accepted; a second pull finds DIR present from its marker."""
    code = tar_layer([("./", tarfile.DIRTYPE, b""), ("./code/", tarfile.DIRTYPE, b""),
                      ("./code/run.py", None, b"print('hi')\n"), ("code/util.py", None, b"X = 1\n")])
    data = tar_layer([("data/a.bin", None, os.urandom(70_000)), ("data/same.bin", None, b"dup"),
                      ("data/copy.bin", None, b"dup")], gz=True)
    weights = os.urandom(100_000)
    legacy = (weights, "application/vnd.cnai.model.weight.v1.raw", {"org.cnai.model.filepath": "w.bin"})
    repo, digest = push(oci_registry, [legacy, code, data], tmp_path, artifact_type=None,
                        config_type="application/vnd.cnai.model.config.v1+json")
    dest = tmp_path / "model"
    res = pull_foreign(f"oci://{oci_registry}/{repo}:v1", dest)
    got = _files(dest)
    got.pop("hive-aot.json")
    with tarfile.open(fileobj=io.BytesIO(data[0])) as t:
        a_bin = t.extractfile("data/a.bin").read()
    assert got == {"w.bin": weights, "code/run.py": b"print('hi')\n", "code/util.py": b"X = 1\n",
                   "data/a.bin": a_bin, "data/same.bin": b"dup", "data/copy.bin": b"dup"}
    assert [f["path"] for f in res["files"]] == ["w.bin", "code/run.py", "code/util.py", "data/a.bin",
                                                 "data/same.bin", "data/copy.bin"]
    assert oct((dest / "code/run.py").stat().st_mode & 0o777) == "0o644"
    assert pull_foreign(f"oci://{oci_registry}/{repo}@{digest}", dest)["already_present"] is True
    (dest / "data/a.bin").write_bytes(b"changed")
    assert pull_foreign(f"oci://{oci_registry}/{repo}:v1", dest)["already_present"] is False
    assert (dest / "data/a.bin").read_bytes() == a_bin


def test_a_killed_pull_resumes(oci_registry, tmp_path):
    """SIGKILL `hive-aot pull oci://...` mid-download (64 KiB parts): DIR is absent, the part list keeps what it
    wrote; the next pull fetches only the rest and the file is byte-identical."""
    size = 16 << 20
    weights = os.urandom(size)
    sha = hashlib.sha256(weights).hexdigest()
    repo, _ = push(oci_registry, [raw("model.gguf", weights)], tmp_path)
    cache, dest = tmp_path / "cache", tmp_path / "out" / "model"
    env = {"HIVE_AOT_CACHE": str(cache), "HIVE_AOT_PULL_PART_SIZE": "64K"}
    cmd = [sys.executable, "-m", "pipelines.cli", "pull", f"oci://{oci_registry}/{repo}:v1", "--dest", str(dest),
           "--json"]
    state = cache / "blobs" / "sha256" / sha[:2] / f".{sha}.parts"
    blob = cache / "blobs" / "sha256" / sha[:2] / sha
    for _ in range(10):
        proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(REPO), **env}, cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        killed = False
        while proc.poll() is None:
            try:
                done = len(json.loads(state.read_text())["done"])
            except (OSError, ValueError, KeyError):
                done = 0
            if done >= 24:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=60)
                killed = True
                break
            time.sleep(0.001)
        if killed and not blob.exists():
            break
        # it finished (or verified the blob) before the kill came: start over from nothing
        shutil.rmtree(dest, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    else:
        pytest.fail("every pull finished before it could be killed")
    assert not dest.exists()
    written = size - missing_bytes_in(cache, sha, size)
    assert 0 < written < size
    done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(REPO), **env}, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    moved = json.loads(done.stdout)["transfer"]
    assert moved["resumed_bytes"] == written and moved["fetched_bytes"] == size - written
    assert (dest / "model.gguf").read_bytes() == weights


def missing_bytes_in(cache: Path, sha: str, size: int) -> int:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HIVE_AOT_CACHE", str(cache))
        return missing_bytes(sha, size)


def _refused(ref: str, dest: Path, error: type = HiveError, *needles: str) -> str:
    with pytest.raises(error) as ei:
        pull_foreign(ref, dest)
    line = str(ei.value)
    assert "\n" not in line
    for needle in needles:
        assert needle in line, line
    assert not dest.exists() and [p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}")] == []
    return line


BAD = {
    "duplicate path": ([raw("a.bin", b"one"), raw("a.bin", b"two")], "duplicate paths"),
    "duplicate ignoring case": ([raw("Model.bin", b"one"), raw("model.bin", b"two")], "only in letter case"),
    "parent path": ([raw("../evil.bin", b"x")], "escapes its directory"),
    "absolute path": ([raw("/etc/evil.bin", b"x")], "not a plain relative path"),
    "file and directory": ([raw("a", b"x"), raw("a/b", b"y")], "both a file and a directory"),
    "the marker's name": ([raw("hive-aot.json", b"{}")], "a file the pull writes itself"),
    "no file name": ([(b"x", "application/vnd.cncf.model.weight.v1.raw", {})], "names no file"),
    "symlink typeflag": ([raw("link.bin", b"/etc/passwd", **{META: json.dumps({"name": "link.bin", "typeflag": 50})})],
                         "symbolic link"),
    "tar symlink member": ([tar_layer([("ok.py", None, b"1"), ("evil", tarfile.SYMTYPE, b"")])], "symbolic link"),
    "tar parent member": ([tar_layer([("../evil.py", None, b"1")])], "escapes its directory"),
    "tar duplicate of a raw file": ([raw("run.py", b"a"), tar_layer([("run.py", None, b"b")])], "duplicate paths"),
    "zstd": ([(b"x", "application/vnd.cncf.model.weight.v1.tar+zstd", {})], "zstd"),
    "not a tar": ([(b"not a tar at all" * 40, "application/vnd.cncf.model.weight.v1.tar", {})], "not a readable tar"),
    "unknown layer type": ([(b"x", "application/octet-stream", {TITLE: "x"})], "not a ModelPack layer"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_artifacts_are_one_line_and_leave_nothing(case, oci_registry, cache, tmp_path):
    layers, needle = BAD[case]
    repo, _ = push(oci_registry, layers, tmp_path)
    _refused(f"oci://{oci_registry}/{repo}:v1", tmp_path / "model", HiveError, needle)


def test_not_a_modelpack_artifact(oci_registry, cache, tmp_path):
    """A plain OCI image (image config, a tar layer, no artifactType) is refused, naming what it is."""
    layer = tar_layer([("bin/sh", None, b"#!")])
    repo, _ = push(oci_registry, [(layer[0], "application/vnd.oci.image.layer.v1.tar", {})], tmp_path,
                   artifact_type=None, config_type="application/vnd.oci.image.config.v1+json")
    _refused(f"oci://{oci_registry}/{repo}:v1", tmp_path / "model", HiveError, "not a ModelPack artifact",
             "application/vnd.oci.image.config.v1+json")


def test_a_layer_whose_bytes_differ_from_its_digest(oci_registry, cache, tmp_path):
    """The registry's stored bytes changed behind its API (same size): the digest check refuses them."""
    weights = os.urandom(200_000)
    sha = hashlib.sha256(weights).hexdigest()
    repo, _ = push(oci_registry, [raw("config.json", b"{}", "weight.config"), raw("w.bin", weights)], tmp_path)
    stored = data_dir(oci_registry) / "docker/registry/v2/blobs/sha256" / sha[:2] / sha / "data"
    stored.write_bytes(weights[:-4] + bytes(b ^ 0xFF for b in weights[-4:]))
    _refused(f"oci://{oci_registry}/{repo}:v1", tmp_path / "model", IntegrityError, sha[:12], "sha256")


def test_a_missing_layer(oci_registry, cache, tmp_path):
    weights = os.urandom(1000)
    repo, _ = push(oci_registry, [raw("config.json", b"{}", "weight.config"), raw("w.bin", weights)], tmp_path)
    Registry(oci_registry).delete_blob(repo, "sha256:" + hashlib.sha256(weights).hexdigest())
    _refused(f"oci://{oci_registry}/{repo}:v1", tmp_path / "model", StoreError, "layer 2 (w.bin)", "is missing", "404")


def test_a_manifest_over_the_bound(tmp_path):
    """A manifest over 4 MiB is refused unread. Distribution neither stores nor serves one ("read exceeds limit"),
    so a registry that sends one is the hostile loopback server of test_oci_hostile."""
    from test_oci_hostile import Server

    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "artifactType": ARTIFACT, "config": {}, "layers": [],
                           "annotations": {"padding": "x" * (4 << 20)}}).encode()
    server = Server()
    server.route = lambda h: h.reply(200, manifest, {"Content-Type": "application/vnd.oci.image.manifest.v1+json"}) \
        if "/manifests/" in h.path else h.reply(404)
    try:
        _refused(f"oci://127.0.0.1:{server.port}/big/model:v1", tmp_path / "model", StoreError, "larger than 4 MiB")
    finally:
        server.close()
    assert [m for m, path, _ in server.seen if "/blobs/" in path] == []  # no layer was asked for


def test_a_layer_shorter_or_longer_than_its_descriptor(oci_registry, cache, tmp_path):
    """A descriptor whose size is not its blob's: the bytes read do not make the digest."""
    weights = os.urandom(5000)
    for size in (4000, 6000):
        repo, _ = push(oci_registry, [raw("w.bin", weights)], tmp_path, sizes={0: size})
        _refused(f"oci://{oci_registry}/{repo}:v1", tmp_path / "model", IntegrityError, "sha256")


def test_one_blob_with_two_sizes(oci_registry, cache, tmp_path):
    repo, _ = push(oci_registry, [raw("a.bin", b"same"), raw("b.bin", b"same")], tmp_path, sizes={1: 3})
    _refused(f"oci://{oci_registry}/{repo}:v1", tmp_path / "model", HiveError, "two sizes")


def test_a_registry_that_asks_for_credentials(oci_auth_registry, cache, tmp_path, monkeypatch):
    """Credentials as the OCI store takes them (HIVE_AOT_OCI_USERNAME/PASSWORD); none: one line."""
    from oci_registry import PASSWORD, USER

    repo, digest = push(oci_auth_registry, [raw("w.bin", b"weights")], tmp_path, login=(USER, PASSWORD))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker"))
    monkeypatch.delenv("HIVE_AOT_OCI_USERNAME", raising=False)
    monkeypatch.delenv("HIVE_AOT_OCI_PASSWORD", raising=False)
    _refused(f"oci://{oci_auth_registry}/{repo}:v1", tmp_path / "model", StoreError, "credentials")
    monkeypatch.setenv("HIVE_AOT_OCI_USERNAME", USER)
    monkeypatch.setenv("HIVE_AOT_OCI_PASSWORD", PASSWORD)
    res = pull_foreign(f"oci://{oci_auth_registry}/{repo}:v1", tmp_path / "model")
    assert res["digest"] == digest and (tmp_path / "model" / "w.bin").read_bytes() == b"weights"


def test_a_digest_pull_gets_those_bytes_or_nothing(oci_registry, cache, tmp_path):
    repo, digest = push(oci_registry, [raw("w.bin", b"w")], tmp_path)
    other = "sha256:" + "0" * 64
    _refused(f"oci://{oci_registry}/{repo}@{other}", tmp_path / "model", StoreError, "not found")
    assert pull_foreign(f"oci://{oci_registry}/{repo}@{digest}", tmp_path / "m")["digest"] == digest


@pytest.mark.parametrize("ref, needle", [
    ("oci://127.0.0.1:5000/repo", "REPOSITORY:TAG"),
    ("oci://127.0.0.1:5000/Repo:v1", "lowercase"),
    ("oci://127.0.0.1:5000/repo@sha512:" + "a" * 128, "sha256"),
    ("oci://user:s3cret@127.0.0.1:5000/repo:v1", "***@127.0.0.1"),
    ("oci://127.0.0.1:5000/repo:v1?x=1", "REPOSITORY:TAG"),
])
def test_bad_references_are_one_line(ref, needle):
    with pytest.raises(HiveError) as ei:
        parse_reference(ref)
    assert needle in str(ei.value) and "s3cret" not in str(ei.value)


def test_cli_target_rules(tmp_path):
    """A store pull still needs --target (a usage error: exit 2, the usage line and the reason); an oci:// pull refuses
    the store-only flags."""
    proc = _cli("pull", "test-org/x", "--dest", str(tmp_path / "d"))
    assert proc.returncode == 2 and "required for a model of the store: --target" in proc.stderr
    assert proc.stderr.startswith("usage: hive-aot pull") and proc.stdout == ""
    proc = _cli("pull", "oci://127.0.0.1:1/r:t", "--target", "auto", "--recipe", "x", "--dest", str(tmp_path / "d"))
    assert proc.returncode == 1 and "--target, --recipe: not for an oci:// artifact" in proc.stderr


# --- OpenSSF Model Signing: a bundle made by the reference implementation, attached as an OCI referrer ---------------

def _model_signing() -> Path:
    cli = Path(os.environ.get("HIVE_AOT_MODEL_SIGNING_VENV") or REPO / ".venvs" / "model-signing") / "bin" / "model_signing"
    if not cli.exists():
        pytest.fail(f"{cli} is missing: run `make setup` (it builds the model-signing venv)")
    return cli


def _signed_dir(tmp: Path, name: str, files: dict[str, bytes], priv: Path) -> bytes:
    """`model_signing sign key` over a directory holding `files`: the bundle's bytes."""
    model = tmp / name
    for path, data in files.items():
        (model / path).parent.mkdir(parents=True, exist_ok=True)
        (model / path).write_bytes(data)
    sig = tmp / f"{name}.sig"
    proc = subprocess.run([str(_model_signing()), "sign", "key", "--private_key", str(priv), "--signature", str(sig),
                           str(model)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return sig.read_bytes()


def _attach(host: str, repo: str, digest: str, bundle: bytes) -> None:
    from pipelines.store.oci_referrers import attach_bundle

    registry = Registry(host)
    raw, _ = registry.get_manifest(repo, digest)
    attach_bundle(registry, repo, {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": digest,
                                   "size": len(raw)}, bundle)


def test_a_signed_artifact_verifies_and_keeps_its_bundle(oci_registry, cache, tmp_path):
    """Files signed with `model_signing sign key`, pushed with oras-py, the bundle attached as a referrer (the
    referrers tag on Distribution 2.8): the pull verifies it against exactly DIR's files, keeps it as model.sig, and
    `model_signing verify` accepts DIR (its marker ignored). An untrusted key, a bundle over other bytes, no bundle,
    and a bundle listed for another manifest are one line each, with nothing in DIR."""
    from factories import ecdsa_keypair

    from pipelines.store.oci_client import INDEX_TYPE
    from pipelines.store.oci_referrers import referrers_tag

    priv, pub = ecdsa_keypair(tmp_path, "publisher")
    _, other = ecdsa_keypair(tmp_path, "other")
    files = {"config.json": b'{"model_type": "llama"}', "weights/model.safetensors": os.urandom(50_000)}
    layers = [raw(p, d) for p, d in files.items()]
    bundle = _signed_dir(tmp_path, "src", files, priv)
    repo, digest = push(oci_registry, layers, tmp_path)
    _attach(oci_registry, repo, digest, bundle)
    ref, dest = f"oci://{oci_registry}/{repo}:v1", tmp_path / "model"

    res = pull_foreign(ref, dest, trusted=str(pub))
    assert res["signed_by"] and (dest / "model.sig").read_bytes() == bundle
    proc = subprocess.run([str(_model_signing()), "verify", "key", "--signature", str(dest / "model.sig"),
                           "--public_key", str(pub), "--ignore-paths", str(dest / "hive-aot.json"), str(dest)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    again = pull_foreign(ref, dest, trusted=str(pub))
    assert again["already_present"] is True and again["signed_by"] == res["signed_by"]

    with pytest.raises(IntegrityError) as ei:
        pull_foreign(ref, tmp_path / "untrusted", trusted=str(other))
    assert "\n" not in str(ei.value) and not (tmp_path / "untrusted").exists()

    tampered = {**files, "config.json": b'{"model_type": "evil"}'}  # signed, but not what the artifact holds
    repo2, digest2 = push(oci_registry, layers, tmp_path)
    _attach(oci_registry, repo2, digest2, _signed_dir(tmp_path, "other-src", tampered, priv))
    with pytest.raises(IntegrityError, match="its signature is for other files .*config.json"):
        pull_foreign(f"oci://{oci_registry}/{repo2}:v1", tmp_path / "m2", trusted=str(pub))
    assert not (tmp_path / "m2").exists()

    _, digest3 = push(oci_registry, [raw("config.json", b"{}")], tmp_path, repo=repo, tag="v3")
    with pytest.raises(IntegrityError, match="no OpenSSF Model Signing bundle refers to"):
        pull_foreign(f"oci://{oci_registry}/{repo}:v3", tmp_path / "m3", trusted=str(pub))
    # the referrers of v1 listed as v3's: the bundle's subject is another manifest
    registry = Registry(oci_registry)
    index, _ = registry.get_manifest(repo, referrers_tag(digest), accept=INDEX_TYPE)
    registry.put_manifest(repo, referrers_tag(digest3), index, media_type=INDEX_TYPE)
    with pytest.raises(IntegrityError, match="another manifest"):
        pull_foreign(f"oci://{oci_registry}/{repo}:v3", tmp_path / "m3", trusted=str(pub))
    assert not (tmp_path / "m3").exists() and not (tmp_path / "m2").exists()
