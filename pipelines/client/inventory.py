"""What a store holds (`ls`) and what it no longer needs (`gc`)."""

from __future__ import annotations

import time
from typing import Any

from ..core.errors import IntegrityError
from ..core.paths import reclaim_work
from ..store import blob_key, open_store, staging_lease
from ..store.manifest import Manifest
from .blob_leftovers import reclaim_partials


def list_published(store_uri: str | None = None) -> list[dict[str, Any]]:
    store = open_store(store_uri)
    store.check_exists()
    rows = []
    sizes: dict[str, int] = {}
    for key in store.list("refs/"):
        parts = key.split("/")
        if len(parts) != 4:
            raise IntegrityError(f"{store.uri}: {key} is not refs/<model>/<recipe>/<tag>: the store is damaged")
        _, slug, recipe, tag = parts
        ref = store.read_ref(key) or {}
        mkey = ref.get("manifest", "")
        if mkey not in sizes:
            raw = store.read_bytes(mkey) if mkey else None
            sizes[mkey] = Manifest.parse(raw, f"{store.uri}: {mkey}").total_size if raw else 0
        model_id = slug.replace("--", "/", 1)
        rows.append({"model_id": model_id, "recipe": recipe, "tag": tag, "build_id": ref.get("build_id", ""),
                     "size": sizes[mkey], "created_at": ref.get("created_at", ""), "manifest": mkey})
    rows.sort(key=lambda r: (r["model_id"], r["recipe"], r["tag"] != "latest", r["tag"]))
    return rows


def published_builds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`list_published`'s rows (one per tag) as one row per build, with its tags in their order (latest first) and
    the earliest time a tag was written for it; builds in the order of their first row."""
    builds: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["model_id"], r["recipe"], r["build_id"])
        b = builds.setdefault(key, {"model_id": r["model_id"], "recipe": r["recipe"], "build_id": r["build_id"],
                                    "tags": [], "size": r["size"], "created_at": r["created_at"]})
        b["tags"].append(r["tag"])
        if r["created_at"] and (not b["created_at"] or r["created_at"] < b["created_at"]):
            b["created_at"] = r["created_at"]
    return list(builds.values())


def _staged_blobs(store, key: str) -> set[str]:
    doc = store.read_json(key)
    if doc is None:
        return set()
    record = doc.get("manifest") if isinstance(doc, dict) else None
    return {blob_key(f.sha256) for f in Manifest.parse(record or {}, f"{store.uri}: {key}").files}


def gc(store_uri: str | None = None, *, dry_run: bool = False, min_age_s: float = 3600.0) -> dict[str, Any]:
    """Delete blobs no manifest or live staging record references, and staging records older than min_age_s.

    Blobs are uploaded before their manifest is written, so only blobs older than min_age_s are
    candidates: a build in flight keeps its blobs. A staging record within its lease (staging_lease.py) is
    live whatever min_age_s says; before deleting, manifests and records that appeared meanwhile are read.
    """
    store = open_store(store_uri)
    store.check_exists()
    now = time.time()
    live: set[str] = set()
    stale_staging = []
    # A manifest or live staging record that cannot be read might reference any blob: collecting
    # nothing is then the only safe answer (Manifest.parse raises one line naming it).
    manifests_seen = store.list("manifests/")
    for key in manifests_seen:
        raw = store.read_bytes(key)
        if raw is not None:
            live.update(blob_key(f.sha256) for f in Manifest.parse(raw, f"{store.uri}: {key}").files)
    for key in store.list("staging/"):
        # a validating builder keeps re-writing its record: within the lease it is live whatever min_age_s says
        if not staging_lease.live(now - (store.modified(key) or 0), min_age_s):
            stale_staging.append(key)
            continue
        live.update(_staged_blobs(store, key))
    dead: dict[str, int] = {}  # key -> size
    for entry in store.list_entries("blobs/"):  # size and age from the listing: no request per blob
        if entry.key in live:
            continue
        if now - entry.modified < min_age_s:
            continue  # possibly a build in flight: blobs are uploaded before their manifest
        dead[entry.key] = entry.size
    if dead and not dry_run:
        # what was published or staged while this gc listed: its blobs are not dead after all
        for key in set(store.list("manifests/")) - set(manifests_seen):
            raw = store.read_bytes(key)
            if raw is not None:
                live.update(blob_key(f.sha256) for f in Manifest.parse(raw, f"{store.uri}: {key}").files)
        for key in set(store.list("staging/")) - set(stale_staging):
            live.update(_staged_blobs(store, key))
        dead = {k: size for k, size in dead.items() if k not in live}
    if not dry_run:
        for key in [*stale_staging, *dead]:
            store.delete(key)
    temporaries = store.reclaim_temporaries(min_age_s, dry_run)
    work = [] if dry_run else reclaim_work()  # this host's scratch directories of dead processes
    # this host's partial downloads of dead pulls (kept a day for a pull to resume them; gc takes its min age)
    partials = [] if dry_run else reclaim_partials(max_age_s=min_age_s)
    return {"blobs": list(dead), "bytes": sum(dead.values()), "staging": stale_staging, "temporaries": temporaries, "work": work,
            "partials": partials, "dry_run": dry_run}
