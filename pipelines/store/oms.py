"""OpenSSF Model Signing (OMS v1.0): the signature hive-aot writes, and its verifier, key method only.

An OMS bundle is a Sigstore bundle (JSON) whose DSSE envelope carries an in-toto statement naming every signed
file with its sha256 (the spec, its JSON schemas and test vectors: github.com/ossf/model-signing-spec, v1.0).
It is what `model_signing sign key` writes and `model_signing verify key` reads, so what hive-aot signs
verifies with the field's own tool, and the other way round. Implemented is what hive-aot needs:

- the `key` method with ECDSA P-256 / P-384 / P-521 keys, each signing with its curve's hash (SHA-256, -384,
  -512: the Sigstore key details the reference implementation uses). Certificate and Sigstore (keyless)
  bundles, and the `shards` serialization, are refused in one line;
- a key is named by its OMS hint: the sha256 (hex) of its SubjectPublicKeyInfo PEM, as the reference
  implementation writes it. Bundles from before the hint (`publicKey.rawBytes`, the PEM itself) still verify;
- parsing checks a bundle against the spec's four schemas (bundle, envelope, statement, predicate) by hand,
  so verifying needs no schema library: only `cryptography` (the [sign] extra), imported when a key is used,
  so that the pull client without that extra still imports.

Nothing here reads a model directory: callers hand in the files they expect (path -> sha256) and compare.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from ..core.errors import IntegrityError

BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
# Sigstore's names for the same bundle format (the older spelling and the versions before 0.3 that carry keys)
KNOWN_MEDIA_TYPES = frozenset({BUNDLE_MEDIA_TYPE} | {f"application/vnd.dev.sigstore.bundle+json;version=0.{v}"
                                                       for v in (1, 2, 3)})
SIGNATURE_FILE = "model.sig"  # the file name `model_signing` signs into and verifies from by default
MANIFEST_FILE = "hive-aot.manifest.json"  # the hive-aot manifest's exact bytes, signed beside the build's files
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
# Excluded by every OMS signer and verifier (spec 6.2); recorded in ignore_paths as the reference does.
DEFAULT_IGNORED = (".git", ".gitattributes", ".github", ".gitignore")
CURVE_HASHES = {"secp256r1": "SHA256", "secp384r1": "SHA384", "secp521r1": "SHA512"}
HASH_TYPES = ("sha256", "blake2b", "blake3")  # the algorithm registry's names; only sha256 is verified here
MAX_BUNDLE_BYTES = 16 * 1024 * 1024  # ~150 bytes a file: a bundle for 100,000 files fits
_HEX = re.compile(r"[0-9a-f]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_ENVELOPE_KEYS = {"payload", "payloadType", "signatures"}
_STATEMENT_KEYS = {"_type", "subject", "predicateType", "predicate"}
_SERIALIZATION_KEYS = {"method", "hash_type", "shard_size", "allow_symlinks", "ignore_paths"}
# verificationMaterial.content is a oneof in Sigstore's protobuf: exactly one of these names the signer
_KEY_MATERIAL = ("publicKey", "x509CertificateChain", "certificate")


@dataclass(frozen=True)
class Bundle:
    """A bundle that passed every structural check; nothing in it is trusted until `verify` says so."""
    hint: str | None  # the signer's key id, or None in a bundle from before hints (then `public_pem` names it)
    public_pem: bytes | None
    payload: bytes  # the statement's exact bytes, what the signature covers (through PAE)
    signatures: tuple[bytes, ...]
    subject_name: str
    resources: dict[str, str]  # file path -> sha256 hex, as signed
    ignore_paths: tuple[str, ...]


def key_hint(public_key) -> str:
    """The OMS id of an ECDSA public key: sha256 hex of its SubjectPublicKeyInfo PEM."""
    from cryptography.hazmat.primitives import serialization

    pem = public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


def curve_of(key) -> str | None:
    """'secp256r1' etc. for an ECDSA key on a curve OMS signs with (private or public); None for anything else."""
    from cryptography.hazmat.primitives.asymmetric import ec

    if isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)) and key.curve.name in CURVE_HASHES:
        return key.curve.name
    return None


def _ecdsa(key):
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.ECDSA(getattr(hashes, CURVE_HASHES[key.curve.name])())


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what a DSSE signature is over (lengths in bytes, ASCII decimal)."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def root_digest(digests: list[str]) -> str:
    """The statement's subject digest: sha256 over the resources' raw digests, in the resources' order."""
    return hashlib.sha256(b"".join(bytes.fromhex(d) for d in digests)).hexdigest()


