"""A CNCF ModelPack artifact as any tool pushes it (oras, modctl, KitOps), read from a registry: the reference that
names it, its manifest (bounded, digest-checked) and its layers with the file names they give, checked.

ModelPack (model-spec v0.0.7; the v0.0.6 `vnd.cnai.model` / `org.cnai.model` names are accepted): an OCI image
manifest whose artifactType (or config media type) is the model's, one layer per file or archive. A raw layer (and
Docker Model Runner's `.gguf` / `.safetensors`, single files too) is named by `org.cncf.model.filepath`, else
`org.opencontainers.image.title`, and refused when its `file.metadata+json` typeflag says link, device or FIFO;
a tar or tar+gzip layer names its members itself; tar+zstd is refused (the base install has no zstd decoder).

File names (`Names`) are refused when absolute, with `..`, `.` or empty components, duplicated (also when they
differ only in letter case: a directory copied to a case-insensitive volume, macOS, Windows or some SMB mounts,
would silently keep one of the two), a file where another name needs a directory, or one the puller reserves.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, NamedTuple

from ..core.errors import HiveError, IntegrityError, StoreError
from ..core.paths import safe_relpath
from .oci_client import MANIFEST_TYPE, Registry

ARTIFACT_TYPES = ("application/vnd.cncf.model.manifest.v1+json", "application/vnd.cnai.model.manifest.v1+json")
CONFIG_TYPES = ("application/vnd.cncf.model.config.v1+json", "application/vnd.cnai.model.config.v1+json")
# Asked for too, so that an index or a Docker image is named as what it is instead of "not found".
ACCEPT = ", ".join((MANIFEST_TYPE, "application/vnd.oci.image.index.v1+json",
                    "application/vnd.docker.distribution.manifest.v2+json",
                    "application/vnd.docker.distribution.manifest.list.v2+json"))
_LAYER_TYPE = re.compile(r"application/vnd\.(?:cncf|cnai)\.model\.[a-z]+(?:\.[a-z]+)?\.v1\."
                         r"(?P<format>raw|tar|tar\+gzip|tar\+zstd|gguf|safetensors)")
SINGLE_FILE_FORMATS = {"raw", "gguf", "safetensors"}
PATH_KEYS = ("org.cncf.model.filepath", "org.cnai.model.filepath", "org.opencontainers.image.title")
METADATA_KEYS = ("org.cncf.model.file.metadata+json", "org.cnai.model.file.metadata+json")
# tar typeflags (Go marshals ModelPack's `typeflag` byte as a number: '0' is 48); '0' and the old '\0' are files
REGULAR_TYPEFLAGS = (48, 0, "0", "")
TYPEFLAG_NAMES = {49: "hard link", 50: "symbolic link", 51: "character device", 52: "block device", 53: "directory",
                  54: "FIFO"}

_HOST = (r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
         r"|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REFERENCE = re.compile(rf"oci://(?P<host>{_HOST})/(?P<repo>{_COMPONENT}(?:/{_COMPONENT})*)"
                        r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9._-]{0,127}))?(?:@(?P<digest>[^@/]+))?")


class Reference(NamedTuple):
    host: str
    repository: str
    tag: str | None
    digest: str | None  # read by digest when given (a tag beside it is only shown, as docker does)

    def __str__(self) -> str:
        return (f"oci://{self.host}/{self.repository}" + (f":{self.tag}" if self.tag else "")
                + (f"@{self.digest}" if self.digest else ""))


class Layer(NamedTuple):
    index: int  # from 1, as a person counts the manifest's layers
    media_type: str
    format: str  # raw | tar | tar+gzip (single-file formats are raw)
    hex: str  # the sha256 of its bytes as stored
    size: int
    path: str | None  # the file a raw layer is; None for an archive


def _shown(text: str) -> str:
    """A refused reference as it may be printed: user-info (`user:secret@`) before the host masked."""
    scheme, sep, rest = text.partition("://")
    host, slash, path = rest.partition("/")
    if sep and "@" in host:
        text = f"{scheme}://***@{host.rsplit('@', 1)[1]}{slash}{path}"
    return text if len(text) <= 200 else text[:197] + "..."


def parse_reference(text: str) -> Reference:
    found = _REFERENCE.fullmatch(text)
    if found is None or not (found["tag"] or found["digest"]):
        raise HiveError(f"{_shown(text)!r} is not a ModelPack artifact reference: oci://HOST[:PORT]/REPOSITORY:TAG or "
                        f"oci://HOST[:PORT]/REPOSITORY@sha256:<64 hex> (repository in lowercase)")
    if found["digest"] and not re.fullmatch(r"sha256:[0-9a-f]{64}", found["digest"]):
        raise HiveError(f"{_shown(text)!r}: the digest is not sha256:<64 lowercase hex> (the blob cache is "
                        f"addressed by sha256)")
    return Reference(found["host"], found["repo"], found["tag"], found["digest"])


def read_manifest(registry: Registry, ref: Reference) -> tuple[bytes, str]:
    """(bytes, sha256 digest) of the manifest `ref` names: at most 4 MiB (the client refuses more, unread), and the
    bytes of the digest asked for, and of the one the registry reports."""
    got = registry.get_manifest(ref.repository, ref.digest or ref.tag, accept=ACCEPT)
    if got is None:
        raise StoreError(f"{ref}: not found (the registry has no such repository, tag or digest)")
    raw, said = got
    digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    if ref.digest and digest != ref.digest:
        raise IntegrityError(f"{ref}: the registry answered a manifest whose sha256 is {digest[7:19]}..., not the "
                             f"digest asked for: refusing it")
    if said.startswith("sha256:") and said != digest:
        raise IntegrityError(f"{ref}: the registry reports manifest {said[:19]}... but sent bytes whose sha256 is "
                             f"{digest[7:19]}...: refusing it")
    return raw, digest


def artifact_layers(raw: bytes, where: str) -> list[Layer]:
    """The layers of a ModelPack artifact's manifest; anything else is one line."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        raise HiveError(f"{where}: the manifest is not a JSON object: not a ModelPack artifact")
    kind = doc.get("mediaType", MANIFEST_TYPE)
    if kind != MANIFEST_TYPE or "manifests" in doc or doc.get("schemaVersion") != 2:
        raise HiveError(f"{where} is {str(kind)[:80]!r}, not an OCI image manifest: not a ModelPack artifact")
    config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    if doc.get("artifactType") not in ARTIFACT_TYPES and config.get("mediaType") not in CONFIG_TYPES:
        raise HiveError(f"{where} is not a ModelPack artifact (artifactType {str(doc.get('artifactType'))[:80]}, "
                        f"config {str(config.get('mediaType'))[:80]}; expected {ARTIFACT_TYPES[0]}, or the "
                        f"v0.0.6 {ARTIFACT_TYPES[1]})")
    entries = doc.get("layers")
    if not isinstance(entries, list) or not entries:
        raise HiveError(f"{where}: the ModelPack artifact lists no layers")
    layers = [_layer(i, entry, where) for i, entry in enumerate(entries, 1)]
    sizes: dict[str, Layer] = {}
    for layer in layers:
        first = sizes.setdefault(layer.hex, layer)
        if first.size != layer.size:
            raise HiveError(f"{where}: layers {first.index} and {layer.index} name blob sha256:{layer.hex[:12]}... with "
                            f"two sizes ({first.size} and {layer.size} bytes): refusing it")
    return layers


