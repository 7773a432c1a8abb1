"""A Modelcar: a regular OCI image of a published artifact, its files under `/models`, pushed beside the artifact.

KServe's Modelcars (`storageUri: oci://...`) and Kubernetes image volumes mount images, not ModelPack artifacts
(a container runtime unpacks tar layers; KServe's Modelcar mode also runs `ln` and `sleep` in it). The image is
an OCI image manifest whose config is an image config (`rootfs.diff_ids`, amd64/linux unless a base says
otherwise) and whose one added layer is the deterministic uncompressed tar of oci_tar.py. `--base` puts it on
top of a runnable image (busybox, for KServe's Modelcar mode): the base's layers are mounted into the model's
repository by digest (copied when the base is in another registry), its config kept (env, cmd, platform,
history) with the layer's diff_id appended. Without a base the image has no shell: it is for image volumes
(`subPath: models`) and KServe's `oci+native://`.

The layer is never whole on disk or in memory: each file is read from the store's pool by blob reads and fed
to a chunked upload (POST, PATCH per chunk in order, PUT ?digest=), its sha256 computed over the tar bytes as
they go. Distribution 2.8 appends whatever a PATCH carries and ignores Content-Range, so a PATCH is never
re-sent blind: after a failed one, the upload's state (GET, `Range`) says how much it holds and the stream
resumes from there; an upload that lost bytes, or says nothing usable, is cancelled and restarted.

Nothing half-visible: layer, base layers and config are in the repository, the manifest is pushed by digest,
and the tag comes last. A tag that already holds this build's image (same base, same layout) is left as it is.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import IntegrityError, StoreError
from .faults import store_event
from .layout import blob_key
from .oci import OciStore
from .oci_client import MANIFEST_TYPE, Registry
from .oci_layout import MODELCAR_OF, check_repository, json_object, modelcar_tag, place
from .oci_tar import chunks, layer_size, plan

IMAGE_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
ACCEPT = ", ".join((MANIFEST_TYPE, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST))
# docker's layer types name the same bytes as OCI's; an OCI manifest names them the OCI way
DOCKER_LAYERS = {"application/vnd.docker.image.rootfs.diff.tar.gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
                 "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip":
                     "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"}
A_BUILD, A_OF, A_LAYOUT = "io.hive-aot.modelcar.build", MODELCAR_OF, "io.hive-aot.modelcar.layout"
A_BASE_NAME, A_BASE_DIGEST = "org.opencontainers.image.base.name", "org.opencontainers.image.base.digest"
LAYOUT = "1"  # bumped when the layer or config format changes: an image of the old one is then re-made
CHUNK = 32 << 20  # bytes per PATCH, held in memory once (what a resumed PATCH re-sends from)
PATCH_TRIES = 4  # failed PATCHes resumed per upload
RESTARTS = 2  # uploads begun again after one lost its place
CONFIG_LIMIT = 4 << 20  # an image config is a few KiB; a base's config is read whole, so no further than this


@dataclass
class Base:
    shown: str
    registry: Registry
    host: str
    repo: str
    digest: str
    layers: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)


class _Lost(Exception):
    """The upload's state is not what was sent: begin it again."""


def _locate(ref: str, store: OciStore) -> tuple[str, str, str]:
    """(host, repository, tag or digest) of `oci://HOST/REPO[:TAG|@DIGEST]` or `REPO[:TAG|@DIGEST]` (the store's
    registry)."""
    host, rest = (ref[6:].partition("/")[::2]) if ref.startswith("oci://") else (store.host, ref)
    if "@" in rest:
        repo, reference = rest.split("@", 1)
    else:
        repo, colon, reference = rest.rpartition(":")
        repo, reference = (repo, reference) if colon else (rest, "latest")
    if not host or not repo or not reference or "@" in host:
        raise StoreError(f"--base {ref!r} is not oci://host[:port]/repository[:tag] or repository[:tag]")
    return host, check_repository(repo, f"--base {ref}"), reference


