"""Reading and placing what a store holds, shared by the engine, the hardware steps and pull: a manifest
checked against the key it was asked for, a build's files placed and verified, the runtime profiles' copy."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Iterable

from pydantic import BaseModel

from ..errors import IntegrityError, StoreError
from ..hashing import sha256_file
from ..manifest import FileEntry, Manifest
from .base import Store
from .layout import PROFILES_KEY, blob_key, check_binding


def load_manifest(store: Store, key: str, expected_sha: str | None, model_id: str) -> Manifest:
    raw = store.read_bytes(key)
    if raw is None:
        raise StoreError(f"{store.uri}: manifest {key} is missing")
    if expected_sha and hashlib.sha256(raw).hexdigest() != expected_sha:
        raise IntegrityError(f"{store.uri}: manifest {key} does not match the sha256 its ref records")
    m = Manifest.parse(raw, f"{store.uri}: manifest {key}")
    check_binding(m, key, model_id, store.uri)
    return m


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
