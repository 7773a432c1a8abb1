"""Reading, placing and committing what a store holds, shared by the engine, the hardware steps and pull: a
manifest checked against the key it was asked for, a build's files placed and verified, a manifest committed
(manifest, signature, refs: one sequence for every publish) or its interrupted commit repaired, the runtime
profiles' copy."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from pydantic import BaseModel

from ..core.errors import IntegrityError, StoreError
from ..core.hashing import sha256_file
from .base import Store
from .layout import PROFILES_KEY, blob_key, check_binding, manifest_key, publish_tags, ref_document, ref_key
from .manifest import FileEntry, Manifest
from .signing import signature_key, signing_key, write_signature


def load_manifest(store: Store, key: str, expected_sha: str | None, model_id: str) -> Manifest:
    return read_manifest(store, key, expected_sha, model_id)[1]


def read_manifest(store: Store, key: str, expected_sha: str | None, model_id: str,
                  consequence: str = "") -> tuple[bytes, Manifest]:
    """(exact bytes, parsed) of the manifest under `key`, checked against the sha256 its ref records and against
    the key (model, recipe, build id); `consequence` ends the mismatch line (" (nothing copied)")."""
    raw = store.read_bytes(key)
    if raw is None:
        raise StoreError(f"{store.uri}: manifest {key} is missing")
    if expected_sha and hashlib.sha256(raw).hexdigest() != expected_sha:
        raise IntegrityError(f"{store.uri}: manifest {key} does not match the sha256 its ref records{consequence}")
    m = Manifest.parse(raw, f"{store.uri}: manifest {key}")
    check_binding(m, key, model_id, store.uri)
    return raw, m


def materialize_blobs(store: Store, files: list[FileEntry], dest: Path) -> None:
    """Place a build's files under dest (hard link or copy), verifying each sha256."""
    for f in files:
        target = dest / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        local = store.local_path(blob_key(f.sha256))
        if local is not None:
            try:
                target.hardlink_to(local)
            except OSError:
                shutil.copyfile(local, target)
        else:
            store.download_file(blob_key(f.sha256), target)
        if target.stat().st_size != f.size or sha256_file(target) != f.sha256:
            raise StoreError(f"{store.uri}: blob for {f.path} does not match its manifest digest")


def publish_profiles(store: Store, profiles: Iterable[BaseModel]) -> None:
    """Keep the store's copy of the runtime profiles current, so pull works without registry.yaml."""
    doc = {"runtime_profiles": [prof.model_dump(mode="json") for prof in profiles]}
    body = json.dumps(doc, sort_keys=True, indent=1).encode()
    if store.read_bytes(PROFILES_KEY) != body:
        store.write_bytes(PROFILES_KEY, body)


def commit_manifest(store: Store, manifest: Manifest, *, pending: bool,
                    before_refs: Callable[[str], None] | None = None) -> str:
    """Publish a manifest whose blobs are in the store: its bytes, then its signature (when a signing key is
    configured), then the `<commit>` and `latest` refs (`bundle-...` for a bundle that waits for its hardware
    step). The `latest` write is the commit point: no ref ever names a manifest that is not there, and a
    signature is there before anything names the manifest. `before_refs(key)` runs once the manifest is
    written (a last check that may take it back and fail). Returns the manifest's key."""
    key = manifest_key(manifest.model.id, manifest.recipe.id, manifest.build_id)
    body = manifest.to_bytes()
    store.write_bytes(key, body)
    if before_refs is not None:
        before_refs(key)
    write_signature(store, key, body)
    ref = ref_document(manifest.model.id, manifest.recipe.id, manifest)
    for tag in publish_tags(manifest.model.commit, pending):
        store.write_bytes(ref_key(manifest.model.id, manifest.recipe.id, tag), ref)
    return key


def repair_commit(store: Store, manifest: Manifest, *, pending: bool) -> None:
    """Finish a commit that was interrupted after the manifest was written: its signature (with a signing key,
    also for a manifest published before the key existed) and any missing ref; an existing tag never moves."""
    key = manifest_key(manifest.model.id, manifest.recipe.id, manifest.build_id)
    if signing_key() is not None and not store.exists(signature_key(key)):
        write_signature(store, key, store.read_bytes(key) or manifest.to_bytes())
    for tag in publish_tags(manifest.model.commit, pending):
        ref = ref_key(manifest.model.id, manifest.recipe.id, tag)
        if not store.exists(ref):
            store.write_bytes(ref, ref_document(manifest.model.id, manifest.recipe.id, manifest))