def _layer(index: int, entry: Any, where: str) -> Layer:
    what = f"{where}: layer {index}"
    if not isinstance(entry, dict):
        raise HiveError(f"{what} is not a descriptor")
    media_type, digest, size = entry.get("mediaType"), entry.get("digest"), entry.get("size")
    found = _LAYER_TYPE.fullmatch(media_type) if isinstance(media_type, str) else None
    if found is None:
        raise HiveError(f"{what} has media type {str(media_type)[:80]!r}, not a ModelPack layer "
                        f"(application/vnd.cncf.model.<kind>.v1.raw|tar|tar+gzip)")
    if found["format"] == "tar+zstd":
        raise HiveError(f"{what} is zstd-compressed ({media_type}), which this install cannot unpack (no zstd "
                        f"decoder in the base install): push it as raw, tar or tar+gzip layers")
    if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise HiveError(f"{what}: digest {str(digest)[:80]!r} is not sha256:<64 hex> (the blob cache is sha256-addressed)")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise HiveError(f"{what}: size {str(size)[:40]!r} is not a byte count")
    notes = entry.get("annotations") if isinstance(entry.get("annotations"), dict) else {}
    fmt = "raw" if found["format"] in SINGLE_FILE_FORMATS else found["format"]
    path = None
    if fmt == "raw":
        path = next((notes[k] for k in PATH_KEYS if isinstance(notes.get(k), str) and notes[k]), None)
        if path is None:
            raise HiveError(f"{what} names no file (neither {PATH_KEYS[0]} nor {PATH_KEYS[2]}): refusing to guess one")
        _check_regular(notes, f"{what} ({path!r})")
    return Layer(index, media_type, fmt, digest[7:], size, path)


