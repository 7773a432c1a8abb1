"""`hive-aot copy`: a model's published builds from one store to another, of any kinds (a local directory, S3, an
OCI registry, an OCI image layout directory): staging to production, local to S3 or OCI, into an air-gapped site.

Everything is read from the source and checked against what was asked before the destination is touched: each
chosen build's manifest (its sha256 against the ref that names it, its model, recipe and build id against its key),
the refs of the source that name it, its signature. Then per build, in the order a publish commits
(store/documents.py): every blob, streamed from the source and hashed on the way (a blob whose bytes are not
its manifest's sha256 stops the copy in one line), placed as Store.put_blob places it (skipped when an intact
copy is there: what makes a rerun after an interrupted copy resume); the manifest's exact bytes (so the build id
and every ref's manifest_sha256 hold in the destination); its signature when the source has one; the refs last,
so a ref in the destination names a build only once everything it needs is there. A blob from a store that is not
a local directory passes through one temporary file (in the destination when that is a directory, so it becomes
the blob by a hard link; else in the cache's work area), never through memory.

Which refs: those of the source that name a copied build. The tag asked for (`MODEL:TAG`, default latest) is
written, moving the destination's; every other is added only where the destination lacks it, never moved (a
copy by build id never rolls a production tag back). A manifest the destination already holds in other bytes is
refused (a published manifest is immutable), and a signature the destination already holds is kept.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import HiveError, IntegrityError
from ..core.hashing import CHUNK
from ..core.paths import check_model_id, model_slug, work_dir
from ..core.progress import bar
from ..store import Store, blob_key, manifest_key, open_store, ref_key
from ..store.documents import read_manifest
from ..store.layout import PROFILES_KEY, is_digest
from ..store.local import LocalStore
from ..store.manifest import FileEntry, Manifest
from ..store.signing import signature_key
from .build_ids import check_build_ref, resolve_build_id


@dataclass
class Chosen:
    """One build to copy, as read (and checked) from the source."""

    recipe: str
    key: str  # its manifest's store key
    raw: bytes  # the manifest's exact bytes
    manifest: Manifest
    refs: dict[str, bytes] = field(default_factory=dict)  # ref key -> its bytes in the source
    moves: set[str] = field(default_factory=set)  # the ref keys written even where the destination has them
    signature: bytes | None = None


@dataclass
class Report:
    builds: list[dict[str, Any]] = field(default_factory=list)
    bytes_sent: int = 0
    blobs_copied: int = 0
    blobs_skipped: int = 0


def parse_spec(spec: str) -> tuple[str, str | None, str]:
    """MODEL[@BUILD|:TAG] -> (model id, build id or prefix or None, tag)."""
    hint = " (copy takes org/name[@build_id|:tag])"
    model, at, build = spec.partition("@")
    model, colon, tag = model.partition(":")
    if at and colon:
        raise HiveError(f"{spec[:120]!r}: name a build (@) or a tag (:), not both{hint}")
    check_model_id(model, hint=hint)
    if at:
        check_build_ref(build, hint=f"; {hint.strip(' ()')}")
    if colon:
        ref_key(model, "r", tag)  # the tag grammar, one line
    return model, build or None, tag or "latest"


def _ref(store: Store, key: str) -> tuple[bytes, dict[str, Any]] | None:
    """A ref's exact bytes and what they say, checked as Store.read_ref checks them."""
    raw = store.read_bytes(key)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict) or not is_digest(doc.get("build_id")):
        raise IntegrityError(f"{store.uri}: ref {key} has no valid build_id (a sha256 hex digest): the store is "
                             "damaged")
    return raw, doc