def read_base(ref: str, store: OciStore) -> Base:
    """The base image's layers and config; one line for what is not a runnable image."""
    host, repo, reference = _locate(ref, store)
    registry = store.registry if host == store.host else Registry(host)
    shown = f"{host}/{repo}" + (f"@{reference}" if reference.startswith("sha256:") else f":{reference}")
    got = registry.get_manifest(repo, reference, ACCEPT)
    if got is None:
        raise StoreError(f"--base {shown}: no such image")
    doc = json_object(got[0], f"--base {shown}")
    if doc.get("mediaType") in (OCI_INDEX, DOCKER_LIST) or "manifests" in doc:
        entries = [m for m in doc.get("manifests") or [] if isinstance(m, dict)]
        amd64 = [m for m in entries if (m.get("platform") or {}).get("os") == "linux"
                 and (m.get("platform") or {}).get("architecture") == "amd64"]
        pick = amd64 or (entries if len(entries) == 1 else [])
        if not pick:
            raise StoreError(f"--base {shown}: an index without a linux/amd64 image (name one by digest)")
        got = registry.get_manifest(repo, pick[0]["digest"], ACCEPT)
        if got is None:
            raise StoreError(f"--base {shown}: its index names {pick[0]['digest'][:19]}, which is not there")
        doc = json_object(got[0], f"--base {shown}")
    config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    if config.get("mediaType") not in (IMAGE_CONFIG, DOCKER_CONFIG) or not isinstance(doc.get("layers"), list):
        raise StoreError(f"--base {shown} is not a runnable image (config {str(config.get('mediaType'))[:80]}): "
                         "name one such as busybox")
    size = config.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= CONFIG_LIMIT:
        raise StoreError(f"--base {shown}: its config's size {str(size)[:20]} is not 1 byte to "
                         f"{CONFIG_LIMIT >> 20} MiB (refused)")
    raw = b"".join(registry.blob_stream(repo, config["digest"], at_most=size))
    if "sha256:" + hashlib.sha256(raw).hexdigest() != config["digest"]:
        raise IntegrityError(f"--base {shown}: its config does not match its digest")
    cfg = json_object(raw, f"--base {shown}: its config")
    layers = [{"mediaType": DOCKER_LAYERS.get(la["mediaType"], la["mediaType"]), "digest": la["digest"],
               "size": int(la["size"])} for la in doc["layers"]]
    if len((cfg.get("rootfs") or {}).get("diff_ids") or []) != len(layers):
        raise StoreError(f"--base {shown}: its config's rootfs.diff_ids do not match its {len(layers)} layer(s)")
    digest = got[1] or "sha256:" + hashlib.sha256(got[0]).hexdigest()
    return Base(shown, registry, host, repo, digest, layers, cfg)


class _StreamReader:
    """A blob stream as the file a monolithic upload reads (a base layer copied from another registry)."""

    def __init__(self, it: Iterator[bytes]):
        self.it, self.buf = it, b""

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self.buf) < size:
            nxt = next(self.it, None)
            if nxt is None:
                break
            self.buf += nxt
        out, self.buf = (self.buf, b"") if size < 0 else (self.buf[:size], self.buf[size:])
        return out


def _place_base_layers(store: OciStore, repo: str, base: Base) -> None:
    reg = store.registry
    for la in base.layers:
        d, size = la["digest"], la["size"]
        if reg.blob_size(repo, d) == size:
            continue
        if base.host == store.host and reg.mount_blob(repo, d, base.repo):
            continue
        src, src_repo = base.registry, base.repo
        reg.upload_blob(repo, d, size, lambda: _StreamReader(src.blob_stream(src_repo, d, at_most=size)))


def stream_layer(reg: Registry, repo: str, entries, read, chunk: int | None = None) -> str:
    """Upload the tar of `entries` in chunks; its sha256 digest once the registry has checked it."""
    for attempt in range(RESTARTS + 1):
        loc = reg.start_upload(repo)
        try:
            return _send(reg, repo, loc, entries, read, chunk or CHUNK)
        except _Lost:
            with suppress(StoreError):
                reg.cancel_upload(repo, loc)
        except BaseException:
            with suppress(StoreError):
                reg.cancel_upload(repo, loc)  # nothing left behind but what the registry purges itself
            raise
    raise StoreError(f"{reg.host}: cannot upload the Modelcar layer to {repo}: the upload lost its place "
                     f"{RESTARTS + 1} times")