def canonical_name(name: Any) -> bool:
    """A resource name as the spec writes it: relative, `/`-separated, no empty, `.` or `..` component."""
    return (isinstance(name, str) and bool(name) and "\x00" not in name
            and not any(part in ("", ".", "..") for part in name.split("/")))


def sign(files: dict[str, str], private_key, *, name: str, ignore_paths: list[str]) -> bytes:
    """The OMS bundle (JSON bytes) signing `files` (path -> sha256 hex) with an ECDSA key.

    `name` is the subject's name (informational for verifiers); `ignore_paths` records what a verifier of the
    directory must skip besides the signed files (files listed there are never signed: a caller's error)."""
    if curve_of(private_key) is None:
        raise ValueError("OMS signs with ECDSA P-256, P-384 or P-521 keys only")
    bad = next((p for p, d in files.items() if not canonical_name(p) or not _SHA256.fullmatch(str(d))), None)
    if not files or bad is not None or not name:
        raise IntegrityError(f"cannot sign {bad!r}: not a relative path with a sha256" if bad is not None
                             else "cannot sign: no files" if files else "cannot sign: no name")
    names = sorted(files)  # code point order, as the spec orders resources
    statement = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": root_digest([files[n] for n in names])}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "resources": [{"name": n, "digest": files[n], "algorithm": "sha256"} for n in names],
            "serialization": {"method": "files", "hash_type": "sha256", "allow_symlinks": False,
                              "ignore_paths": list(ignore_paths)},
        },
    }
    payload = json.dumps(statement, indent=2).encode()
    signature = private_key.sign(pae(PAYLOAD_TYPE, payload), _ecdsa(private_key))
    bundle = {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": key_hint(private_key.public_key())}, "tlogEntries": []},
        "dsseEnvelope": {"payload": base64.b64encode(payload).decode(), "payloadType": PAYLOAD_TYPE,
                         "signatures": [{"sig": base64.b64encode(signature).decode(), "keyid": ""}]},
    }
    return (json.dumps(bundle, indent=2) + "\n").encode()


class _Malformed(Exception):
    """Why a bundle fails the spec's schemas; `parse` turns it into one IntegrityError line."""


class _Unsupported(Exception):
    """A well-formed bundle this verifier does not handle (certificate, Sigstore, shards, other hashes)."""


def _need(ok: Any, reason: str) -> None:
    if not ok:
        raise _Malformed(reason)


def _b64(value: Any, what: str) -> bytes:
    """Bytes from a protobuf-JSON bytes field: standard or URL-safe base64, padding optional."""
    _need(isinstance(value, str) and value, f"{what} is not a base64 string")
    text = value.replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise _Malformed(f"{what} is not valid base64") from None


def _strings(obj: dict, fields: tuple[str, ...], what: str) -> None:
    for f in fields:
        _need(f not in obj or isinstance(obj[f], str), f"{what}.{f} is not a string")


def _object(value: Any, what: str) -> dict:
    _need(isinstance(value, dict), f"{what} is not an object")
    return value