def _read_build(src: Store, model_id: str, recipe: str, build_id: str, expected_sha: str | None) -> Chosen:
    key = manifest_key(model_id, recipe, build_id)
    raw, m = read_manifest(src, key, expected_sha, model_id, " (nothing copied)")
    for f in m.files:
        blob_key(f.sha256)  # a digest that is none: one line now, not halfway through the copy
    chosen = Chosen(recipe, key, raw, m, signature=src.read_bytes(signature_key(key)))
    sha = hashlib.sha256(raw).hexdigest()
    for rkey in src.list(f"refs/{model_slug(model_id)}/{recipe}/"):
        got = _ref(src, rkey)
        if got is None or got[1]["build_id"] != build_id:
            continue
        if got[1].get("manifest_sha256") not in (None, sha) or got[1].get("manifest", key) != key:
            raise IntegrityError(f"{src.uri}: ref {rkey} names build {build_id[:12]} but another manifest than {key} "
                                 "holds (nothing copied)")
        chosen.refs[rkey] = got[0]
    return chosen


def choose(src: Store, model_id: str, build: str | None, tag: str, recipe: str | None) -> list[Chosen]:
    """The builds to copy: those `tag` names (one per recipe, or `recipe`'s), or build `build` (a prefix resolves)."""
    slug = model_slug(model_id)
    if build is not None:
        keys = src.list(f"manifests/{slug}/")
        build = resolve_build_id(build, keys, model_id=model_id, where=src.uri, recipe=recipe)
        recipes = [k.split("/")[2] for k in keys if k.endswith(f"/{build}.json")]
        recipes = [r for r in recipes if recipe is None or r == recipe]
        if not recipes:
            raise HiveError(f"{model_id}: no published build {build}" + (f" of {recipe}" if recipe else "")
                            + f" in {src.uri}")
        return [_read_build(src, model_id, r, build, None) for r in sorted(recipes)]
    recipes = [recipe] if recipe else sorted({k.split("/")[2] for k in src.list(f"refs/{slug}/")})
    out = []
    for r in recipes:
        key = ref_key(model_id, r, tag)
        got = _ref(src, key)
        if got is None:
            continue
        chosen = _read_build(src, model_id, r, got[1]["build_id"], got[1].get("manifest_sha256"))
        chosen.refs[key] = got[0]  # the bytes read first: the tag asked for names what was checked
        chosen.moves.add(key)
        out.append(chosen)
    if not out:
        raise HiveError(f"{model_id}: no tag {tag!r}" + (f" of {recipe}" if recipe else "") + f" in {src.uri} "
                        f"(see `hive-aot ls --store {src.uri}`)")
    return out


def _check_destination(dst: Store, chosen: list[Chosen]) -> None:
    for c in chosen:
        there = dst.read_bytes(c.key)
        if there is not None and there != c.raw:
            raise IntegrityError(f"{dst.uri}: {c.key} already holds another manifest (sha256 "
                                 f"{hashlib.sha256(there).hexdigest()[:12]}, the source's is "
                                 f"{hashlib.sha256(c.raw).hexdigest()[:12]}): a published manifest is not replaced")


