"""From a published export bundle to a published QPC, on a host with the Cloud AI Apps SDK.

The QPC's build id is the bundle's build id plus the SDK's versions: the same bundle compiled by
another SDK is another QPC, and a compile host needs nothing but the store (not the source model). The
compile inputs are re-derived for the host's SDK (the specialization file format changed in 1.22); the
command actually run is recorded with placeholders. Nothing is published unless the compiler exits 0
and wrote a non-empty `programqpc.bin`; the manifest then carries the vllm-qaic serving binding.
"""

from __future__ import annotations

import json
import shutil
from typing import TYPE_CHECKING, Any

from ...core import settings
from ...core.errors import EngineFailed, NotApplicableError, StoreError
from ...core.hashing import sha256_file, sha256_json
from ...core.paths import work_dir
from ...store import Store, manifest_key, ref_key
from ...store.documents import commit_manifest, load_manifest, materialize_blobs, publish_profiles, repair_commit
from ...store.layout import BUNDLE_TAG_PREFIX, check_binding
from ...store.manifest import FileEntry, Manifest
from .. import HardwareStep
from ..build_result import BuildResult
from .bundle import COMMAND_FILE
from .compile import (
    COMPILE_DIR,
    QPC_DIR,
    CompileOptions,
    Sdk,
    command,
    compile_files,
    fill,
    find_sdk,
    no_sdk_reason,
    run,
    vision_command,
)
from .families import window_served_full
from .layout import BUNDLE_FORMAT, EXPORT_REPORT, ONNX_DIR
from .serving import describe
from .vision.compile import VISION_QPC_DIR, language_onnx

if TYPE_CHECKING:
    from ...config.registry import Config

QPC_FORMAT_VERSION = 1
BUNDLE_LATEST = BUNDLE_TAG_PREFIX + "latest"
PROGRAM = "programqpc.bin"
# What a stand-in compiler (tests, demos without the SDK) writes first in its program file. Its artifact is
# marked in the manifest (`build.stand_in`), and pull refuses it unless told that a stand-in is wanted.
STAND_IN_MARK = b"HIVE-AOT STAND-IN"
SDK_FILE = f"{COMPILE_DIR}/sdk.json"


def qpc_build_id(bundle_build_id: str, sdk: Sdk) -> str:
    return sha256_json({"bundle": bundle_build_id, "toolchain": qpc_toolchain(sdk)})


def qpc_toolchain(sdk: Sdk) -> dict[str, str]:
    return {"hive_aot_qpc_format": str(QPC_FORMAT_VERSION), **sdk.toolchain()}


def bundle_manifest(store: Store, model_id: str, recipe_id: str, build_id: str | None = None) -> Manifest:
    """The published export bundle of a compile recipe: by build id, else its `bundle-latest` ref."""
    if build_id is None:
        ref = store.read_ref(ref_key(model_id, recipe_id, BUNDLE_LATEST))
        if ref is None:
            raise StoreError(f"{model_id}: no export bundle of {recipe_id} is published in {store.uri} "
                             f"(build it first: hive-aot build SOURCE --recipe {recipe_id})")
        build_id = ref["build_id"]
    m = load_manifest(store, manifest_key(model_id, recipe_id, build_id), None, model_id)
    if m.format != BUNDLE_FORMAT:
        raise StoreError(f"{model_id}: build {build_id[:12]} of {recipe_id} is a {m.format}, not an export bundle")
    return m


def _profiles(config: Config | None, recipe_id: str) -> list[dict[str, Any]]:
    """The active runtime profiles of the compile recipe that load QPCs; every active QPC-loading profile
    when this host's configuration does not have the recipe (a compile host with only the store)."""
    if config is None:
        return []
    profiles = config.registry.runtime_profiles
    if recipe_id in config.recipes:
        named = config.recipes[recipe_id].runtime_profiles
        profiles = sorted((p for p in profiles if p.id in named), key=lambda p: named.index(p.id))
    return [p.model_dump(mode="json") for p in profiles if p.active and "qpc" in p.loads]


