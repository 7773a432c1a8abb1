"""Optional signatures on manifests, so that tampering with a store, not only damage, is caught.

The sha256 a ref records catches a damaged manifest, and each blob's sha256 in the manifest a damaged blob;
whoever can write the store can rewrite all three consistently. With a signing key, the publisher also
writes `signatures/<org--name>/<recipe>/<build-id>.json.sig` (before the refs: the commit point): an
OpenSSF Model Signing (OMS v1.0) bundle (oms.py) over the build's files, path -> sha256 as the manifest lists
them, plus `hive-aot.manifest.json` (the manifest's exact bytes, so the serving description is covered too).
A puller given the public key(s) refuses a manifest without a valid signature from one of them, and a pulled
directory verifies with the reference tool: `model_signing verify key --signature DIR/model.sig
--public_key key.pub DIR`.

Keys are PEM files. OMS signs with ECDSA P-256, P-384 or P-521 (`openssl ecparam -genkey -name prime256v1
-noout -out key.pem`; `openssl ec -in key.pem -pubout -out key.pub`). Stores signed before OMS hold an Ed25519
signature over the manifest's bytes (`{"algorithm": "ed25519", ...}`): they still pull, verified by the
Ed25519 public key among the trusted keys; an Ed25519 *signing* key is refused, so every new signature is OMS.
Key paths come from the environment; no key material is ever logged or stored, only a key id (an ECDSA key's
OMS hint, the sha256 of its public PEM; an Ed25519 key's first 16 hex digits of the sha256 of its raw bytes).

    HIVE_AOT_SIGNING_KEY=/secrets/hive-aot.pem      publish: sign every manifest written (ECDSA)
    HIVE_AOT_TRUSTED_KEYS=/etc/hive-aot/a.pub,b.pub pull: require a signature by one of these
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from ..core import settings
from ..core.errors import ConfigError, IntegrityError
from ..core.paths import read_small_file
from . import oms

SIGNING_KEY_ENV, TRUSTED_KEYS_ENV = settings.SIGNING_KEY.name, settings.TRUSTED_KEYS.name
LEGACY_ALGORITHM = "ed25519"
MAX_KEY_FILE_BYTES = 64 * 1024  # a PEM P-521 key is ~400 bytes; /dev/zero as a key file must not fill memory
# pulled_dir.MARKER, the pull marker a pulled directory holds beside the signed files (not imported: pulled_dir
# sits above the manifest layer this module shares); unsigned, so a verifier of the directory ignores it.
PULL_MARKER = "hive-aot.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")
MAKE_ECDSA_KEY = ("openssl ecparam -genkey -name prime256v1 -noout -out key.pem; "
                  "openssl ec -in key.pem -pubout -out key.pub")


def signature_key(manifest_key: str) -> str:
    """manifests/<slug>/<recipe>/<build>.json -> signatures/<slug>/<recipe>/<build>.json.sig"""
    if not manifest_key.startswith("manifests/"):
        raise IntegrityError(f"{manifest_key} is not a manifest key")
    return "signatures/" + manifest_key[len("manifests/"):] + ".sig"


def _is_ed25519(key) -> bool:
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return isinstance(key, (ed25519.Ed25519PrivateKey, ed25519.Ed25519PublicKey))


def key_id(public) -> str:
    """An ECDSA key's OMS hint; an Ed25519 key's legacy id (what signatures before OMS name)."""
    from cryptography.hazmat.primitives import serialization

    if not _is_ed25519(public):
        return oms.key_hint(public)
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _read_pem(path: str, what: str, private: bool):
    from cryptography.hazmat.primitives import serialization

    try:
        data = read_small_file(Path(path), MAX_KEY_FILE_BYTES)
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot be read ({e.strerror or type(e).__name__})") from None
    except ValueError as e:
        raise ConfigError(f"{what} {path}: {e}") from None
    try:
        key = (serialization.load_pem_private_key(data, password=None) if private
               else serialization.load_pem_public_key(data))
    except (ValueError, TypeError) as e:  # never echo the file's content
        raise ConfigError(f"{what} {path} is not a PEM {'private' if private else 'public'} key "
                          f"({type(e).__name__})") from None
    if oms.curve_of(key) is None and not (_is_ed25519(key) and not private):
        if _is_ed25519(key):
            raise ConfigError(f"{what} {path} is an Ed25519 key, and OpenSSF Model Signing signs with ECDSA: make "
                              f"one ({MAKE_ECDSA_KEY}) and trust key.pub; stores signed with the Ed25519 key "
                              f"still pull with its public key among the trusted keys")
        raise ConfigError(f"{what} {path} is not an ECDSA P-256, P-384 or P-521 key"
                          + ("" if private else " (nor a legacy Ed25519 public key)"))
    return key


def signing_key():
    """The publisher's ECDSA private key, or None when signing is not configured."""
    path = settings.SIGNING_KEY.get()
    return _read_pem(path, SIGNING_KEY_ENV, private=True) if path else None


def trusted_keys(paths: str | None = None) -> dict[str, Any]:
    """key id -> public key, from `paths` (comma-separated) or $HIVE_AOT_TRUSTED_KEYS; empty: not verifying.
    ECDSA keys verify OMS bundles; Ed25519 keys only the signatures written before OMS.

    Fails closed: a value that is given but names no key file ("", ",", spaces: a templating slip, or
    `--trusted-keys ""` meant to override a set variable) is refused, never read as "verify nothing". Only
    an absent flag with the variable unset or empty turns verification off."""
    if paths is None:
        spec, source = settings.TRUSTED_KEYS.raw() or "", TRUSTED_KEYS_ENV
        if spec == "":
            return {}
    else:
        spec, source = paths, "--trusted-keys"
    names = [p.strip() for p in spec.split(",") if p.strip()]
    if not names:
        raise ConfigError(f"{source} is set to {spec[:40]!r}, which names no public key file: refusing to pull "
                          f"unverified (unset it to pull without signatures)")
    keys = [_read_pem(name, source, private=False) for name in names]
    return {key_id(k): k for k in keys}


