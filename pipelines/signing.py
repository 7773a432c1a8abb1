"""Optional Ed25519 signatures on manifests, so that tampering with a store, not only damage, is caught.

The sha256 a ref records catches a damaged manifest, and each blob's sha256 in the manifest a damaged blob;
whoever can write the store can rewrite all three consistently. With a signing key, the publisher also
writes `signatures/<org--name>/<recipe>/<build-id>.json.sig` (before the refs: the commit point) holding an
Ed25519 signature over the manifest's exact bytes; a puller given the public key(s) refuses a manifest
without a valid signature from one of them. Keys are PEM files (`openssl genpkey -algorithm ed25519 -out
key.pem`; `openssl pkey -in key.pem -pubout -out key.pub`); their paths come from the environment, and
no key material is ever logged or stored, only a key id (the first 16 hex digits of the sha256 of the raw
public key).

    HIVE_AOT_SIGNING_KEY=/secrets/hive-aot.pem      publish: sign every manifest written
    HIVE_AOT_TRUSTED_KEYS=/etc/hive-aot/a.pub,b.pub pull: require a signature by one of these
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

from .errors import ConfigError, IntegrityError
from .paths import read_small_file
from . import settings

SIGNING_KEY_ENV, TRUSTED_KEYS_ENV = settings.SIGNING_KEY.name, settings.TRUSTED_KEYS.name
ALGORITHM = "ed25519"
MAX_KEY_FILE_BYTES = 64 * 1024  # a PEM Ed25519 key is ~120 bytes; /dev/zero as a key file must not fill memory


def signature_key(manifest_key: str) -> str:
    """manifests/<slug>/<recipe>/<build>.json -> signatures/<slug>/<recipe>/<build>.json.sig"""
    if not manifest_key.startswith("manifests/"):
        raise IntegrityError(f"{manifest_key} is not a manifest key")
    return "signatures/" + manifest_key[len("manifests/"):] + ".sig"


def _raw_public(public) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public) -> str:
    return hashlib.sha256(_raw_public(public)).hexdigest()[:16]


def _read_pem(path: str, what: str, private: bool):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

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
    wanted = ed25519.Ed25519PrivateKey if private else ed25519.Ed25519PublicKey
    if not isinstance(key, wanted):
        raise ConfigError(f"{what} {path} is not an Ed25519 key")
    return key


def signing_key():
    """The publisher's private key, or None when signing is not configured."""
    path = settings.SIGNING_KEY.get()
    return _read_pem(path, SIGNING_KEY_ENV, private=True) if path else None


def trusted_keys(paths: str | None = None) -> dict[str, Any]:
    """key id -> public key, from `paths` (comma-separated) or $HIVE_AOT_TRUSTED_KEYS; empty: not verifying.

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


def sign(manifest_bytes: bytes, private) -> bytes:
    return json.dumps({"algorithm": ALGORITHM, "key_id": key_id(private.public_key()),
                       "signature": base64.b64encode(private.sign(manifest_bytes)).decode()}, indent=1).encode()


def write_signature(store, manifest_key: str, manifest_bytes: bytes) -> bool:
    """Sign the manifest into the store when a signing key is configured; True when it did."""
    private = signing_key()
    if private is None:
        return False
    store.write_bytes(signature_key(manifest_key), sign(manifest_bytes, private))
    return True


def verify(store, manifest_key: str, manifest_bytes: bytes, keys: dict[str, Any]) -> str:
    """The key id that signed the manifest; one IntegrityError line when no trusted key did."""
    from cryptography.exceptions import InvalidSignature

    where = f"{store.uri}: {manifest_key}"
    raw = store.read_bytes(signature_key(manifest_key))
    if raw is None:
        raise IntegrityError(f"{where} is not signed, and trusted keys are required ({TRUSTED_KEYS_ENV})")
    try:
        doc = json.loads(raw)
        kid, sig = doc["key_id"], base64.b64decode(doc["signature"], validate=True)
        if doc.get("algorithm") != ALGORITHM or not isinstance(kid, str):  # a list or object id: not a key's
            raise ValueError(doc.get("algorithm"))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise IntegrityError(f"{where}: its signature file is malformed") from None
    key = keys.get(kid)
    if key is None:
        raise IntegrityError(f"{where} is signed by key {str(kid)[:16]}, which is not among the trusted keys")
    try:
        key.verify(sig, manifest_bytes)
    except InvalidSignature:
        raise IntegrityError(f"{where}: its signature does not match its bytes (tampered with)") from None
    return kid


__all__ = ["SIGNING_KEY_ENV", "TRUSTED_KEYS_ENV", "sign", "signature_key", "trusted_keys", "verify",
           "write_signature"]