def compile_bundle(store: Store, bundle: Manifest, sdk: Sdk, config: Config | None = None) -> BuildResult:
    """Compile a published bundle with this host's SDK and publish the QPC (or find it published)."""
    model_id, recipe_id = bundle.model.id, bundle.recipe.id
    opts = CompileOptions.parse(bundle.recipe.options)
    build_id = qpc_build_id(bundle.build_id, sdk)
    key = manifest_key(model_id, recipe_id, build_id)
    where = f"{store.uri.rstrip('/')}/{key}"
    existing = store.read_bytes(key)
    if existing is not None:
        m = Manifest.parse(existing, f"{store.uri}: {key}")
        check_binding(m, key, model_id, store.uri)
        if all(store.blob_intact(f.sha256, f.size) for f in m.files):
            repair_commit(store, m, pending=False)
            return BuildResult(build_id=build_id, model_id=model_id, recipe=recipe_id, manifest=where, skipped=True,
                               state="skipped", validation=m.validation, files=[f.model_dump() for f in m.files], format="qpc")
    store.check_writable()
    what = f"AI 100 compile of {model_id} ({recipe_id}, bundle {bundle.build_id[:12]})"
    with work_dir(f"qpc-{build_id[:12]}-") as work:
        src, art = work / "bundle", work / "artifact"
        materialize_blobs(store, bundle.files, src)
        export_info = json.loads((src / EXPORT_REPORT).read_text())
        layers, vision = int(export_info["layers"]), export_info.get("vision")
        model_config = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else {}
        art.mkdir()
        # Compile inputs for this host's SDK, written into the artifact (never into the linked blobs).
        inputs = compile_files(layers, opts, sdk.version, vision=vision)
        for rel, body in inputs.items():
            (art / rel).parent.mkdir(parents=True, exist_ok=True)
            (art / rel).write_bytes(body)
            # The command reads its inputs beside the ONNX: replace the bundle's links, not their blobs.
            (src / rel).unlink(missing_ok=True)
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(body)
        argv = command(opts, language_onnx(vision, opts), sdk.version, compiler=str(sdk.compiler))
        programs = [(argv, QPC_DIR)]
        if vision is not None and opts.kv_offload:  # a VLM's dual QPC: the vision program beside the language one
            programs.append((vision_command(opts, vision, sdk.version, compiler=str(sdk.compiler)), VISION_QPC_DIR))
        seconds, stand_in = 0.0, False
        for args, out_dir in programs:
            seconds += run(fill(args, src, art / QPC_DIR), work / "compile.log", what,
                           settings.QAIC_COMPILE_TIMEOUT.seconds())
            program = art / out_dir / PROGRAM
            if not program.is_file() or program.stat().st_size == 0:
                raise EngineFailed(f"{what}: the compiler exited 0 but wrote no {out_dir}/{PROGRAM}; nothing was published")
            with open(program, "rb") as f:
                stand_in = stand_in or f.read(len(STAND_IN_MARK)) == STAND_IN_MARK
        recorded = [str(sdk.compiler.name)] + argv[1:]
        doc = {"argv": recorded, "sdk_version": sdk.version}
        if len(programs) > 1:
            doc["vision_argv"] = [str(sdk.compiler.name)] + programs[1][0][1:]
        (art / COMMAND_FILE).write_text(json.dumps(doc, indent=1) + "\n")
        (art / SDK_FILE).write_text(json.dumps(qpc_toolchain(sdk), indent=1, sort_keys=True) + "\n")
        known = {}
        for f in bundle.files:  # config and tokenizer travel with the QPC; the ONNX and bundle inputs do not
            if f.path.startswith((f"{ONNX_DIR}/", f"{COMPILE_DIR}/")) or f.path == EXPORT_REPORT:
                continue
            (art / f.path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / f.path, art / f.path)
            known[f.path] = f.sha256
        entries = []
        for path in sorted(p for p in art.rglob("*") if p.is_file()):
            rel = path.relative_to(art).as_posix()
            digest = known.get(rel) or sha256_file(path)
            store.put_blob(path, digest)
            entries.append(FileEntry(path=rel, sha256=digest, size=path.stat().st_size))
    qpc_files = [e for e in entries if e.path.startswith((f"{QPC_DIR}/", f"{VISION_QPC_DIR}/"))]
    trust = config is not None and model_id in config.registry.trust_remote_code_allowlist
    full = window_served_full(model_config) is not None  # Gemma 2: the server must not window what the graph does not
    serving = {p["id"]: describe(opts, p, model_id, trust, sdk.toolchain(), disable_sliding_window=full,
                                 vision=vision is not None, dual=vision is not None and opts.kv_offload)
               for p in _profiles(config, recipe_id)}
    validation = dict(bundle.validation or {})
    # No timings in the manifest: its bytes are the same for a build id whichever host compiled it.
    validation["qpc"] = {"program_bytes": program_size(qpc_files), "files": len(qpc_files)}
    m = Manifest(
        build_id=build_id, model=bundle.model, recipe=bundle.recipe, runtime_profiles=list(serving), format="qpc",
        files=entries, toolchain={**bundle.toolchain, **qpc_toolchain(sdk)},
        build={"input": {"recipe": recipe_id, "build_id": bundle.build_id, "format": BUNDLE_FORMAT},
               "export": bundle.build.get("input"),
               "compile": {"command": recorded, "sdk": qpc_toolchain(sdk),
                           **({"vision_command": doc["vision_argv"]} if "vision_argv" in doc else {})},
               "state": "compiled",
               **({"stand_in": f"compiled by a stand-in for {sdk.compiler.name}: not a QPC a device can load"}
                  if stand_in else {})},
        validation=validation, serving=serving,
        describe=bundle.describe,  # the bundle's build described the model its compile makes
    )
    commit_manifest(store, m, pending=False)
    if config is not None:
        publish_profiles(store, config.registry.runtime_profiles)
    return BuildResult(build_id=build_id, model_id=model_id, recipe=recipe_id, manifest=where, skipped=False,
                       state="published", files=[e.model_dump() for e in entries], format="qpc",
                       validation={**validation, "qpc": {**validation["qpc"], "compile_seconds": round(seconds, 1)}})