class _Blobs:
    """The blob transfer: source bytes hashed on the way, then placed as put_blob places them."""

    def __init__(self, src: Store, dst: Store, staging: Path, progress, report: Report):
        self.src, self.dst, self.staging, self.pb, self.report = src, dst, staging, progress, report

    def copy(self, c: Chosen, f: FileEntry) -> None:
        key = blob_key(f.sha256)
        if self.dst.size(key) is not None and self.dst.blob_intact(f.sha256, f.size):
            self.report.blobs_skipped += 1
            self.pb.update(f.size)
            return
        local = self.src.local_path(key)
        if local is not None:  # read in place: hashed here, then uploaded (the upload verifies it again)
            with open(local, "rb") as fh:
                self._check(c, f, self._hash(fh))
            self.dst.upload_file(key, local, f.sha256)
        else:
            tmp = self.staging / f".copy-{f.sha256[:16]}-{secrets.token_hex(4)}.tmp"
            try:
                with open(tmp, "wb") as out:
                    self._check(c, f, self._hash(self.src.blobs_for(c.key).iter_range(key, 0, f.size), out))
                self.dst.put_blob(tmp, f.sha256, handover=True)
            finally:
                tmp.unlink(missing_ok=True)
        self.report.blobs_copied += 1
        self.report.bytes_sent += f.size

    def _hash(self, chunks, out=None) -> tuple[int, str]:
        if hasattr(chunks, "read"):
            f = chunks
            chunks = iter(lambda: f.read(CHUNK), b"")
        h, n = hashlib.sha256(), 0
        for chunk in chunks:
            h.update(chunk)
            n += len(chunk)
            if out is not None:
                out.write(chunk)
            self.pb.update(len(chunk))
        return n, h.hexdigest()

    def _check(self, c: Chosen, f: FileEntry, got: tuple[int, str]) -> None:
        n, sha = got
        if (n, sha) != (f.size, f.sha256):
            raise IntegrityError(f"{self.src.uri}: blob {f.sha256[:12]} of {f.path} ({c.recipe} build "
                                 f"{c.manifest.build_id[:12]}) holds {n} bytes with sha256 {sha[:12]}, not what its "
                                 f"manifest records: copy stopped, nothing of it is referenced in {self.dst.uri}")


def _commit(dst: Store, c: Chosen) -> dict[str, Any]:
    """Manifest, signature, then refs: what a publish writes, in its order."""
    dst.write_bytes(c.key, c.raw)
    signature = "none"
    if c.signature is not None:
        there = dst.read_bytes(signature_key(c.key))
        if there is None:
            dst.write_bytes(signature_key(c.key), c.signature)
        signature = ("copied" if there is None else "already there" if there == c.signature
                     else "kept the destination's")
    written = []
    for rkey, raw in sorted(c.refs.items()):
        there = dst.read_bytes(rkey)
        if there != raw and (there is None or rkey in c.moves):
            dst.write_bytes(rkey, raw)
            written.append(rkey.rsplit("/", 1)[1])
    return {"recipe": c.recipe, "build_id": c.manifest.build_id, "files": len(c.manifest.files),
            "bytes": c.manifest.total_size, "signature": signature, "tags": written}


def copy_model(spec: str, *, source: str, dest: str, recipe: str | None = None) -> dict[str, Any]:
    """Copy the builds MODEL[@BUILD|:TAG] names from store `source` to store `dest`; what was copied."""
    model_id, build, tag = parse_spec(spec)
    src, dst = open_store(source), open_store(dest)
    if src.uri == dst.uri:
        raise HiveError(f"--from and --to are the same store ({src.uri})")
    src.check_exists()
    chosen = choose(src, model_id, build, tag, recipe)
    dst.check_writable()
    _check_destination(dst, chosen)
    profiles = src.read_bytes(PROFILES_KEY) if dst.read_bytes(PROFILES_KEY) is None else None
    report, started = Report(), time.monotonic()
    total = sum(f.size for c in chosen for f in c.manifest.files)
    with ExitStack() as stack:
        staging = dst.root if isinstance(dst, LocalStore) else stack.enter_context(work_dir("copy-"))
        pb = stack.enter_context(bar(total, desc=f"copy {model_id}"))
        blobs = _Blobs(src, dst, staging, pb, report)
        for c in chosen:
            for f in c.manifest.files:
                blobs.copy(c, f)
            if profiles is not None:  # pull's runtime profiles, before the first ref makes a build pullable
                dst.write_bytes(PROFILES_KEY, profiles)
                profiles = None
            report.builds.append(_commit(dst, c))
    seconds = time.monotonic() - started
    return {"model_id": model_id, "from": src.uri, "to": dst.uri, "builds": report.builds,
            "bytes_sent": report.bytes_sent, "blobs_copied": report.blobs_copied,
            "blobs_skipped": report.blobs_skipped, "seconds": round(seconds, 3),
            "bytes_per_second": int(report.bytes_sent / seconds) if seconds > 0 else None}


__all__ = ["copy_model", "choose", "parse_spec"]
