"""A store in an OCI registry: `oci://HOST[:PORT]/REPOSITORY` (Distribution, Harbor, Zot, cloud registries).

The store's keys map onto repositories and tags under REPOSITORY (oci_layout.py has the table): blobs are OCI
blobs of the pool repository `REPOSITORY/blobs` (the OCI digest is the blob's sha256, so nothing is re-keyed),
each build is a CNCF ModelPack artifact in the model's repository `REPOSITORY/<model slug>` with one raw layer
per file (oci_modelpack.py), each ref a tag `<recipe>.<tag>` there on a ModelPack artifact of its own, so
`oci://HOST/REPOSITORY/<slug>:<recipe>.latest` is what KServe, image volumes and ModelPack tools pull. Layers
are mounted from the pool (cross-repository mount), never sent twice; each blob is stored once.

Atomic as the Store protocol demands: a blob exists only once the registry has checked its digest; an
artifact's layers and config are in its repository before its manifest is pushed by digest, and the tag (the
one request that makes a document visible) comes last, so a killed publish never leaves a tag naming nothing.
A document is replaced by moving its tag; the old manifest is left untagged to the registry's own garbage
collection. Delete is by digest (Distribution refuses delete by tag); every tag's manifest names its own store
key, so a delete never takes a second tag with it.

What the registry API lacks is recorded in the artifacts themselves: modification times (an annotation),
the list of blobs (a holder tag per blob in the pool, which also keeps the blob from the registry's garbage
collection until `gc` deletes it), the original spelling of a model slug (each artifact's store key).
Listing everything (`ls`, `gc`) needs the registry's catalog API (`/v2/_catalog`); a model's own keys
(pull, tag, retire) need only its repository's tag list.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ..core.errors import HiveError, IntegrityError, StoreError
from ..core.paths import safe_relpath
from .base import Entry, Store
from .faults import store_event
from .oci_client import Registry
from .oci_layout import META, MODELCAR_OF, POOL, Place, area_of, check_repository, json_object, key_of, place
from .oci_modelpack import (
    EMPTY,
    EMPTY_BYTES,
    build_of,
    check_view,
    compose,
    config_bytes,
    config_descriptor,
    holder,
    read_document,
    ref_field,
)
from .oci_signed import SignedArtifacts
from .oci_streams import BytesReader, HashingReader, ModelBlobs


class OciStore(SignedArtifacts, Store):
    def __init__(self, host: str, repository: str, registry=None):
        """`registry`: what holds the repositories, by default a Registry of `host`; an oci_dir.LayoutRegistry keeps
        them as OCI image layouts under the directory `host` (its `scheme` names the store's URI)."""
        self.host, self.repository = host, repository.strip("/")
        self.registry = registry if registry is not None else Registry(host)
        self.uri = f"{getattr(self.registry, 'scheme', 'oci')}://{host}/{self.repository}"
        check_repository(self.repository, self.uri)
        self._present: set[tuple[str, str]] = set()  # (repository, digest) known to be there
        self._slugs: dict[str, str] = {}  # model repository -> the slug as its keys spell it
        self._lock = threading.Lock()

    # --- where things are ----------------------------------------------------------------------------------
    def _place(self, key: str) -> Place | None:
        try:
            safe_relpath(key, what="store key")
        except HiveError as e:
            raise StoreError(str(e)) from None
        return place(key)

    def _repo(self, name: str) -> str:
        return f"{self.repository}/{name}"

    def _where(self, p: Place) -> str:
        return f"{self.uri}/{p.repo}:{p.tag}"

    def _document(self, p: Place, key: str):
        """The document under `key`, None when there is none. What every read of a document goes through: an
        artifact whose OCI view (layers, config) is not what its document makes is refused here (check_view),
        so every reader of a manifest or ref (pull, verify, gc) sees the same artifact other OCI clients do."""
        got = self.registry.get_manifest(self._repo(p.repo), p.tag)
        if got is None:
            return None
        doc = read_document(got[0], self._where(p))
        if doc.key != key:
            if doc.key.lower() == key.lower():
                return None  # the tag holds another spelling of the model id: another model (see _owner)
            raise IntegrityError(f"{self._where(p)} holds {doc.key[:120]!r}, not {key!r}: it was copied or moved "
                                 "there (refusing to read it)")
        check_view(got[0], doc, p.kind, self._where(p), p.digest)
        return doc

    def _owner(self, repo: str) -> str | None:
        """The model slug as the keys in model repository `repo` spell it; None while it holds none.

        OCI repository names are lowercase, so model ids that differ only in case (rt3/tiny, RT3/Tiny) map to one
        repository. Local and S3 stores keep them apart; here the first spelling owns the repository and a write
        under another is refused in one line (write_bytes), reads and lists of another find nothing. Refused rather
        than mapped injectively (say, case encoded in the name): the repository a user pulls with skopeo, KServe
        or oras stays `<org>--<name>` lowercased, as docs/stores.md's table says, and stores already published keep
        their names."""
        with self._lock:
            if repo in self._slugs:
                return self._slugs[repo]
        spelled = None
        # a tag that holds a store key: a Modelcar image (or another tool's tag) carries no key annotation
        for tag in [t for t in self.registry.tags(self._repo(repo)) if key_of(repo, t, repo)][:1]:
            got = self.registry.get_manifest(self._repo(repo), tag)
            try:
                key = read_document(got[0], repo).key if got else ""
            except IntegrityError:
                key = ""
            parts = key.split("/")
            if len(parts) > 2 and parts[1].lower() == repo:
                spelled = parts[1]
        if spelled is not None:  # a repository still empty may be taken by the next write: not remembered
            with self._lock:
                self._slugs[repo] = spelled
        return spelled

    def _other_spelling(self, p: Place) -> str | None:
        """The slug that owns p's model repository when it is not the one p's key spells; None otherwise."""
        if p.kind not in ("ref", "manifest", "signature"):
            return None
        owner = self._owner(p.repo)
        return owner if owner is not None and owner != p.slug else None

    # --- reads ----------------------------------------------------------------------------------------------
    def read_bytes(self, key: str) -> bytes | None:
        p = self._place(key)
        if p is None:
            return None
        if p.kind == "blob":
            size = self.registry.blob_size(self._repo(POOL), p.digest)
            if size is None:
                return None
            return b"".join(self.registry.blob_stream(self._repo(POOL), p.digest, at_most=size))
        return self._document_bytes(p, key)

    def _document_bytes(self, p: Place, key: str) -> bytes | None:
        """A document's bytes: a signature as its bundle is attached, a build's manifest from its own tag or, in a
        mirror that copied only refs, from a ref artifact carrying it (oci_signed.py)."""
        if p.kind == "signature":
            return None if self._other_spelling(p) is not None else self.read_signature(p, key)
        doc = self._document(p, key)
        if doc is None and p.kind == "manifest" and self._other_spelling(p) is None:
            return self.carried_manifest(p, key)
        return None if doc is None else doc.data

    def blobs_for(self, manifest_key: str) -> ModelBlobs:
        """Reads of the blobs a build's artifact names from the model's own repository, not the pool: what pull
        uses, so a model repository copied anywhere on its own (a mirror) pulls."""
        p = self._place(manifest_key)
        return ModelBlobs(self, self._repo(p.repo)) if p is not None and p.kind == "manifest" else self

    def exists(self, key: str) -> bool:
        p = self._place(key)
        if p is None:
            return False
        if p.kind == "blob":
            return self.registry.blob_size(self._repo(POOL), p.digest) is not None
        if self._other_spelling(p) is not None:
            return False
        if p.kind == "signature":
            return self._document_bytes(p, key) is not None
        # a tag's existence only: the manifest a mirror's ref carries is found by reads (pull, copy), so a publish's
        # existence checks never walk a model's ref history
        return self.registry.head_manifest(self._repo(p.repo), p.tag) is not None

    def size(self, key: str) -> int | None:
        p = self._place(key)
        if p is None:
            return None
        if p.kind == "blob":
            return self.registry.blob_size(self._repo(POOL), p.digest)
        data = self._document_bytes(p, key)
        return None if data is None else len(data)

    def modified(self, key: str) -> float | None:
        p = self._place(key)
        if p is None:
            return None
        doc = self._document(p, key)  # a blob's holder, or the document itself
        if doc is None:
            return None
        return doc.written if doc.written is not None else 0.0  # a build's manifest: immutable, no time

    def blob_intact(self, digest: str, size: int) -> bool:
        """Size from the pool, and its holder tag: the registry checked the digest when the blob was pushed, so
        through its API the bytes under a digest are that digest's; a blob whose holder a killed upload never
        wrote is re-pushed (which writes the holder).

        What this cannot see: bytes changed behind the API, in the registry's storage, at the same size; only
        reading the blob does (blob_content_intact, `verify --deep`), and every pull does. What cannot be
        repaired through the API at all: Distribution keeps the data it holds under a digest when the same digest
        is pushed again (201, nothing written) and a DELETE only unlinks it; so a damaged blob stays until the
        registry's operator removes its data (and garbage-collects), and a push that should have repaired one
        says so in one line (_push_blob) instead of reporting it repaired."""
        p = place(f"blobs/sha256/{digest[:2]}/{digest}")
        return (self.registry.blob_size(self._repo(POOL), p.digest) == size
                and self.registry.head_manifest(self._repo(POOL), p.tag) is not None)

    def iter_range(self, key: str, start: int, length: int) -> Iterator[bytes]:
        if length <= 0:
            return
        p = self._place(key)
        if p is None or p.kind != "blob":
            raise StoreError(f"{self.uri}: {key} is not a blob")
        yield from self.registry.blob_stream(self._repo(POOL), p.digest, start, length)

    def download_file(self, key: str, dest: Path, progress=None) -> None:
        p = self._place(key)
        if p is None or p.kind != "blob":
            raise StoreError(f"{self.uri}: {key} is not a blob")
        size = self.registry.blob_size(self._repo(POOL), p.digest)  # what is read at most (the caller verifies)
        with open(dest, "wb") as f:
            for chunk in self.registry.blob_stream(self._repo(POOL), p.digest, at_most=size):
                f.write(chunk)
                if progress is not None:
                    progress.update(len(chunk))

    # --- listing --------------------------------------------------------------------------------------------
    def _model_repos(self, slug: str | None) -> list[tuple[str, str]]:
        """(repository, slug as spelled) of the models a listing covers: the one named, else the catalog's."""
        if slug is not None:
            owner = self._owner(slug.lower())
            return [] if owner is not None and owner != slug else [(slug.lower(), slug)]
        under = self.repository + "/"
        names = [r[len(under):] for r in self.registry.catalog() if r.startswith(under)]
        return [(n, self._spelling(n)) for n in names if "/" not in n and n not in (POOL, META)]

    def _spelling(self, repo: str) -> str:
        """A model repository's slug as hive-aot wrote it (repositories are lowercase), from any of its tags."""
        return self._owner(repo) or repo

    def _keys(self, prefix: str) -> list[tuple[str, str, str]]:
        """(key, repository, tag) of every key under prefix."""
        area, slug = area_of(prefix)
        out: list[tuple[str, str, str]] = []
        if area in ("", "blobs"):
            out += [(k, POOL, t) for t in self.registry.tags(self._repo(POOL)) if (k := key_of(POOL, t, ""))]
        if area in ("", "staging", "profiles.json"):
            out += [(k, META, t) for t in self.registry.tags(self._repo(META)) if (k := key_of(META, t, ""))]
        if area in ("", "refs", "manifests", "signatures"):
            for repo, spelled in self._model_repos(slug):
                out += [(k, repo, t) for t in self.registry.tags(self._repo(repo)) if (k := key_of(repo, t, spelled))]
        return sorted((k, r, t) for k, r, t in out if k.startswith(prefix))

    def list(self, prefix: str) -> list[str]:
        return [k for k, _, _ in self._keys(prefix)]

    def list_entries(self, prefix: str) -> list[Entry]:
        out = []
        for key, repo, tag in self._keys(prefix):
            got = self.registry.get_manifest(self._repo(repo), tag)
            if got is None:
                continue  # deleted while listing
            doc = read_document(got[0], f"{self.uri}/{repo}:{tag}")
            size = int(doc.layers[0].get("size", 0)) if repo == POOL and doc.layers else len(doc.data)
            out.append(Entry(key, size, doc.written or 0.0))
        return out

    # --- writes ---------------------------------------------------------------------------------------------
    def reclaim_temporaries(self, min_age_s: float, dry_run: bool = False) -> list[str]:
        """A registry purges its own abandoned uploads; an image layout directory leaves them to gc (oci_dir.py)."""
        reclaim = getattr(self.registry, "reclaim_temporaries", None)
        return [] if reclaim is None else reclaim(min_age_s, dry_run)

    def check_writable(self) -> None:
        try:
            self.registry.start_and_cancel_upload(self._repo(POOL))
        except StoreError as e:
            raise StoreError(f"store {self.uri} is not writable ({e})") from None

    def _ensure_blob(self, repo: str, digest: str, size: int, data: bytes | None = None, path: str = "") -> None:
        """The blob in `repo` before a manifest names it: mounted from the pool, or (small documents) sent."""
        if (repo, digest) in self._present:
            return
        there = self.registry.blob_size(repo, digest)
        if there is None:
            if data is not None:
                self.registry.upload_blob(repo, digest, len(data), data)
            else:
                pooled = self.registry.blob_size(self._repo(POOL), digest)
                if pooled is None:
                    raise StoreError(f"{self.uri}: blob {digest[7:19]} of {path} is not in the store")
                if pooled != size:
                    raise IntegrityError(f"{self.uri}: blob {digest[7:19]} of {path} holds {pooled} bytes, its "
                                         f"manifest says {size}")
                if not self.registry.mount_blob(repo, digest, self._repo(POOL)):
                    raise StoreError(f"{self.uri}: the registry did not mount blob {digest[7:19]} of {path} from "
                                     f"{self._repo(POOL)} (cross-repository mount refused)")
        elif there != size:
            raise IntegrityError(f"{self.uri}: blob {digest[7:19]} of {path} in {repo} holds {there} bytes, its "
                                 f"manifest says {size}")
        with self._lock:
            self._present.add((repo, digest))

    def _artifact(self, p: Place, key: str, data: bytes) -> bytes:
        """The OCI manifest for a document, its layers and config already in its repository."""
        repo = self._repo(p.repo)
        build, manifest_doc = None, None
        if p.kind == "manifest":
            build = build_of(data)
        elif p.kind == "ref":
            build, manifest_doc = self._named_build(data)
        written = None if p.kind == "manifest" else time.time()
        if build is None:
            self._ensure_blob(repo, EMPTY["digest"], EMPTY["size"], EMPTY_BYTES)
            return compose(key, data, written=written)
        for f in build["files"]:
            self._ensure_blob(repo, f.digest, f.size, path=f.path)
        # the manifest is a layer too: a reader with only this repository (a mirror, oras) has every file OMS signs
        m = build["manifest"]
        self._ensure_blob(repo, m.digest, m.size, data if manifest_doc is None else manifest_doc, path=m.path)
        cfg = config_bytes(build, ref_field(data, "created_at") if p.kind == "ref" else None)
        config = config_descriptor(cfg)
        self._ensure_blob(repo, config["digest"], len(cfg), cfg)
        return compose(key, data, build=build, config=config, manifest_doc=manifest_doc, written=written)

    def _named_build(self, ref: bytes):
        """(build, manifest bytes) of the manifest a ref document names; (None, None) for a ref that names none."""
        mkey = ref_field(ref, "manifest")
        mp = self._place(mkey) if mkey else None
        if mp is None or mp.kind != "manifest":
            return None, None
        doc = self._document(mp, mkey)
        if doc is None:
            return None, None
        return build_of(doc.data), doc.data

    def write_bytes(self, key: str, data: bytes) -> None:
        p = self._place(key)
        if p is None:
            raise StoreError(f"{self.uri}: store key {key!r} has no place in an OCI registry")
        if p.kind == "blob":
            if hashlib.sha256(data).hexdigest() != p.digest[7:]:
                raise IntegrityError(f"{key}: content does not match its digest")
            self._push_blob(p, key, len(data), lambda: data)
            return
        owner = self._other_spelling(p)
        if owner is not None:
            raise StoreError(f"{self.uri}: cannot write {key}: model {p.slug.replace('--', '/')!r} differs only in "
                             f"case from {owner.replace('--', '/')!r}, which holds repository {self._repo(p.repo)} "
                             "(OCI repository names are lowercase): publish it under another id or to another store")
        if p.kind == "signature" and self.write_signature(p, key, data):
            store_event("done", key)
            return
        body = self._artifact(p, key, data)
        repo = self._repo(p.repo)
        # by digest first (the registry checks what it names), then the tag: the one request that makes it visible
        self.registry.put_manifest(repo, "sha256:" + hashlib.sha256(body).hexdigest(), body)
        store_event("temp", key)
        if p.kind == "ref":  # signed before it is visible, as the build's manifest is
            self.sign_ref(p, body, ref_field(data, "manifest"))
        self.registry.put_manifest(repo, p.tag, body)
        store_event("done", key)

    def _push_blob(self, p: Place, key: str, size: int, opener) -> None:
        pool = self._repo(POOL)
        store_event("temp", key)
        held = self.registry.blob_size(pool, p.digest)
        if held != size:
            readers: list[HashingReader] = []

            def body():
                src = opener()
                readers.append(HashingReader(src if hasattr(src, "read") else BytesReader(src)))
                return readers[-1]

            self.registry.upload_blob(pool, p.digest, size, body)
            sent = readers[-1]
            if sent.n != size or sent.h.hexdigest() != p.digest[7:]:
                self.registry.delete_blob(pool, p.digest)
                raise IntegrityError(f"{key}: content changed while uploading (sha256 mismatch)")
            there = None if held is None else self.registry.blob_size(pool, p.digest)
            if held is not None and there != size:  # a damaged blob the push was to replace: kept (see blob_intact)
                raise IntegrityError(f"{self.uri}: blob {p.digest[7:19]} is damaged in the registry ({there} bytes, "
                                     f"not {size}) and pushing it again does not replace it: the registry's operator "
                                     "must delete its data from the registry's storage (then garbage-collect)")
        self._ensure_blob(pool, EMPTY["digest"], EMPTY["size"], EMPTY_BYTES)  # the holder's config
        self.registry.put_manifest(pool, p.tag, holder(key, p.digest, size, time.time()))
        store_event("done", key)

    def upload_file(self, key: str, path: Path, sha256: str) -> None:
        p = self._place(key)
        if p is None or p.kind != "blob" or p.digest != f"sha256:{sha256}":
            raise StoreError(f"{self.uri}: {key} is not the blob key of sha256 {sha256[:12]}")
        self._push_blob(p, key, path.stat().st_size, lambda: open(path, "rb"))

    def delete(self, key: str) -> None:
        p = self._place(key)
        if p is None or self._other_spelling(p) is not None:  # another model's tag: nothing of this key's
            return
        repo = self._repo(p.repo)
        if p.kind == "signature":
            self.delete_signature(p, key)
        digest = self.registry.head_manifest(repo, p.tag)
        if digest:
            if p.kind in ("manifest", "ref"):
                self.detach(repo, digest)
            self.registry.delete_manifest(repo, digest)
        if p.kind == "blob":
            self.registry.delete_blob(repo, p.digest)
            with self._lock:
                self._present.discard((repo, p.digest))
        elif not digest:
            return
        store_event("delete", key)


    def delete_derived(self, manifest_keys: list[str], dry_run: bool = False) -> list[str]:
        """The Modelcar images (tags that hold no store key) whose MODELCAR_OF annotation names one of these
        manifests, deleted by digest (every tag of an image goes with it)."""
        wanted, found = set(manifest_keys), []
        for repo in sorted({place(k).repo for k in manifest_keys if place(k) is not None}):
            full, digests = self._repo(repo), set()
            for tag in self.registry.tags(full):  # all of them first: deleting an image takes all its tags
                if key_of(repo, tag, repo) is not None:
                    continue
                got = self.registry.get_manifest(full, tag)
                if got is not None and _annotations(got[0]).get(MODELCAR_OF) in wanted:
                    found.append(f"{self.host}/{full}:{tag}")
                    digests.add(got[1])
            for digest in sorted(digests) if not dry_run else ():
                self.registry.delete_manifest(full, digest)
        return found


def _annotations(raw: bytes) -> dict:
    try:
        notes = json_object(raw, "a manifest").get("annotations")
    except StoreError:  # not a manifest of ours: nothing to match
        return {}
    return notes if isinstance(notes, dict) else {}
