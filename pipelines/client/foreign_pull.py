"""`hive-aot pull oci://HOST[:PORT]/REPOSITORY:TAG --dest DIR` (or `...@sha256:<hex>`): any CNCF ModelPack
artifact, whoever pushed it (oras, modctl, KitOps), into DIR as `hive-aot pull` leaves a build.

No hive-aot store layout is assumed: store/oci_artifact.py reads the artifact as ModelPack defines it (manifest at
most 4 MiB and the bytes its digest names; layers and the file names they give, checked). Every layer is fetched
from the manifest's own repository into the content-addressed blob cache (resumable, checked against its digest and
size: blob_batch over a one-repository view of the registry). A raw layer is a file of DIR, hard-linked from the
cache; a tar or tar+gzip layer is unpacked from its verified cached blob into a sibling staging directory, each
regular file under its sha256 and linked from there (directories are made as files need them; links and special
files are refused). DIR is then assembled in a sibling temporary directory and renamed into place whole
(pulled_dir), under the lock `hive-aot pull` holds on DIR: nothing is left in DIR on any failure.

With trusted keys (--trusted-keys, $HIVE_AOT_TRUSTED_KEYS) the artifact must carry an OpenSSF Model Signing bundle
as an OCI referrer of its manifest, signed by one of them over exactly DIR's files (path -> sha256); it is looked
for before anything is downloaded, verified once the files' digests are known, and kept in DIR as `model.sig`,
where `model_signing verify` looks for it.

The marker `hive-aot.json` records the reference, the manifest digest (as `build_id`, what `pulled_dir.present`
compares) and every file with its sha256 (a tar layer's members too), so a second pull of the same digest finds
DIR present without reading a layer.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from ..core.errors import HiveError, IntegrityError, ResourceError, StoreError
from ..core.progress import bar
from ..store.oci_artifact import TYPEFLAG_NAMES, Layer, Names, Reference, artifact_layers, parse_reference, read_manifest
from ..store.oci_client import Registry
from ..store.oci_referrers import find_bundle
from ..store.oms import SIGNATURE_FILE
from ..store.signing import trusted_keys, verify_bundle
from .blob_batch import fetch_blobs
from .blob_cache import CachedBlob, TransferStats, blob_path, check_cache_dirs, missing_bytes
from .blob_leftovers import reclaim_partials
from .blob_stamps import same_inode_and_bytes
from .pull import dest_lock
from .pulled_dir import FILE_MODE, MARKER, assemble, present

COPY_CHUNK = 8 << 20


class File(NamedTuple):
    """A file of DIR, as pulled_dir reads a manifest's files."""

    path: str
    sha256: str
    size: int


class Plan(NamedTuple):
    """What pulled_dir.assemble and .present read of a manifest: its identity and its files."""

    build_id: str  # the OCI manifest's digest
    files: list[File]


class RepositoryBlobs:
    """What blob_cache.fetch_verified reads of a store (`uri`, ranged reads of `blobs/sha256/<2>/<hex>` keys), over
    the one repository the manifest lives in: a layer is read from there, nowhere else."""

    def __init__(self, registry: Registry, ref: Reference, layers: list[Layer]):
        self.registry, self.repository = registry, ref.repository
        self.uri = f"oci://{ref.host}/{ref.repository}"
        self.where = str(ref)
        self.layers = {layer.hex: layer for layer in layers}

    def iter_range(self, key: str, start: int, length: int) -> Iterator[bytes]:
        if length <= 0:
            return
        digest = key.rsplit("/", 1)[-1]
        try:
            yield from self.registry.blob_stream(self.repository, "sha256:" + digest, start, length)
        except StoreError as e:
            if getattr(e, "status", None) != 404:
                raise
            layer = self.layers.get(digest)
            shown = f"layer {layer.index} ({layer.path or layer.media_type})" if layer else f"blob {digest[:12]}"
            raise StoreError(f"{self.where}: {shown}, sha256:{digest[:12]}..., is missing from {self.repository} "
                             f"(404): the artifact is incomplete") from None