def program_size(entries: list[FileEntry]) -> int:
    return next((e.size for e in entries if e.path == f"{QPC_DIR}/{PROGRAM}"), 0)


class QpcCompile(HardwareStep):
    """The AI 100 compile as the `qaic` kind's hardware step: bundle -> QPC on hosts with the Apps SDK."""

    name = "qpc"
    pool = "ai100_compile"
    needs = "the Cloud AI SDK"

    def missing(self) -> str | None:
        return None if find_sdk() is not None else no_sdk_reason()

    def finish(self, bundle_result: BuildResult, store: Store, config: Config) -> BuildResult:
        """After a bundle is published: compile it here if this host has the SDK, else say it is pending."""
        sdk = find_sdk()
        if sdk is None:
            bundle_result.state = "compile_pending"
            bundle_result.reason = f"exported, compile pending: {no_sdk_reason()}"
            return bundle_result
        res = compile_bundle(store, bundle_manifest(store, bundle_result.model_id, bundle_result.recipe,
                                                    bundle_result.build_id), sdk, config)
        res.bundle, res.input = bundle_result, bundle_result.input
        return res

    def finish_published(self, model_id: str, config: Config, store: Store, recipe: str | None = None,
                         input_build_id: str | None = None) -> list[BuildResult]:
        """The published bundles of the model (one recipe, or every qaic recipe that has one), compiled with
        this host's SDK and published as QPCs."""
        sdk = find_sdk()
        if sdk is None:
            raise NotApplicableError(f"cannot compile for AI 100 here: {no_sdk_reason()}; set HIVE_AOT_QAIC_SDK "
                                     "or run this on a host with the Apps SDK")
        if recipe is not None:
            recipes = [recipe]
        else:
            recipes = sorted(r.id for r in config.recipes.values() if r.kind == "qaic")
            recipes = [r for r in recipes if store.read_ref(ref_key(model_id, r, BUNDLE_LATEST)) is not None]
            if not recipes:
                raise StoreError(f"{model_id}: no export bundle is published in {store.uri} "
                                 "(hive-aot build SOURCE --recipe qaic-mxfp6 publishes one)")
        return [compile_bundle(store, bundle_manifest(store, model_id, r, input_build_id), sdk, config)
                for r in recipes]
