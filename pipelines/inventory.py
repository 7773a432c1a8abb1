"""What a store holds (`ls`) and what it no longer needs (`gc`)."""

from __future__ import annotations

import json
import time
from typing import Any

from .manifest import Manifest
from .store import blob_key, open_store


def list_published(store_uri: str | None = None) -> list[dict[str, Any]]:
    store = open_store(store_uri)
    store.check_exists()
    rows = []
    sizes: dict[str, int] = {}
    for key in store.list("refs/"):
        _, slug, recipe, tag = key.split("/", 3)
        ref = store.read_json(key) or {}
        mkey = ref.get("manifest", "")
        if mkey not in sizes:
            raw = store.read_bytes(mkey)
            sizes[mkey] = Manifest.model_validate_json(raw).total_size if raw else 0
        model_id = slug.replace("--", "/", 1)
        rows.append({"model_id": model_id, "recipe": recipe, "tag": tag, "build_id": ref.get("build_id", ""),
                     "size": sizes[mkey], "created_at": ref.get("created_at", ""), "manifest": mkey})
    rows.sort(key=lambda r: (r["model_id"], r["recipe"], r["tag"] != "latest", r["tag"]))
    return rows


def gc(store_uri: str | None = None, *, dry_run: bool = False, min_age_s: float = 3600.0) -> dict[str, Any]:
    """Delete blobs no manifest or live staging record references, and staging records older than min_age_s.

    Blobs are uploaded before their manifest is written, so only blobs older than min_age_s are
    candidates: a build in flight keeps its blobs.
    """
    store = open_store(store_uri)
    store.check_exists()
    now = time.time()
    live: set[str] = set()
    stale_staging = []
    for key in store.list("manifests/"):
        for f in json.loads(store.read_bytes(key) or b"{}").get("files", []):
            live.add(blob_key(f["sha256"]))
    for key in store.list("staging/"):
        if now - (store.modified(key) or 0) > min_age_s:
            stale_staging.append(key)
            continue
        for f in (store.read_json(key) or {}).get("manifest", {}).get("files", []):
            live.add(blob_key(f["sha256"]))
    dead, freed = [], 0
    for key in store.list("blobs/"):
        if key in live:
            continue
        if now - (store.modified(key) or 0) < min_age_s:
            continue  # possibly a build in flight: blobs are uploaded before their manifest
        dead.append(key)
        freed += store.size(key) or 0
    if not dry_run:
        for key in stale_staging + dead:
            store.delete(key)
    return {"blobs": dead, "bytes": freed, "staging": stale_staging, "dry_run": dry_run}
