"""OMS signature bundles as OCI 1.1 referrers: the form every registry-side tool (oras discover, cosign, notation)
looks for, and the one that travels with a manifest when a repository is mirrored.

A bundle is attached to a manifest as an artifact of its own: artifactType and its one layer
`application/vnd.dev.sigstore.bundle.v0.3+json` (the bundle's bytes), the empty config, and `subject` the signed
manifest's descriptor. It carries no time: attaching the same bundle to the same manifest twice gives the same
digest, so a retried publish or a second copy adds nothing.

Where the registry keeps referrers itself (it answers `OCI-Subject` to the push, and serves
`/v2/<name>/referrers/<digest>`), that is all. Where it does not (Distribution 2.x), the client keeps the
referrers tag schema of the distribution spec: tag `sha256-<hex of the subject>` names an OCI index listing the
referrers. That tag is read-modify-written: two publishers attaching to one manifest at the same instant may
lose one entry (each bundle stays pushed by digest, and the next attach of it lists it again).

What a reader takes from a registry is untrusted: a referrer whose `subject` is another manifest, a layer that is
not the bundle's type or over the size bound, is refused in one line, never silently skipped.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..core.errors import IntegrityError, StoreError
from .oci_client import INDEX_TYPE, MANIFEST_TYPE
from .oci_modelpack import EMPTY, EMPTY_BYTES

BUNDLE_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
MAX_BUNDLE_BYTES = 64 << 20  # a bundle lists one resource per file: ~200 bytes each, far below this


def _artifact_type(raw: bytes) -> str | None:
    try:
        return json.loads(raw).get("artifactType")
    except (ValueError, AttributeError, RecursionError):
        return None


def referrers_tag(digest: str) -> str:
    """The referrers tag schema's tag for a subject digest (`sha256:<hex>` -> `sha256-<hex>`)."""
    return digest.replace(":", "-", 1)


