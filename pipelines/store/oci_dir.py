"""An OCI store in a local directory: `oci-layout:///DIR/NAME`, one OCI image layout per repository.

OciStore keeps its mapping of store keys onto repositories and tags (oci_layout.py); this module stands in for the
registry, offering the methods of oci_client.Registry that OciStore, oci_modelcar and oci_referrers call.
Repository `NAME/R` is the directory `DIR/NAME/R`, an OCI image layout (image-spec v1.1, image-layout.md):

    oci-layout           {"imageLayoutVersion": "1.0.0"}
    index.json           one descriptor per tag, the tag in `org.opencontainers.image.ref.name`
    blobs/sha256/<hex>   layers, configs and manifests alike
    ingest/              what is being written (as oras keeps it), renamed into blobs/ once verified

so a model's repository is what `skopeo copy oci:DIR/NAME/<org--name>:<recipe>.latest docker://...` and every
other image-layout reader (oras, KServe's tooling, containers/image) takes, and carrying the directory is an
air-gapped transfer. A ref.name follows a stricter grammar than a tag (oci_dir_index.py): hive-aot's own
`_m.<recipe>.<build>` is `hive-aot+m.<recipe>.<build>` there. Each model's layout holds every blob its manifests
name (mounted from the pool as a hard link, a copy across file systems), so one model's directory is complete on
its own.

What a registry checks, this checks too: a blob lands under its digest only after its bytes were hashed on the way
in (temporary, then rename), a manifest only when every blob it names is in its repository, and index.json (the
one file that makes a tag visible) is replaced whole by rename, read-modify-written under a lock file, so two
writers never lose each other's tags. A layout has no referrers API: referrers use the tag schema
(oci_referrers.py). Reads check what the directory holds (a tagged manifest whose bytes are not its digest, an
index.json that is no index) and say so in one line.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any, BinaryIO

from ..core.errors import IntegrityError, StoreError
from ..core.paths import exclusive_lock
from .oci_client import MANIFEST_TYPE
from .oci_dir_index import REF_NAME, IndexCache, index_bytes, ref_name, ref_of, tag_of
from .oci_layout import check_repository

LAYOUT_FILE, INDEX_FILE, INGEST = "oci-layout", "index.json", "ingest"
LAYOUT_VERSION = b'{"imageLayoutVersion":"1.0.0"}'
TEMPORARY = ("tmp-", "upload-", "mount-")  # what ingest/ holds besides the index's lock file
READ_CHUNK = 1 << 20
MANIFEST_LIMIT = 4 << 20  # what the registry client reads of a manifest (oci_http.BODY_LIMITS)
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
def _digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class LayoutRegistry:
    """The repositories `NAME/...` as OCI image layouts under `root/NAME`. Thread-safe, as Registry is."""

    scheme = "oci-layout"  # OciStore's URI: oci-layout://<root>/<NAME>

    def __init__(self, root: Path, namespace: str):
        self.root, self.namespace = root, namespace
        self.host = str(root).rstrip("/")  # what messages start with: <host>/<repository> is the layout's path
        self._indexes = IndexCache()

    # --- where things are ----------------------------------------------------------------------------------
    def _dir(self, repo: str) -> Path:
        check_repository(repo, f"{self.scheme}://{self.host}")
        if repo != self.namespace and not repo.startswith(self.namespace + "/"):
            raise StoreError(f"{self.host}/{repo}: not a repository of the store {self.host}/{self.namespace}")
        return self.root / repo

    def _blob(self, repo: str, digest: str) -> Path:
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise StoreError(f"{self.host}/{repo}: {str(digest)[:80]!r} is not a sha256 digest")
        return self._dir(repo) / "blobs" / "sha256" / digest[7:]

    def _ensure_layout(self, repo: str) -> Path:
        """The repository's layout directory, made on first write (`oci-layout` and an empty index.json, each
        created whole and only where absent: a concurrent writer's index is never replaced by an empty one)."""
        d = self._dir(repo)
        try:
            (d / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
            (d / INGEST).mkdir(exist_ok=True)
            for name, body in ((LAYOUT_FILE, LAYOUT_VERSION), (INDEX_FILE, index_bytes([]))):
                if not (d / name).exists():
                    tmp = self._write_temp(d, body)
                    try:
                        os.link(tmp, d / name)
                    except FileExistsError:
                        pass
                    finally:
                        os.unlink(tmp)
        except OSError as e:
            raise self._io_error(f"write {repo}", e) from None
        return d

    def _io_error(self, what: str, e: OSError) -> StoreError:
        full = " (the disk is full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        return StoreError(f"{self.host}: cannot {what} ({e.strerror or type(e).__name__}){full}")

    def _write_temp(self, layout: Path, data: bytes) -> Path:
        fd, tmp = tempfile.mkstemp(prefix="tmp-", dir=layout / INGEST)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
        except BaseException:
            os.unlink(tmp)
            raise
        return Path(tmp)

    # --- blobs ---------------------------------------------------------------------------------------------
    def blob_size(self, repo: str, digest: str) -> int | None:
        try:
            st = self._blob(repo, digest).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise self._io_error(f"stat blob {digest[7:19]} of {repo}", e) from None
        return st.st_size if stat.S_ISREG(st.st_mode) else -1  # a size no blob has: never "intact"

    def blob_stream(self, repo: str, digest: str, start: int = 0, length: int | None = None,
                    at_most: int | None = None) -> Iterator[bytes]:
        """Bytes [start, start + length) of the blob (`at_most`: a whole blob read no further than that)."""
        path = self._blob(repo, digest)
        try:
            f = open(path, "rb")
        except (FileNotFoundError, NotADirectoryError):
            raise StoreError(f"{self.host}/{repo}: cannot read blob {digest[7:19]}: not found") from None
        except OSError as e:
            raise self._io_error(f"read blob {digest[7:19]} of {repo}", e) from None
        with f:
            f.seek(start)
            left = length if length is not None else at_most
            while left is None or left > 0:
                chunk = f.read(READ_CHUNK if left is None else min(READ_CHUNK, left))
                if not chunk:
                    return
                if left is not None:
                    left -= len(chunk)
                yield chunk

    def _place_verified(self, repo: str, digest: str, tmp: Path, size: int | None, sha: str, n: int) -> None:
        """Rename a complete temporary into blobs/ when its bytes are `digest` (and `size`); else it goes."""
        try:
            if sha != digest[7:] or (size is not None and n != size):
                raise IntegrityError(f"{self.host}/{repo}: cannot upload blob {digest[7:19]}: the bytes do not match "
                                     f"their digest ({n} bytes, sha256 {sha[:12]})")
            os.replace(tmp, self._blob(repo, digest))
        except OSError as e:
            raise self._io_error(f"write blob {digest[7:19]} of {repo}", e) from None
        finally:
            if tmp.exists():
                tmp.unlink()

    def upload_blob(self, repo: str, digest: str, size: int, body: bytes | Callable[[], BinaryIO]) -> None:
        """The blob written from `body` (bytes, or a callable that opens a stream), hashed on the way."""
        self._blob(repo, digest)  # a malformed digest: refused before anything is read
        tmp, h, n = Path(self.start_upload(repo)), hashlib.sha256(), 0
        try:
            with closing(body() if callable(body) else io.BytesIO(body)) as src, open(tmp, "wb") as out:
                while chunk := src.read(READ_CHUNK):
                    h.update(chunk)
                    n += len(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(tmp, 0o644)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise self._io_error(f"write blob {digest[7:19]} of {repo}", e) from None
            raise
        self._place_verified(repo, digest, tmp, size, h.hexdigest(), n)

    def mount_blob(self, repo: str, digest: str, source: str) -> bool:
        """The blob of `source` linked into `repo` (a hard link; a copy where the file system has none); False
        when `source` has no such blob."""
        src = self._blob(source, digest)
        if not src.is_file():
            return False
        layout = self._ensure_layout(repo)
        tmp = layout / INGEST / f"mount-{secrets.token_hex(8)}"
        try:
            try:
                os.link(src, tmp)
            except OSError:  # another file system, or none with hard links: a copy
                shutil.copyfile(src, tmp)
                os.chmod(tmp, 0o644)
            os.replace(tmp, self._blob(repo, digest))
        except OSError as e:
            raise self._io_error(f"mount blob {digest[7:19]} into {repo}", e) from None
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def delete_blob(self, repo: str, digest: str) -> None:
        try:
            self._blob(repo, digest).unlink(missing_ok=True)
        except OSError as e:
            raise self._io_error(f"delete blob {digest[7:19]} of {repo}", e) from None

    # Chunked upload (oci_modelcar streams a layer whose digest is known only at the end): the upload's
    # "location" is its temporary file in ingest/.
    def start_upload(self, repo: str) -> str:
        layout = self._ensure_layout(repo)
        try:
            fd, name = tempfile.mkstemp(prefix="upload-", dir=layout / INGEST)
        except OSError as e:
            raise self._io_error(f"start an upload to {repo}", e) from None
        os.close(fd)
        return name

    def _upload_file(self, repo: str, location: str) -> Path:
        path = Path(location)
        if path.parent != self._dir(repo) / INGEST or not path.name.startswith("upload-"):
            raise StoreError(f"{self.host}/{repo}: {location[:120]!r} is not an upload of this repository")
        return path

    def patch_upload(self, repo: str, location: str, start: int, data: bytes) -> tuple[str, int | None]:
        path = self._upload_file(repo, location)
        try:
            with open(path, "r+b") as f:
                held = f.seek(0, os.SEEK_END)
                if held != start:
                    raise StoreError(f"{self.host}/{repo}: the upload holds {held} bytes, not {start}")
                f.write(data)
                return location, f.tell()
        except FileNotFoundError:
            raise StoreError(f"{self.host}/{repo}: the upload is gone") from None
        except OSError as e:
            raise self._io_error(f"upload a chunk to {repo}", e) from None

    def upload_offset(self, repo: str, location: str) -> tuple[str, int | None] | None:
        try:
            return location, self._upload_file(repo, location).stat().st_size
        except FileNotFoundError:
            return None

    def finish_upload(self, repo: str, location: str, digest: str) -> None:
        path = self._upload_file(repo, location)
        h, n = hashlib.sha256(), 0
        try:
            with open(path, "rb") as f:
                while chunk := f.read(READ_CHUNK):
                    h.update(chunk)
                    n += len(chunk)
                os.fsync(f.fileno())
            os.chmod(path, 0o644)
        except OSError as e:
            path.unlink(missing_ok=True)
            raise self._io_error(f"finish the upload of blob {digest[7:19]} to {repo}", e) from None
        self._place_verified(repo, digest, path, None, h.hexdigest(), n)

    def cancel_upload(self, repo: str, location: str) -> None:
        self._upload_file(repo, location).unlink(missing_ok=True)

    def start_and_cancel_upload(self, repo: str) -> None:
        """Whether we may write to `repo`, without leaving anything there but its (empty) layout."""
        self.cancel_upload(repo, self.start_upload(repo))

    # --- the index: tags -----------------------------------------------------------------------------------
    def _index(self, repo: str) -> list[dict[str, Any]]:
        return self._indexes.entries(repo, self._dir(repo) / INDEX_FILE, f"{self.host}/{repo}")

    def _tagged(self, repo: str, tag: str) -> dict[str, Any] | None:
        name = ref_name(tag)
        found = [e for e in self._index(repo) if ref_of(e) == name]
        return found[-1] if found else None

    def _edit_index(self, repo: str, edit: Callable[[list[dict[str, Any]]], list[dict[str, Any]]],
                    data: bytes | None = None) -> None:
        """index.json replaced by `edit` of what it holds, under the repository's lock file. The manifests no entry
        names any more go with it (a tag moved off a ref's old artifact: a layout has no garbage collection), and
        `data`, the manifest an entry is about to name, is put back first if that just happened to it."""
        layout = self._ensure_layout(repo)
        try:
            with exclusive_lock(layout / INGEST / f"{INDEX_FILE}.lock"):
                if data is not None and self.blob_size(repo, _digest_of(data)) != len(data):
                    self.upload_blob(repo, _digest_of(data), len(data), data)
                before = self._index(repo)
                entries = edit([dict(e) for e in before])
                tmp = self._write_temp(layout, index_bytes(entries))
                os.replace(tmp, layout / INDEX_FILE)
                for digest in {e["digest"] for e in before} - {e["digest"] for e in entries}:
                    self.delete_blob(repo, digest)
        except OSError as e:
            raise self._io_error(f"write {repo}/{INDEX_FILE}", e) from None

    def tags(self, repo: str) -> list[str]:
        return sorted({tag_of(t) for t in map(ref_of, self._index(repo)) if t is not None})

    def catalog(self) -> list[str]:
        """Every directory under the store that holds an OCI image layout (`oci-layout`)."""
        top, out = self.root / self.namespace, []
        for dirpath, dirs, files in os.walk(top):
            if LAYOUT_FILE in files:
                out.append(Path(dirpath).relative_to(self.root).as_posix())
                dirs[:] = [d for d in dirs if d not in ("blobs", INGEST)]
        return sorted(out)

    # --- manifests -----------------------------------------------------------------------------------------
    def _read_manifest(self, repo: str, digest: str) -> bytes | None:
        path = self._blob(repo, digest)
        try:
            with open(path, "rb") as f:
                data = f.read(MANIFEST_LIMIT + 1)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise self._io_error(f"read {repo}@{digest[7:19]}", e) from None
        if len(data) > MANIFEST_LIMIT:
            raise StoreError(f"{self.host}/{repo}@{digest[7:19]} is larger than {MANIFEST_LIMIT >> 20} MiB, more than "
                             "a manifest holds (refused, not read)")
        if _digest_of(data) != digest:
            raise IntegrityError(f"{self.host}/{repo}: manifest {digest[7:19]} does not match its digest: the layout "
                                 "is damaged")
        return data

    def get_manifest(self, repo: str, reference: str, accept: str = MANIFEST_TYPE) -> tuple[bytes, str] | None:
        """(bytes, digest) of a manifest by tag or digest, None when there is none (`accept`: any kind is kept)."""
        if _DIGEST.fullmatch(reference):
            data = self._read_manifest(repo, reference)
            return None if data is None else (data, reference)
        entry = self._tagged(repo, reference)
        if entry is None:
            return None
        data = self._read_manifest(repo, entry["digest"])
        if data is None:
            raise IntegrityError(f"{self.host}/{repo}: tag {reference} names manifest {entry['digest'][7:19]}, which "
                                 "is not in blobs/: the layout is damaged")
        return data, entry["digest"]

    def head_manifest(self, repo: str, reference: str) -> str | None:
        if _DIGEST.fullmatch(reference):
            return reference if self.blob_size(repo, reference) is not None else None
        entry = self._tagged(repo, reference)
        return None if entry is None or self.blob_size(repo, entry["digest"]) is None else entry["digest"]

    def put_manifest(self, repo: str, reference: str, data: bytes, media_type: str = MANIFEST_TYPE) -> bool:
        """The manifest's bytes under their digest, then (`reference` a tag) the tag in index.json. Refused when
        it names a blob the repository lacks. False: a layout keeps no referrers itself (oci_referrers.py)."""
        where = f"{self.host}/{repo}:{reference}"
        if len(data) > MANIFEST_LIMIT:
            raise StoreError(f"{where}: a manifest of {len(data)} bytes is over {MANIFEST_LIMIT >> 20} MiB (refused)")
        digest, is_digest = _digest_of(data), _DIGEST.fullmatch(reference) is not None
        if is_digest and reference != digest:
            raise IntegrityError(f"{self.host}/{repo}@{reference[7:19]}: the bytes do not match their digest")
        if not is_digest and not _TAG.fullmatch(reference):
            raise StoreError(f"{self.host}/{repo}: {reference[:140]!r} is not a valid tag")
        try:
            doc = json.loads(data)
            named = [doc["config"]] if isinstance(doc.get("config"), dict) else []
            named += [d for d in (doc.get("layers") or []) + (doc.get("manifests") or []) if isinstance(d, dict)]
        except (ValueError, AttributeError, TypeError, RecursionError):
            raise StoreError(f"{where}: not an OCI manifest (JSON object)") from None
        for d in named:
            if self.blob_size(repo, d.get("digest", "")) != d.get("size"):
                raise StoreError(f"{where}: it names blob {str(d.get('digest'))[7:19]} of {d.get('size')} bytes, "
                                 "which is not in the repository (MANIFEST_BLOB_UNKNOWN)")
        if is_digest:
            if self.blob_size(repo, digest) != len(data):
                self.upload_blob(repo, digest, len(data), data)
            return False
        entry = {"mediaType": doc.get("mediaType") or media_type, "digest": digest, "size": len(data),
                 "annotations": {REF_NAME: ref_name(reference)}}
        if isinstance(doc.get("artifactType"), str):
            entry["artifactType"] = doc["artifactType"]
        self._edit_index(repo, lambda entries: [e for e in entries if ref_of(e) != ref_of(entry)] + [entry], data)
        return False

    def delete_manifest(self, repo: str, digest: str) -> None:
        """Every tag of the manifest out of index.json, then its blob (a registry's delete by digest)."""
        if not (self._dir(repo) / INDEX_FILE).exists():
            return
        self._edit_index(repo, lambda entries: [e for e in entries if e.get("digest") != digest])
        self.delete_blob(repo, digest)  # also when untagged (pushed by digest only)

    def reclaim_temporaries(self, min_age_s: float, dry_run: bool = False) -> list[str]:
        """What killed writers left in the layouts' ingest/ directories, older than min_age_s."""
        now, out = time.time(), []
        for repo in self.catalog():
            ingest = self.root / repo / INGEST
            for path in sorted(ingest.iterdir()) if ingest.is_dir() else ():
                if not path.name.startswith(TEMPORARY):
                    continue  # the index's lock file: removed by its holder, never from under it
                try:
                    if now - path.lstat().st_mtime <= min_age_s:
                        continue
                    if not dry_run:
                        path.unlink()
                except FileNotFoundError:
                    continue
                out.append(f"{repo}/{INGEST}/{path.name}")
        return out


__all__ = ["LayoutRegistry", "INDEX_FILE", "LAYOUT_FILE"]