def _tlog_entries(value: Any) -> list:
    _need(isinstance(value, list), "verificationMaterial.tlogEntries is not a list")
    for i, entry in enumerate(value):
        what = f"tlogEntries[{i}]"
        _strings(_object(entry, what), ("logIndex", "integratedTime", "canonicalizedBody"), what)
        for sub, fields in (("logId", ("keyId",)), ("kindVersion", ("kind", "version")),
                            ("inclusionPromise", ("signedEntryTimestamp",)),
                            ("inclusionProof", ("logIndex", "rootHash", "treeSize"))):
            if sub in entry:
                _strings(_object(entry[sub], f"{what}.{sub}"), fields, f"{what}.{sub}")
        proof = entry.get("inclusionProof", {})
        hashes = proof.get("hashes", [])
        _need(isinstance(hashes, list) and all(isinstance(h, str) for h in hashes),
              f"{what}.inclusionProof.hashes is not a list of strings")
        if "checkpoint" in proof:
            _strings(_object(proof["checkpoint"], f"{what}.checkpoint"), ("envelope",), f"{what}.checkpoint")
    return value


def _verification_material(vm: Any) -> tuple[str, dict]:
    """(method, the key material) of verificationMaterial, checked as the bundle schema says."""
    vm = _object(vm, "verificationMaterial")
    present = [k for k in _KEY_MATERIAL if k in vm]
    _need(present, "verificationMaterial names no key (publicKey, x509CertificateChain or certificate)")
    _need(len(present) == 1, f"verificationMaterial names more than one key ({', '.join(present)})")
    if "tlogEntries" in vm:
        _tlog_entries(vm["tlogEntries"])
    if "timestampVerificationData" in vm:
        stamps = _object(vm["timestampVerificationData"], "timestampVerificationData").get("rfc3161Timestamps", [])
        _need(isinstance(stamps, list), "timestampVerificationData.rfc3161Timestamps is not a list")
        for s in stamps:
            _strings(_object(s, "rfc3161Timestamps[]"), ("signedTimestamp",), "rfc3161Timestamps[]")
    material = _object(vm[present[0]], present[0])
    if present[0] == "publicKey":
        _need("hint" in material or "rawBytes" in material, "publicKey has neither hint nor rawBytes")
        _strings(material, ("hint", "rawBytes"), "publicKey")
        return "key", material
    if present[0] == "x509CertificateChain":
        certs = material.get("certificates")
        _need(isinstance(certs, list) and certs, "x509CertificateChain.certificates is not a non-empty list")
        for c in certs:
            _need(isinstance(c, dict) and isinstance(c.get("rawBytes"), str) and c["rawBytes"],
                  "a certificate in x509CertificateChain has no rawBytes")
        return "certificate", material
    _need(isinstance(material.get("rawBytes"), str) and material["rawBytes"], "certificate has no rawBytes")
    _need(vm.get("tlogEntries"), "a Sigstore (certificate) bundle without tlogEntries")
    return "sigstore", material