def signed_files(manifest_bytes: bytes, where: str = "manifest") -> dict[str, str]:
    """What an OMS bundle for this manifest signs: each file it lists (path -> sha256) and MANIFEST_FILE."""
    try:
        doc = json.loads(manifest_bytes)
        files = {f["path"]: f["sha256"] for f in doc["files"]}
        if not all(isinstance(p, str) and isinstance(d, str) and _SHA256.fullmatch(d) for p, d in files.items()):
            raise ValueError("a file without a path and sha256")
    except (ValueError, KeyError, TypeError, RecursionError):
        raise IntegrityError(f"{where}: not a manifest with files (path, sha256)") from None
    reserved = {oms.MANIFEST_FILE, oms.SIGNATURE_FILE, PULL_MARKER} & set(files)
    if reserved:
        raise IntegrityError(f"{where}: file {sorted(reserved)[0]} has a name a pulled directory reserves for "
                             f"hive-aot; it cannot be signed")
    return {**files, oms.MANIFEST_FILE: hashlib.sha256(manifest_bytes).hexdigest()}


def bundle_for(manifest_bytes: bytes, private_key) -> bytes:
    """The OMS bundle over the manifest's files and its own bytes (MANIFEST_FILE). Its ignore_paths name what a
    pulled directory holds unsigned (the pull marker, the signature file) and the spec's default exclusions
    that no signed file falls under, so `model_signing verify key` accepts the directory exactly as pulled."""
    files = signed_files(manifest_bytes)
    try:
        name = json.loads(manifest_bytes)["model"]["id"]
    except (KeyError, TypeError):
        name = None
    ignore = [PULL_MARKER, oms.SIGNATURE_FILE] + [
        p for p in oms.DEFAULT_IGNORED if not any(f == p or f.startswith(p + "/") for f in files)]
    return oms.sign(files, private_key, name=name if isinstance(name, str) and name else "model", ignore_paths=ignore)


def verify_bundle(bundle: bytes, keys: dict[str, Any], expected: dict[str, str], where: str) -> str:
    """The key id that signed `bundle`, when it is an OMS bundle by a trusted key over exactly `expected`
    (path -> sha256 hex); one IntegrityError line otherwise."""
    kid, signed = oms.verify(bundle, keys, where)
    files = signed.resources
    changed = sorted(p for p in expected.keys() & files.keys() if expected[p] != files[p])
    why = (f"{changed[0]} has another sha256" if changed
           else next((f"{p} is not signed" for p in sorted(expected.keys() - files.keys())), None)
           or next((f"{p} is signed but absent" for p in sorted(files.keys() - expected.keys())), None))
    if why:
        raise IntegrityError(f"{where}: its signature is for other files (tampered with): {why}")
    return kid


def write_signature(store, manifest_key: str, manifest_bytes: bytes) -> bool:
    """Sign the manifest into the store (an OMS bundle) when a signing key is configured; True when it did."""
    private = signing_key()
    if private is None:
        return False
    store.write_bytes(signature_key(manifest_key), bundle_for(manifest_bytes, private))
    return True


def verify(store, manifest_key: str, manifest_bytes: bytes, keys: dict[str, Any]) -> str:
    """The key id that signed the manifest (an OMS bundle, or a signature from before OMS); one IntegrityError
    line when no trusted key did."""
    where = f"{store.uri}: {manifest_key}"
    return verify_signature(store.read_bytes(signature_key(manifest_key)), manifest_bytes, keys, where)


def verify_signature(raw: bytes | None, manifest_bytes: bytes, keys: dict[str, Any], where: str) -> str:
    """`verify` of signature bytes already read (pull reads them once: what it verifies is what it keeps)."""
    if raw is None:
        raise IntegrityError(f"{where} is not signed, and trusted keys are required ({TRUSTED_KEYS_ENV})")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict) and "mediaType" in doc:
        return verify_bundle(raw, keys, signed_files(manifest_bytes, where), where)
    return _verify_legacy(doc, manifest_bytes, keys, where)


def _verify_legacy(doc: Any, manifest_bytes: bytes, keys: dict[str, Any], where: str) -> str:
    """A signature from before OMS: Ed25519 over the manifest's exact bytes, verified by Ed25519 keys only."""
    from cryptography.exceptions import InvalidSignature

    try:
        kid, sig = doc["key_id"], base64.b64decode(doc["signature"], validate=True)
        if doc.get("algorithm") != LEGACY_ALGORITHM or not isinstance(kid, str):  # a list or object id: not a key's
            raise ValueError(doc.get("algorithm"))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise IntegrityError(f"{where}: its signature file is malformed") from None
    key = keys.get(kid)
    if key is None or not _is_ed25519(key):
        raise IntegrityError(f"{where} is signed by key {kid[:16]} (an Ed25519 signature from before OMS), which "
                             f"is not among the trusted keys")
    try:
        key.verify(sig, manifest_bytes)
    except InvalidSignature:
        raise IntegrityError(f"{where}: its signature does not match its bytes (tampered with)") from None
    return kid


__all__ = ["LEGACY_ALGORITHM", "PULL_MARKER", "SIGNING_KEY_ENV", "TRUSTED_KEYS_ENV", "bundle_for", "key_id",
           "signature_key", "signed_files", "signing_key", "trusted_keys", "verify", "verify_bundle", "verify_signature",
           "write_signature"]
