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

Two clients read one artifact two ways: hive-aot its document annotation, every other OCI client its layers and
config. A registry accepts any manifest, so one whose layers were rewritten to another model's blobs would give
the two different models under one tag; check_view refuses, on every read, an artifact whose layers and config
are not exactly what its document makes.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import PurePosixPath
from typing import Any, NamedTuple

from ..core.errors import IntegrityError

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
_CONFIG_NAMES = {"hive-aot.manifest.json", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
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


MANIFEST_FILE = "hive-aot.manifest.json"  # the build's manifest as a file of the artifact (what OMS signs with it)
_PARAM_UNITS = ((10**15, "Q"), (10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K"))


def build_of(raw: bytes | None) -> dict[str, Any] | None:
    """The parts of a hive-aot manifest a ModelPack artifact shows ({files, the manifest as a file, what the config
    describes}); None for bytes that are not one (any document may sit under any key: the store does not judge what
    it is given)."""
    try:
        doc = json.loads(raw) if raw else None
        files = [File(str(f["path"]), "sha256:" + f["sha256"], int(f["size"])) for f in doc["files"]]
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
    if not files or any(len(f.digest) != 71 or f.size < 0 for f in files):
        return None
    model = doc.get("model") if isinstance(doc.get("model"), dict) else {}
    described = doc.get("describe") if isinstance(doc.get("describe"), dict) else {}
    return {"files": files, "name": str(model.get("id", "")), "version": str(model.get("revision", "")),
            "format": str(doc.get("format", "")),
            "manifest": File(MANIFEST_FILE, "sha256:" + hashlib.sha256(raw).hexdigest(), len(raw)),
            "model": model, "describe": described}


def param_size(count: Any) -> str:
    """ModelPack's paramSize (`<count><Q|T|B|M|K>`, the count with at most one digit after the point, the spec
    says) of a parameter count: 134515008 -> "135M", 7615616512 -> "7.6B", 70553706496 -> "70.6B"; "" below
    1000 (no such count can say it)."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1000:
        return ""
    bigger = ""
    for scale, unit in _PARAM_UNITS:  # the largest unit the count reaches
        if count >= scale:
            value = count / scale
            text = f"{value:.0f}" if value >= 99.95 else f"{value:.1f}".removesuffix(".0")
            return f"1{bigger}" if text == "1000" and bigger else text + unit  # 999.96M rounds to 1B
        bigger = unit
    return ""


def config_bytes(build: dict[str, Any], created_at: str | None = None, *, legacy: bool = False) -> bytes:
    """The ModelPack config of a build: what the build knows of the model (name, family, source revision,
    licences, architecture, parameter count, precision, quantization, format) and the diffIds of its layers,
    the manifest's own layer included. `created_at` (RFC 3339): when the document was written (a ref's time; a
    build's manifest has none, its bytes being deterministic). `legacy`: the thin config of artifacts written
    before the manifest became a layer (name, version, format, the files' diffIds), which readers still accept."""
    if legacy:
        descriptor: dict[str, Any] = {k: build[k] for k in ("name", "version") if build.get(k)}
        config: dict[str, Any] = {"format": build["format"]} if build.get("format") in FORMATS else {}
        diff_ids = [f.digest for f in build["files"]]
    else:
        model, described = build.get("model") or {}, build.get("describe") or {}
        descriptor = {"name": build.get("name"), "family": described.get("family"),
                      "revision": model.get("commit"), "createdAt": created_at}
        if isinstance(model.get("license"), str) and model["license"].strip():
            descriptor["licenses"] = [model["license"].strip()]
        config = {"architecture": described.get("architecture"), "paramSize": param_size(described.get("parameters")),
                  "precision": described.get("precision"), "quantization": described.get("quantization"),
                  "format": build["format"] if build.get("format") in FORMATS else None}
        descriptor = {k: v for k, v in descriptor.items() if isinstance(v, (str, list)) and v}
        config = {k: v for k, v in config.items() if isinstance(v, str) and v}
        diff_ids = [f.digest for f in [*build["files"], build["manifest"]]]
    return json.dumps({"descriptor": descriptor, "config": config,
                       "modelfs": {"type": "layers", "diffIds": diff_ids}},
                      sort_keys=True, separators=(",", ":")).encode()


def config_descriptor(cfg: bytes) -> dict[str, Any]:
    return {"mediaType": MODEL_CONFIG, "digest": "sha256:" + hashlib.sha256(cfg).hexdigest(), "size": len(cfg)}


def artifact_files(build: dict[str, Any], *, legacy: bool = False) -> list[File]:
    """The files an artifact of the build holds as layers: the build's, then (since format 2) its manifest."""
    return list(build["files"]) if legacy else [*build["files"], build["manifest"]]


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
                           "config": config, "layers": _layers(artifact_files(build)), "annotations": annotations})
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
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        raise IntegrityError(f"{where} is not an artifact hive-aot wrote (no {A_KEY} annotation): the store is "
                             "damaged or shared with another tool") from None
    return Document(key, data if data is not None else b"", written, layers)


def ref_field(ref: bytes, name: str) -> str | None:
    """A string field of a ref document (`manifest`: the key it names, `manifest_sha256`, `created_at`: what its
    artifact's config records as createdAt); None when absent or not a ref document."""
    try:
        value = json.loads(ref).get(name)
    except (ValueError, AttributeError, RecursionError):
        return None
    return value if isinstance(value, str) else None


def annotation(notes: dict[str, Any], name: str) -> bytes | None:
    try:
        if isinstance(notes.get(name), str):
            return notes[name].encode("utf-8")
        if isinstance(notes.get(name + ".base64"), str):
            return base64.b64decode(notes[name + ".base64"], validate=True)
    except ValueError:
        pass
    return None


def _seen(descriptor: Any) -> tuple[Any, ...]:
    """What a client takes from a descriptor: media type, digest, size, the file path it writes the blob to."""
    if not isinstance(descriptor, dict):
        return (None,)
    notes = descriptor.get("annotations") if isinstance(descriptor.get("annotations"), dict) else {}
    return descriptor.get("mediaType"), descriptor.get("digest"), descriptor.get("size"), notes.get(A_PATH)


def check_view(raw: bytes, doc: Document, kind: str, where: str, digest: str = "") -> None:
    """Refuse (one IntegrityError line) an artifact whose OCI view is not what its hive-aot document makes: a build
    manifest's (`kind` "manifest") layers and config are its files', a ref's those of the manifest it carries
    (which must be the one the ref names, by sha256), any other document's the empty ones, a blob holder's
    one layer the blob `digest` of its key. `raw`: the manifest bytes read_document read `doc` from."""
    manifest = json.loads(raw)
    notes = manifest.get("annotations") if isinstance(manifest.get("annotations"), dict) else {}
    layers = manifest.get("layers") if isinstance(manifest.get("layers"), list) else None
    problem = ""
    if kind == "blob":
        if layers is None or len(layers) != 1 or _seen(layers[0])[1] != digest:
            problem = f"its layer is not blob {digest[7:19]}"
    else:
        build, named = None, None
        if kind == "manifest":
            build = build_of(doc.data)
        elif kind == "ref":
            named = annotation(notes, A_MANIFEST)
            build = build_of(named)
            want = ref_field(doc.data, "manifest_sha256")
            if named is not None and want is not None and hashlib.sha256(named).hexdigest() != want:
                problem = "the manifest it carries is not the one its document names"
        if build is None:
            views = [([EMPTY], EMPTY)]
        else:
            created = ref_field(doc.data, "created_at") if kind == "ref" else None
            views = [(_layers(artifact_files(build, legacy=old)), config_descriptor(config_bytes(build, created, legacy=old)))
                     for old in (False, True)]
        seen_layers = None if layers is None else [_seen(x) for x in layers]
        match = [config for expected, config in views if seen_layers == [_seen(x) for x in expected]]
        if not match:
            problem = problem or "its layers are not the files its document names"
        elif _seen(manifest.get("config")) != _seen(match[0]):
            problem = problem or "its config is not the one its document makes"
    if problem:
        raise IntegrityError(f"{where}: {problem}: another OCI client would pull something else than hive-aot "
                             "(rewritten in the registry?); refusing it")