def _statement(payload: bytes) -> tuple[str, dict[str, str], tuple[str, ...]]:
    """(subject name, resources, ignore_paths) of the DSSE payload, checked as the statement and predicate
    schemas say; the subject digest must be the resources' root digest (as the reference verifier requires)."""
    try:
        st = json.loads(payload)
    except (ValueError, RecursionError):
        raise _Malformed("its payload is not JSON") from None
    _need(isinstance(st, dict) and set(st) == _STATEMENT_KEYS,
          "its statement does not have exactly _type, subject, predicateType, predicate")
    _need(st["_type"] == STATEMENT_TYPE, f"statement _type is not {STATEMENT_TYPE}")
    _need(st["predicateType"] == PREDICATE_TYPE,
          f"predicateType {str(st['predicateType'])[:80]!r} is not {PREDICATE_TYPE}")
    subjects = st["subject"]
    _need(isinstance(subjects, list) and len(subjects) == 1, "statement subject is not a list of one")
    subject = _object(subjects[0], "subject")
    _need(isinstance(subject.get("name"), str) and subject["name"], "subject has no name")
    digests = _object(subject.get("digest"), "subject.digest")
    _need(digests and all(isinstance(v, str) and _HEX.fullmatch(v) for v in digests.values()),
          "subject.digest is not a set of hex digests")
    predicate = _object(st["predicate"], "predicate")
    _need(set(predicate) == {"resources", "serialization"}, "predicate does not have exactly resources, serialization")
    ser = _object(predicate["serialization"], "serialization")
    _need(set(ser) <= _SERIALIZATION_KEYS, f"serialization has unknown fields {sorted(set(ser) - _SERIALIZATION_KEYS)}")
    _need(ser.get("method") in ("files", "shards"), "serialization.method is not files or shards")
    _need(ser.get("hash_type") in HASH_TYPES, f"serialization.hash_type is not one of {', '.join(HASH_TYPES)}")
    _need(isinstance(ser.get("allow_symlinks"), bool), "serialization.allow_symlinks is not a boolean")
    if ser["method"] == "shards" or "shard_size" in ser:
        size = ser.get("shard_size")
        _need(ser["method"] == "shards" and isinstance(size, int) and not isinstance(size, bool) and size > 0,
              "serialization.shard_size must be a positive integer, with the shards method only")
    ignored = ser.get("ignore_paths", [])
    _need(isinstance(ignored, list) and all(isinstance(p, str) and p for p in ignored),
          "serialization.ignore_paths is not a list of paths")
    resources = predicate["resources"]
    _need(isinstance(resources, list) and resources, "predicate.resources is not a non-empty list")
    files: dict[str, str] = {}
    for r in resources:
        _need(isinstance(r, dict) and isinstance(r.get("name"), str) and r["name"], "a resource has no name")
        _need(isinstance(r.get("digest"), str) and _HEX.fullmatch(r["digest"]), f"resource {r['name'][:80]!r}: no hex digest")
        _need(r.get("algorithm") in HASH_TYPES, f"resource {r['name'][:80]!r}: unknown algorithm")
        _need(r["name"] not in files, f"resource {r['name'][:80]!r} is listed twice")
        files[r["name"]] = r["digest"]
    if ser["method"] == "shards":  # a one-line refusal the spec asks of verifiers without shards
        raise _Unsupported("uses the shards serialization: not supported, files only")
    if ser["hash_type"] != "sha256" or any(r["algorithm"] != "sha256" for r in resources):
        raise _Unsupported(f"hashes files with {ser['hash_type']}: not supported, sha256 only")
    for name, digest in files.items():
        _need(canonical_name(name), f"resource {name[:80]!r} is not a relative path")
        _need(_SHA256.fullmatch(digest), f"resource {name[:80]!r}: its digest is not a sha256")
    _need(digests.get("sha256") == root_digest(list(files.values())),
          "subject digest is not the root digest of its resources")
    return subject["name"], files, tuple(ignored)