def _send(reg: Registry, repo: str, loc: str, entries, read, size: int) -> str:
    h, sent, tries, total = hashlib.sha256(), 0, 0, layer_size(entries)
    for piece in chunks(entries, read, size):
        while piece:
            try:
                loc, held = reg.patch_upload(repo, loc, sent, piece)
            except IntegrityError:
                raise
            except StoreError as e:
                tries += 1
                if tries > PATCH_TRIES or getattr(e, "status", 0) in (401, 403):
                    raise
                state = reg.upload_offset(repo, loc)  # what it holds: the failed PATCH may have landed, whole or part
                if state is None or state[1] is None or not sent <= state[1] <= sent + len(piece):
                    raise _Lost from None
                loc, held = state
                h.update(piece[:held - sent])
                piece, sent = piece[held - sent:], held
                continue
            if held is not None and held != sent + len(piece):
                raise _Lost  # the registry holds other than what was sent (a duplicated append)
            h.update(piece)
            sent, piece = sent + len(piece), b""
            if sent <= size:
                store_event("temp", "modelcar")  # the layer half sent (the kill tests' first point)
    if sent != total:
        raise StoreError(f"the Modelcar layer came to {sent} bytes, its plan says {total}")
    digest = "sha256:" + h.hexdigest()
    reg.finish_upload(repo, loc, digest)
    return digest


def _serialize(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def image_config(base: Base | None, diff_id: str, labels: dict[str, str]) -> bytes:
    cfg = dict(base.config) if base else {}
    cfg.setdefault("architecture", "amd64")
    cfg.setdefault("os", "linux")
    inner = dict(cfg.get("config") or {})
    inner["Labels"] = {**(inner.get("Labels") or {}), **labels}
    cfg["config"] = inner
    cfg["rootfs"] = {"type": "layers", "diff_ids": [*((base.config.get("rootfs") or {}).get("diff_ids") or []
                                                        if base else []), diff_id]}
    step = {"created_by": "hive-aot modelcar", "comment": "the artifact's files under /models"}
    if base is None or cfg.get("history"):  # history counts layers: added only where the base keeps one
        cfg["history"] = [*(cfg.get("history") or []), step]
    return _serialize(cfg)


def push_modelcar(store: OciStore, key: str, files: list[tuple[str, str, int]], build_id: str, *,
                  labels: dict[str, str], name: str, image_tag: str | None = None, base_ref: str | None = None,
                  chunk: int | None = None) -> dict[str, Any]:
    """Push the Modelcar image of the build whose manifest is store key `key` (files: path, sha256, size),
    tagged `<recipe>.<name>-modelcar` or `image_tag`; what was pushed."""
    p = place(key)
    if p is None or p.kind != "manifest":
        raise StoreError(f"{key} is not a build's manifest key")
    recipe = key.split("/")[2]
    tag = modelcar_tag(recipe, name, image_tag)
    repo, reg = f"{store.repository}/{p.repo}", store.registry
    entries = plan(files)
    base = read_base(base_ref, store) if base_ref else None
    where = f"{store.host}/{repo}:{tag}"
    out = {"image": where, "tag": tag, "build_id": build_id, "base": base.shown if base else None,
           "files": len(files), "layer_size": layer_size(entries)}
    got = reg.get_manifest(repo, tag)
    if got is not None:
        there = json_object(got[0], where)
        notes, layers = there.get("annotations") or {}, there.get("layers") or [{}]
        if (notes.get(A_BUILD), notes.get(A_LAYOUT), notes.get(A_BASE_DIGEST)) == (
                build_id, LAYOUT, base.digest if base else None):
            return {**out, "digest": got[1], "layer": layers[-1].get("digest"), "already_present": True}
    if base is not None:
        _place_base_layers(store, repo, base)
    digest = stream_layer(reg, repo, entries, lambda sha, start, n: store.iter_range(blob_key(sha), start, n), chunk)
    cfg = image_config(base, digest, labels)
    cfg_digest = "sha256:" + hashlib.sha256(cfg).hexdigest()
    if reg.blob_size(repo, cfg_digest) != len(cfg):
        reg.upload_blob(repo, cfg_digest, len(cfg), cfg)
    notes = {A_BUILD: build_id, A_OF: key, A_LAYOUT: LAYOUT}
    if base is not None:
        notes.update({A_BASE_NAME: base.shown, A_BASE_DIGEST: base.digest})
    body = _serialize({"schemaVersion": 2, "mediaType": MANIFEST_TYPE,
                       "config": {"mediaType": IMAGE_CONFIG, "digest": cfg_digest, "size": len(cfg)},
                       "layers": [*(base.layers if base else []),
                                  {"mediaType": LAYER_TAR, "digest": digest, "size": out["layer_size"]}],
                       "annotations": notes})
    manifest_digest = "sha256:" + hashlib.sha256(body).hexdigest()
    reg.put_manifest(repo, manifest_digest, body)  # by digest first: the registry checks every blob it names
    store_event("temp", "modelcar")
    reg.put_manifest(repo, tag, body)  # the one request that makes it visible
    store_event("done", "modelcar")
    return {**out, "digest": manifest_digest, "layer": digest, "already_present": False}
