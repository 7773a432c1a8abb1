"""`hive-aot verify MODEL`: check what a store publishes for a model, in any store kind, without pulling it.

Each build the tag (or build id) names is read the way pull reads it: the ref, the manifest whose sha256 the ref
records, the manifest's own model and file names (an OCI store also refuses a manifest whose layers differ from the
document it carries, so every OCI client sees what hive-aot sees), and, given trusted keys, its signature. Then
every blob the manifest names must be in the store at its size, and intact:

- by default, by the store's own cheap policy (`Store.blob_intact`: a local store hashes, remembered per file
  stamp; S3 compares the evidence its verified upload left; see each backend) - what decides whether a build is
  skipped or repaired;
- with `deep`, by reading every blob from the store and hashing it (`Store.blob_content_intact`), nothing written
  to disk: what a pull would find, at the cost of reading the bytes once.

Damaged or missing blobs are rebuilt and uploaded again by the next `hive-aot build` of that build id.
"""

from __future__ import annotations

from typing import Any

from ..core.errors import HiveError, IntegrityError
from ..core.paths import safe_relpath
from ..core.progress import bar
from ..store import Store, blob_key, manifest_key, open_store
from ..store.manifest import Manifest
from ..store.signing import trusted_keys, verify as verify_signature
from .pull import Candidate, candidates, parse_model


def verify_published(model: str, *, recipe: str | None = None, tag: str = "latest", store_uri: str | None = None,
                     deep: bool = False, trusted: str | None = None) -> dict[str, Any]:
    """The report: every build checked, its files with their state (intact | damaged | missing | wrong size), and
    `intact` for the whole. A store that cannot be read, or a manifest pull would refuse, is one HiveError line."""
    store = open_store(store_uri)
    model_id, build_id = parse_model(model)
    store.check_exists()
    found = [c for c in candidates(store, model_id, tag, build_id, recipe) if recipe is None or c.recipe == recipe]
    if not found:
        what = f"build {build_id}" if build_id else f"tag {tag!r}"
        raise HiveError(f"{model_id}: nothing published with {what}" + (f" for {recipe}" if recipe else "")
                        + f" in {store.uri}")
    keys = trusted_keys(trusted)
    builds = [_check_build(store, model_id, c, deep, keys) for c in found]
    return {"model_id": model_id, "store": store.uri, "tag": None if build_id else tag, "deep": deep,
            "builds": builds, "intact": all(b["intact"] for b in builds)}


def _check_build(store: Store, model_id: str, c: Candidate, deep: bool, keys: dict) -> dict[str, Any]:
    m = c.manifest
    for f in m.files:
        safe_relpath(f.path, what="manifest file path")
    signed_by, problems = None, []
    if keys:
        mkey = manifest_key(model_id, c.recipe, m.build_id)
        raw = store.read_bytes(mkey) or b""
        if Manifest.parse(raw, f"{store.uri}: manifest {mkey}") != m:
            raise IntegrityError(f"{store.uri}: manifest {mkey} changed while verifying")
        try:
            signed_by = verify_signature(store, mkey, raw, keys)
        except IntegrityError as e:
            problems.append(str(e))
    files = []
    with bar(m.total_size if deep else len(m.files), f"verify {c.recipe}", unit="B" if deep else "file") as pb:
        for f in m.files:
            files.append({"path": f.path, "sha256": f.sha256, "size": f.size,
                          "state": _blob_state(store, f.sha256, f.size, deep, pb)})
    problems += [f"{f['path']}: blob {f['sha256'][:12]} {f['state']}" for f in files if f["state"] != "intact"]
    return {"recipe": c.recipe, "build_id": m.build_id, "format": m.format, "files": files, "signed_by": signed_by,
            "checked": "sha256 of the stored bytes" if deep else "the store's blob policy", "problems": problems,
            "intact": not problems}


def _blob_state(store: Store, digest: str, size: int, deep: bool, pb) -> str:
    stored = store.size(blob_key(digest))
    if deep and stored == size:  # the bar follows the bytes read
        return "intact" if store.blob_content_intact(digest, size, progress=pb) else "damaged"
    pb.update(size if deep else 1)
    if stored is None:
        return "missing"
    if stored != size:
        return f"holds {stored} bytes, not {size}"
    return "intact" if store.blob_intact(digest, size) else "damaged"


__all__ = ["verify_published"]