def parse(raw: bytes, where: str) -> Bundle:
    """Every structural check of an OMS bundle (spec 8.1 and 8.3, its four schemas), before any key is used;
    one IntegrityError line naming `where` for anything else."""
    try:
        _need(len(raw) <= MAX_BUNDLE_BYTES, f"it is larger than {MAX_BUNDLE_BYTES} bytes")
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            raise _Malformed("it is not JSON") from None
        _need(isinstance(doc, dict), "it is not a JSON object")
        _need({"mediaType", "verificationMaterial", "dsseEnvelope"} <= set(doc),
              "it lacks " + ", ".join(k for k in ("mediaType", "verificationMaterial", "dsseEnvelope") if k not in doc))
        _need(set(doc) == {"mediaType", "verificationMaterial", "dsseEnvelope"},
              f"unknown top-level fields {sorted(set(doc) - {'mediaType', 'verificationMaterial', 'dsseEnvelope'})}")
        _need(isinstance(doc["mediaType"], str) and doc["mediaType"] in KNOWN_MEDIA_TYPES,
              f"mediaType {str(doc['mediaType'])[:80]!r} is not a Sigstore bundle's")
        method, material = _verification_material(doc["verificationMaterial"])
        env = _object(doc["dsseEnvelope"], "dsseEnvelope")
        _need(set(env) == _ENVELOPE_KEYS, "dsseEnvelope does not have exactly payload, payloadType, signatures")
        _need(env["payloadType"] == PAYLOAD_TYPE, f"dsseEnvelope.payloadType is not {PAYLOAD_TYPE}")
        payload = _b64(env["payload"], "dsseEnvelope.payload")
        sigs = env["signatures"]
        _need(isinstance(sigs, list) and sigs, "dsseEnvelope.signatures is not a non-empty list")
        for s in sigs:
            _need(isinstance(s, dict) and set(s) <= {"sig", "keyid"}, "a DSSE signature has fields besides sig, keyid")
            _need(s.get("keyid") is None or isinstance(s["keyid"], str), "a DSSE signature's keyid is not a string")
        signatures = tuple(_b64(s.get("sig"), "a DSSE signature's sig") for s in sigs)
        if method != "key":
            raise _Unsupported(f"uses the {method} method: not supported, key method only")
        name, files, ignored = _statement(payload)
        public_pem = None if material.get("hint") else _b64(material.get("rawBytes"), "publicKey.rawBytes")
    except _Malformed as e:
        raise IntegrityError(f"{where}: its OMS signature is malformed ({e})") from None
    except _Unsupported as e:
        raise IntegrityError(f"{where}: its OMS signature {e}") from None
    return Bundle(material.get("hint") or None, public_pem, payload, signatures, name, files, ignored)


def _signer_key(b: Bundle, keys: dict[str, Any], where: str) -> tuple[str, Any]:
    """(key id, trusted public key) the bundle names; one line when it names none of `keys`."""
    hint = b.hint
    if hint is None:  # a bundle from before hints carries the key itself: trusted only if its id is trusted
        from cryptography.hazmat.primitives import serialization

        try:
            carried = (serialization.load_pem_public_key(b.public_pem) if b.public_pem.lstrip().startswith(b"-----")
                       else serialization.load_der_public_key(b.public_pem))
        except (ValueError, TypeError):
            raise IntegrityError(f"{where}: its OMS signature is malformed (publicKey.rawBytes is not a public "
                                 f"key)") from None
        if curve_of(carried) is None:
            raise IntegrityError(f"{where}: its OMS signature names a key OMS does not sign with (ECDSA "
                                 f"P-256/384/521 only)")
        hint = key_hint(carried)
    key = keys.get(hint)
    if key is None or curve_of(key) is None:
        raise IntegrityError(f"{where} is signed by key {hint[:16]}, which is not among the trusted keys")
    return hint, key


def verify(raw: bytes, keys: dict[str, Any], where: str) -> tuple[str, Bundle]:
    """(key id, bundle) when a key of `keys` (OMS hint -> ECDSA public key) signed the bundle: structure first,
    then the signature over the statement's exact bytes. The caller compares `bundle.resources` with the files
    it has: a valid signature says who signed which files, not that these are the files."""
    from cryptography.exceptions import InvalidSignature

    bundle = parse(raw, where)
    kid, key = _signer_key(bundle, keys, where)
    signed = pae(PAYLOAD_TYPE, bundle.payload)
    for sig in bundle.signatures:
        try:
            key.verify(sig, signed, _ecdsa(key))
            return kid, bundle
        except InvalidSignature:
            continue
    raise IntegrityError(f"{where}: its signature does not match its bytes (tampered with)")


def is_bundle(data: bytes) -> bool:
    """Whether `data` is a Sigstore bundle by its media type (an OMS signature, not the legacy Ed25519 document);
    what it holds is checked by parse/verify."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("mediaType") in KNOWN_MEDIA_TYPES


__all__ = ["BUNDLE_MEDIA_TYPE", "is_bundle", "Bundle", "DEFAULT_IGNORED", "MANIFEST_FILE", "PREDICATE_TYPE", "SIGNATURE_FILE",
           "curve_of", "key_hint", "pae", "parse", "root_digest", "sign", "verify"]