def pull_foreign(reference: str, dest: Path, *, trusted: str | None = None) -> dict[str, Any]:
    """Pull the ModelPack artifact `reference` into `dest`; `trusted`: public key files (comma-separated; default
    $HIVE_AOT_TRUSTED_KEYS) one of which must have signed it."""
    ref = parse_reference(reference)
    registry = Registry(ref.host)
    raw, digest = read_manifest(registry, ref)
    where = str(ref)
    layers = artifact_layers(raw, where)
    keys = trusted_keys(trusted)
    bundle = _find_bundle(registry, ref, digest) if keys else None
    reserved = (MARKER, SIGNATURE_FILE) if keys else (MARKER,)
    beside = {SIGNATURE_FILE: bundle} if bundle is not None else None  # kept in DIR next to the files it signs
    names = Names(where, reserved)
    for layer in layers:
        if layer.path is not None:
            names.add(layer.path, f"layer {layer.index}")
    dest = dest.resolve()
    if dest == dest.parent:  # DIR is replaced as a whole, and its lock file lives beside it
        raise HiveError(f"cannot pull into {dest}: name a directory below it")
    marker = {"build_id": digest, "reference": str(ref), "source": "oci-modelpack",
              "layers": [{"digest": "sha256:" + layer.hex, "mediaType": layer.media_type, "size": layer.size}
                         for layer in layers]}
    with dest_lock(dest):
        recorded = _recorded_members(dest, digest)
        if recorded is not None and all(layer.hex in recorded for layer in layers if layer.path is None):
            plan = _plan(digest, layers, recorded)
            if present(dest, plan, beside):
                signed_by = _verify(bundle, keys, plan, where) if keys else None
                return _result(ref, digest, dest, plan, signed_by, already=True)
        check_cache_dirs({layer.hex for layer in layers})
        reclaim_partials(keep={layer.hex for layer in layers})  # what dead pulls left, except what this one resumes
        _check_disk(layers, where)
        sizes = {layer.hex: layer.size for layer in layers}
        stats = TransferStats()
        with bar(sum(sizes.values()), f"pull {ref.repository}") as progress:
            blobs = fetch_blobs(RepositoryBlobs(registry, ref, layers), sizes, progress, stats=stats)
        _reclaim_staging(dest)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.unpack-", dir=dest.parent))
        try:
            members = {layer.hex: _unpack(layer, blobs[layer.hex], staging, names, where)
                       for layer in layers if layer.path is None}
            plan = _plan(digest, layers, {h: [f for f, _ in m] for h, m in members.items()})
            signed_by = _verify(bundle, keys, plan, where) if keys else None
            staged = {f.sha256: blob for m in members.values() for f, blob in m}
            doc = {**marker, "manifest": {"files": [f._asdict() for f in plan.files]},
                   "members": {"sha256:" + h: [f.path for f, _ in m] for h, m in members.items()}}
            assemble(dest, plan, {**staged, **blobs}, doc, beside)
        except OSError as e:
            raise HiveError(f"cannot pull into {dest} ({e.filename or dest}: {e.strerror or type(e).__name__})") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return {**_result(ref, digest, dest, plan, signed_by, already=False),
            "transfer": {"fetched_bytes": stats.fetched, "resumed_bytes": stats.resumed,
                         "cached_blobs": stats.cached_blobs}}


def _plan(digest: str, layers: list[Layer], members: dict[str, list[File]]) -> Plan:
    """DIR's files in layer order (a tar layer's in archive order)."""
    files = []
    for layer in layers:
        files += [File(layer.path, layer.hex, layer.size)] if layer.path is not None else members[layer.hex]
    return Plan(digest, files)