def _serialize(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _index_entries(raw: bytes | None, where: str) -> list[dict[str, Any]]:
    if raw is None:
        return []
    try:
        doc = json.loads(raw)
        entries = doc.get("manifests") or []
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise TypeError
    except (ValueError, TypeError, AttributeError, RecursionError):
        raise IntegrityError(f"{where}: the referrers index is not an OCI index") from None
    return entries


def referrers(registry, repo: str, digest: str) -> list[dict[str, Any]]:
    """The descriptors of the manifests that name `digest` as their subject: the registry's referrers API, else
    the referrers tag."""
    api = registry.referrers(repo, digest) if hasattr(registry, "referrers") else None
    if api is not None:
        return _index_entries(api, f"{repo}@{digest[7:19]} referrers")
    got = registry.get_manifest(repo, referrers_tag(digest), accept=INDEX_TYPE)
    return _index_entries(got[0] if got else None, f"{repo}:{referrers_tag(digest)}")


def find_bundle(registry, repo: str, manifest_digest: str) -> bytes | None:
    """The OMS bundle attached to manifest `manifest_digest` of `repo`; None when none is. A referrer whose subject
    is another manifest, or whose layer is not a bundle of at most MAX_BUNDLE_BYTES, is one IntegrityError line."""
    where = f"{repo}@{manifest_digest[7:19]}"
    for entry in referrers(registry, repo, manifest_digest):
        # an entry without artifactType is looked at too: skopeo 1.9 drops the field when it copies the index
        if entry.get("artifactType") not in (BUNDLE_TYPE, None) or not isinstance(entry.get("digest"), str):
            continue
        got = registry.get_manifest(repo, entry["digest"])
        if got is None:
            continue  # listed, then deleted: the next entry may still be there
        raw = got[0]
        if "sha256:" + hashlib.sha256(raw).hexdigest() != entry["digest"]:
            raise IntegrityError(f"{where}: the registry handed back other bytes for its signature {entry['digest'][7:19]}")
        try:
            manifest = json.loads(raw)
            if manifest.get("artifactType") != BUNDLE_TYPE:
                continue  # another tool's referrer (an SBOM, a cosign signature): not ours to read
            subject = (manifest.get("subject") or {}).get("digest")
            layers = manifest.get("layers") or []
            layer = layers[0] if len(layers) == 1 and isinstance(layers[0], dict) else {}
            size, digest = int(layer.get("size", -1)), layer.get("digest")
        except (ValueError, TypeError, AttributeError, RecursionError):
            raise IntegrityError(f"{where}: its signature {entry['digest'][7:19]} is not an OCI manifest") from None
        if subject != manifest_digest:
            raise IntegrityError(f"{where}: a signature listed for it has subject {str(subject)[:19]}, another "
                                 "manifest (moved or replayed): refusing it")
        if layer.get("mediaType") != BUNDLE_TYPE or not isinstance(digest, str) or not 0 < size <= MAX_BUNDLE_BYTES:
            raise IntegrityError(f"{where}: its signature {entry['digest'][7:19]} holds no OMS bundle of at most "
                                 f"{MAX_BUNDLE_BYTES >> 20} MiB")
        data = b"".join(registry.blob_stream(repo, digest, at_most=size))
        if len(data) != size or "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise IntegrityError(f"{where}: its signature bundle {digest[7:19]} does not match its digest")
        return data
    return None


def bundle_manifest(subject: dict[str, Any], bundle: bytes) -> bytes:
    """The referrer artifact holding `bundle` for `subject` (deterministic bytes)."""
    layer = {"mediaType": BUNDLE_TYPE, "digest": "sha256:" + hashlib.sha256(bundle).hexdigest(), "size": len(bundle)}
    return _serialize({"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "artifactType": BUNDLE_TYPE, "config": EMPTY,
                       "layers": [layer], "subject": {k: subject[k] for k in ("mediaType", "digest", "size")}})


def attach_bundle(registry, repo: str, subject: dict[str, Any], bundle: bytes) -> str:
    """Attach `bundle` to the manifest `subject` describes ({mediaType, digest, size}) in `repo`; the referrer's
    digest. Idempotent."""
    if len(bundle) > MAX_BUNDLE_BYTES:
        raise StoreError(f"{repo}: an OMS bundle of {len(bundle)} bytes is over the {MAX_BUNDLE_BYTES >> 20} MiB bound")
    digest = "sha256:" + hashlib.sha256(bundle).hexdigest()
    if registry.blob_size(repo, digest) != len(bundle):
        registry.upload_blob(repo, digest, len(bundle), bundle)
    if registry.blob_size(repo, EMPTY["digest"]) != EMPTY["size"]:
        registry.upload_blob(repo, EMPTY["digest"], EMPTY["size"], EMPTY_BYTES)
    body = bundle_manifest(subject, bundle)
    ref_digest = "sha256:" + hashlib.sha256(body).hexdigest()
    if registry.put_manifest(repo, ref_digest, body):
        return ref_digest  # the registry lists it among the subject's referrers itself
    tag = referrers_tag(subject["digest"])
    got = registry.get_manifest(repo, tag, accept=INDEX_TYPE)
    entries = _index_entries(got[0] if got else None, f"{repo}:{tag}")
    if not any(e.get("digest") == ref_digest for e in entries):
        entries.append({"mediaType": MANIFEST_TYPE, "digest": ref_digest, "size": len(body),
                        "artifactType": BUNDLE_TYPE})
        index = _serialize({"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": entries})
        registry.put_manifest(repo, tag, index, media_type=INDEX_TYPE)
    return ref_digest


def detach_all(registry, repo: str, digest: str) -> None:
    """Delete the bundles attached to manifest `digest` and its referrers tag (the manifest is being deleted)."""
    for entry in referrers(registry, repo, digest):
        if entry.get("artifactType") in (BUNDLE_TYPE, None) and isinstance(entry.get("digest"), str):
            got = registry.get_manifest(repo, entry["digest"])
            if got is not None and _artifact_type(got[0]) == BUNDLE_TYPE:
                registry.delete_manifest(repo, entry["digest"])
    got = registry.get_manifest(repo, referrers_tag(digest), accept=INDEX_TYPE)
    if got is not None and got[1]:
        registry.delete_manifest(repo, got[1])


__all__ = ["BUNDLE_TYPE", "attach_bundle", "bundle_manifest", "detach_all", "find_bundle", "referrers",
           "referrers_tag"]
