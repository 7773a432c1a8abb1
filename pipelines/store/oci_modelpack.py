"""The OCI manifests the OCI store writes: ModelPack artifacts for builds, small document artifacts for the rest.

A hive-aot manifest (and each ref naming it) becomes a CNCF ModelPack artifact (model-spec v0.0.7): an OCI
image manifest with artifactType `application/vnd.cncf.model.manifest.v1+json`, a config
`application/vnd.cncf.model.config.v1+json` ({descriptor, config, modelfs}: nothing else, the schema forbids
extra keys; modelfs.diffIds are the layer digests, since raw layers are their own uncompressed content) and one
raw layer per file (`application/vnd.cncf.model.<kind>.v1.raw`, with the file's path in
`org.cncf.model.filepath` and `org.opencontainers.image.title`, which CRI-O's image volumes name the file
after). A raw layer's digest is the file's sha256, i.e. the store's blob: nothing is re-encoded.

Every artifact the store writes carries, in manifest annotations, the store key it holds (`io.hive-aot.key`:
keys are unique per tag, so deleting one tag's manifest by digest never takes another tag with it) and the
document's exact bytes (`io.hive-aot.document`, or `.base64` for bytes that are not UTF-8). A ref's artifact
also carries the manifest document it names (`io.hive-aot.manifest`), so one GET tells a reader everything.
Mutable documents record when they were written (`io.hive-aot.written`, epoch seconds): the registry API has
no modification time, and gc and the staging lease need one. A build's manifest artifact has none: its bytes
stay deterministic, as the store's manifests are.
"""

from __future__ import annotations

import base64
import json
from pathlib import PurePosixPath
from typing import Any, NamedTuple

from ..errors import IntegrityError

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
MODEL_ARTIFACT = "application/vnd.cncf.model.manifest.v1+json"
MODEL_CONFIG = "application/vnd.cncf.model.config.v1+json"
DOC_ARTIFACT = "application/vnd.hive-aot.document.v1+json"
BLOB_ARTIFACT = "application/vnd.hive-aot.blob.v1"
EMPTY = {"mediaType": "application/vnd.oci.empty.v1+json",
         "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a", "size": 2}
EMPTY_BYTES = b"{}"
A_KEY, A_DOC, A_DOC64 = "io.hive-aot.key", "io.hive-aot.document", "io.hive-aot.document.base64"
A_MANIFEST, A_WRITTEN = "io.hive-aot.manifest", "io.hive-aot.written"
A_PATH, A_TITLE = "org.cncf.model.filepath", "org.opencontainers.image.title"
FORMATS = {"safetensors", "gguf", "onnx", "pt"}  # ModelPack's config.format values
_CONFIG_NAMES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "preprocessor_config.json",
                 "chat_template.jinja", "hive-aot.json"}
_CODE_SUFFIXES = {".py", ".sh"}
_DOC_SUFFIXES = {".md", ".txt", ".rst"}


class File(NamedTuple):
    path: str
    digest: str  # sha256:<hex>
    size: int


class Document(NamedTuple):
    key: str
    data: bytes
    written: float | None
    layers: list[dict[str, Any]]


def layer_type(path: str) -> str:
    """ModelPack's layer kind for a file: weights, their config/tokenizer, documentation or code; all raw."""
    name = PurePosixPath(path).name
    suffix = PurePosixPath(name).suffix.lower()
    if name in _CONFIG_NAMES or suffix == ".json":
        kind = "weight.config"
    elif suffix in _CODE_SUFFIXES:
        kind = "code"
    elif suffix in _DOC_SUFFIXES or name.upper().startswith(("LICENSE", "README", "NOTICE")):
        kind = "doc"
    else:
        kind = "weight"
    return f"application/vnd.cncf.model.{kind}.v1.raw"