def _recorded_members(dest: Path, digest: str) -> dict[str, list[File]] | None:
    """The files each tar layer gave when DIR's marker says DIR holds this very manifest (then `present` checks
    them all against their recorded sha256); None otherwise."""
    try:
        doc = json.loads((dest / MARKER).read_text())
        if not isinstance(doc, dict) or doc.get("build_id") != digest:
            return None
        files = {f["path"]: File(f["path"], f["sha256"], f["size"]) for f in doc["manifest"]["files"]}
        return {h[7:]: [files[p] for p in paths] for h, paths in doc.get("members", {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def _find_bundle(registry: Registry, ref: Reference, digest: str) -> bytes:
    bundle = find_bundle(registry, ref.repository, digest)
    if bundle is None:
        raise IntegrityError(f"{ref}: no OpenSSF Model Signing bundle refers to manifest {digest[:19]}..., and "
                             f"trusted keys are set: refusing an unsigned artifact (nothing was pulled)")
    return bundle


def _verify(bundle: bytes | None, keys: dict[str, Any], plan: Plan, where: str) -> str:
    """The key id that signed exactly DIR's files."""
    return verify_bundle(bundle or b"", keys, {f.path: f.sha256 for f in plan.files}, where)


def _check_disk(layers: list[Layer], where: str) -> None:
    """Refuse, before downloading, layers that do not fit the cache's file system (what a killed pull already wrote
    counts as there). A tar layer's unpacked size is not known beforehand: running out of room while unpacking is
    the one-line disk error of the write."""
    from ..core.host import free_bytes
    from ..core.units import human_bytes

    cache_dir = blob_path("0" * 64).parent.parent
    need = sum(missing_bytes(layer.hex, layer.size) for layer in {layer.hex: layer for layer in layers}.values())
    free = free_bytes(cache_dir)
    if need > free:
        raise ResourceError(f"pull of {where} needs {human_bytes(need)} more in the blob cache {cache_dir}, which "
                            f"has {human_bytes(free)} free; nothing was downloaded")


def _reclaim_staging(dest: Path) -> None:
    """Staging directories of killed pulls of DIR (this pull holds DIR's lock: no live pull uses them)."""
    for old in dest.parent.glob(f".{glob.escape(dest.name)}.unpack-*"):
        shutil.rmtree(old, ignore_errors=True)


def _unpack(layer: Layer, blob: CachedBlob, staging: Path, names: Names, where: str) -> list[tuple[File, CachedBlob]]:
    """The regular files of a tar (or tar+gzip) layer, each staged under its sha256, read from the verified cached
    blob itself (the inode that matched the layer's digest: a shared cache's name may be swapped meanwhile)."""
    what = f"layer {layer.index} ({layer.media_type})"
    out: list[tuple[File, CachedBlob]] = []
    with open(os.open(blob.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
        if not same_inode_and_bytes(os.fstat(f.fileno()), blob.verified):
            raise IntegrityError(f"blob cache: {blob.path} changed after it was verified (another process writes the "
                                 f"cache): nothing was placed; pull again")
        try:
            with tarfile.open(fileobj=f, mode="r|gz" if layer.format == "tar+gzip" else "r|") as archive:
                for member in archive:
                    name = member.name[2:] if member.name.startswith("./") else member.name
                    if name in ("", "."):
                        continue  # the archive's root directory
                    if member.isdir():
                        names.add(name, f"a member of {what}", directory=True)
                        continue
                    if not member.isreg():
                        kind = TYPEFLAG_NAMES.get(member.type[0] if member.type else 0, f"type {member.type!r}")
                        raise HiveError(f"{where}: {what} member {name[:120]!r} is a {kind}, not a regular file: "
                                        f"refusing it (links and special files are never written)")
                    names.add(name, f"a member of {what}")
                    digest, staged = _stage(archive.extractfile(member), staging)
                    out.append((File(name, digest, member.size), staged))
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise HiveError(f"{where}: {what} is not a readable {layer.format} archive ({type(e).__name__}): "
                            f"refusing it") from None
    return out


def _stage(src: BinaryIO, staging: Path) -> tuple[str, CachedBlob]:
    """src's bytes as `staging/<sha256>` (mode FILE_MODE, so DIR hard-links it as it does a cached blob)."""
    hasher = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=".member-", dir=staging)
    with os.fdopen(fd, "wb") as out:
        while chunk := src.read(COPY_CHUNK):
            hasher.update(chunk)
            out.write(chunk)
    path = staging / hasher.hexdigest()
    if path.exists():  # the same bytes twice: one staged file, linked under both names
        os.unlink(tmp)
    else:
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    return hasher.hexdigest(), CachedBlob(path, os.lstat(path))


def _result(ref: Reference, digest: str, dest: Path, plan: Plan, signed_by: str | None, *,
            already: bool) -> dict[str, Any]:
    return {"reference": str(ref), "digest": digest, "dest": str(dest), "already_present": already,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in plan.files],
            "size": sum(f.size for f in plan.files), "signed_by": signed_by}