def _check_regular(notes: dict[str, Any], what: str) -> None:
    """A raw layer whose file metadata says it was a link, device, FIFO or directory is refused."""
    for key in METADATA_KEYS:
        if key not in notes:
            continue
        try:
            meta = json.loads(notes[key])
            flag = meta.get("typeflag", 48)
        except (ValueError, TypeError, AttributeError, RecursionError):
            raise HiveError(f"{what}: its {key} annotation is not a JSON object") from None
        if isinstance(flag, bool) or flag not in REGULAR_TYPEFLAGS:
            number = ord(flag) if isinstance(flag, str) and len(flag) == 1 else flag
            kind = TYPEFLAG_NAMES.get(number, f"typeflag {str(flag)[:20]!r}") if isinstance(number, int) else \
                f"typeflag {str(flag)[:20]!r}"
            raise HiveError(f"{what} is a {kind}, not a regular file ({key}): refusing it (links and special files "
                            f"are never written)")


class Names:
    """The file names one pull writes: each a plain relative path, unique also ignoring letter case (see the module
    docstring), never a file where another needs a directory, never one of the pull's own."""

    def __init__(self, where: str, reserved: tuple[str, ...]):
        self.where = where
        self.reserved = {n.casefold(): n for n in reserved}
        self.files: dict[str, str] = {}  # casefolded -> as given
        self.dirs: dict[str, str] = {}

    def add(self, name: str, what: str, directory: bool = False) -> None:
        """Take `name` (a file, or with `directory` a directory) that `what` ("layer 2", "a member of layer 3")
        names, or refuse it in one line."""
        try:
            safe_relpath(name, what="path")
        except HiveError as e:  # "refusing path '...': <why>"
            raise HiveError(f"{self.where}: {what} names {name[:200]!r}: {str(e).rsplit(': ', 1)[-1]}: refusing it") \
                from None
        folded = name.casefold()
        parts = folded.split("/")
        parents = ["/".join(parts[:i]) for i in range(1, len(parts))] + ([folded] if directory else [])
        if not directory and folded in self.reserved:
            raise HiveError(f"{self.where}: {what} names {name!r}, a file the pull writes itself: refusing it")
        if not directory and folded in self.files:
            first = self.files[folded]
            same = "the path of another file too" if first == name else \
                f"which differs from another file's path {first!r} only in letter case"
            raise HiveError(f"{self.where}: {what} names {name!r}, {same}: refusing duplicate paths")
        clash = next((p for p in parents if p in self.files or p in self.reserved), None)
        if clash is None and not directory and folded in self.dirs:
            clash = folded
        if clash is not None:
            raise HiveError(f"{self.where}: {what} names {name!r}, which needs {clash!r} to be both a file and a "
                            f"directory: refusing it")
        if not directory:
            self.files[folded] = name
        for p in parents:
            self.dirs.setdefault(p, p)