def build_of(raw: bytes | None) -> dict[str, Any] | None:
    """The parts of a hive-aot manifest a ModelPack artifact shows ({files, model, format}); None for bytes
    that are not one (any document may sit under any key: the store does not judge what it is given)."""
    try:
        doc = json.loads(raw) if raw else None
        files = [File(str(f["path"]), "sha256:" + f["sha256"], int(f["size"])) for f in doc["files"]]
    except (ValueError, TypeError, KeyError):
        return None
    if not files or any(len(f.digest) != 71 or f.size < 0 for f in files):
        return None
    model = doc.get("model") if isinstance(doc.get("model"), dict) else {}
    return {"files": files, "name": str(model.get("id", "")), "version": str(model.get("revision", "")),
            "format": str(doc.get("format", ""))}


def config_bytes(build: dict[str, Any]) -> bytes:
    descriptor = {k: build[k] for k in ("name", "version") if build.get(k)}
    config = {"format": build["format"]} if build.get("format") in FORMATS else {}
    return json.dumps({"descriptor": descriptor, "config": config,
                       "modelfs": {"type": "layers", "diffIds": [f.digest for f in build["files"]]}},
                      sort_keys=True, separators=(",", ":")).encode()


def _layers(files: list[File]) -> list[dict[str, Any]]:
    return [{"mediaType": layer_type(f.path), "digest": f.digest, "size": f.size,
             "annotations": {A_PATH: f.path, A_TITLE: f.path}} for f in files]


def _text(data: bytes) -> tuple[str, str]:
    try:
        return A_DOC, data.decode("utf-8")
    except UnicodeDecodeError:
        return A_DOC64, base64.b64encode(data).decode()


def _serialize(manifest: dict[str, Any]) -> bytes:
    # serialised once, sent and digested as these exact bytes (the registry stores them byte for byte)
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def compose(key: str, data: bytes, *, build: dict[str, Any] | None = None, config: dict[str, Any] | None = None,
            manifest_doc: bytes | None = None, written: float | None = None) -> bytes:
    """The OCI manifest holding document `data` under store key `key`: a ModelPack artifact when `build` (the
    files it lists; `config`: the config blob's descriptor), else a document artifact with the empty config."""
    field, text = _text(data)
    annotations = {A_KEY: key, field: text}
    if manifest_doc is not None:
        mfield, mtext = _text(manifest_doc)
        annotations[A_MANIFEST if mfield == A_DOC else A_MANIFEST + ".base64"] = mtext
    if written is not None:
        annotations[A_WRITTEN] = f"{written:.3f}"
    if build is not None and config is not None:
        return _serialize({"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "artifactType": MODEL_ARTIFACT,
                           "config": config, "layers": _layers(build["files"]), "annotations": annotations})
    return _serialize({"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "artifactType": DOC_ARTIFACT,
                       "config": EMPTY, "layers": [EMPTY], "annotations": annotations})


def holder(key: str, digest: str, size: int, written: float) -> bytes:
    """The pool's artifact for one blob: its only layer is the blob (so registry GC keeps it)."""
    return _serialize({"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "artifactType": BLOB_ARTIFACT,
                       "config": EMPTY, "layers": [{"mediaType": "application/octet-stream", "digest": digest,
                                                    "size": size}],
                       "annotations": {A_KEY: key, A_WRITTEN: f"{written:.3f}"}})


def read_document(raw: bytes, where: str) -> Document:
    """What an artifact the store wrote holds; an artifact that is not one is one IntegrityError line."""
    try:
        doc = json.loads(raw)
        notes = doc.get("annotations") or {}
        key = notes[A_KEY]
        data = (notes[A_DOC].encode("utf-8") if A_DOC in notes else
                base64.b64decode(notes[A_DOC64], validate=True) if A_DOC64 in notes else None)
        written = float(notes[A_WRITTEN]) if A_WRITTEN in notes else None
        layers = doc.get("layers") or []
        if not isinstance(key, str) or not isinstance(layers, list):
            raise TypeError
    except (ValueError, TypeError, KeyError, AttributeError):
        raise IntegrityError(f"{where} is not an artifact hive-aot wrote (no {A_KEY} annotation): the store is "
                             "damaged or shared with another tool") from None
    return Document(key, data if data is not None else b"", written, layers)
