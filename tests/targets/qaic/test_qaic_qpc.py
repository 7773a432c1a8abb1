"""From a published export bundle to a published QPC (pipelines/targets/qaic/qpc.py), in process, on a store
written here: a two-layer retained-state ONNX graph made with onnx.helper, its compile inputs, config and
tokenizer, published as a bundle. The end-to-end path from a real model (build, CLI, pull) is
tests/targets/qaic/test_qaic_compile.py's.

The Apps SDK cannot exist on these machines: the compiler is tests/support/qaic_standin.py, a labelled STAND-IN that
checks its flags and inputs against the ONNX and writes a placeholder marked "NOT A QPC". Where a test needs a
compiler that misbehaves (exits 0 without a program, or writes an unmarked one), `scripted_sdk` puts a few
lines of Python in the stand-in's place, labelled the same way.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import yaml
from qaic_standin import LABEL, make_sdk

from pipelines.core.errors import EngineFailed, NotApplicableError, StoreError
from pipelines.store import manifest_key, open_store, ref_key
from pipelines.store.layout import ref_document
from pipelines.store.manifest import FileEntry, Manifest, ModelInfo, RecipeInfo
from pipelines.targets.qaic.compile import CompileOptions, compile_files, find_sdk
from pipelines.targets.qaic.qpc import QpcCompile, bundle_manifest, compile_bundle

MODEL, RECIPE = "test-org/qpc-tiny", "qaic-tiny"
COMMIT = "c0ffee" + "0" * 34
LAYERS = 2
OPTIONS = {"num_cores": 4, "ctx_len": 64, "prefill_seq_len": 16, "batch_size": 1, "full_batch_size": 2,
           "num_devices": 1, "mxfp6": True, "mxint8": True, "sdk_version": "1.22"}
PREDICTION = {"emulated": ["mxfp6 weights", "mxint8 kv cache"], "top1": 0.97, "kl": 0.01}
CARRIED = {"config.json": b'{"model_type": "llama", "num_hidden_layers": 2}\n', "tokenizer.json": b'{"version": "1.0"}\n'}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def retained_state_onnx() -> bytes:
    """The interface a retained-state decoder exports (every dynamic axis a specialization sets, batch_index for
    continuous batching, past_* in and *_RetainedState out per layer), with Identity bodies: the compile step
    only hands the graph to the compiler."""
    from onnx import TensorProto, helper

    def value(name, elem, dims):
        return helper.make_tensor_value_info(name, elem, dims)

    inputs = [value("input_ids", TensorProto.INT64, ["batch_size", "seq_len"]),
              value("position_ids", TensorProto.INT64, ["batch_size", "seq_len"]),
              value("batch_index", TensorProto.INT64, ["batch_size", 1])]
    outputs = [value("logits", TensorProto.INT64, ["batch_size", "seq_len"])]
    nodes = [helper.make_node("Identity", ["input_ids"], ["logits"])]
    for i in range(LAYERS):
        for kv in ("key", "value"):
            name = f"past_{kv}.{i}"
            inputs.append(value(name, TensorProto.FLOAT, ["full_batch_size", 2, "ctx_len", 8]))
            outputs.append(value(f"{name}_RetainedState", TensorProto.FLOAT, ["full_batch_size", 2, "ctx_len", 8]))
            nodes.append(helper.make_node("Identity", [name], [f"{name}_RetainedState"]))
    graph = helper.make_graph(nodes, "decoder", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def bundle_files() -> dict[str, bytes]:
    """What a bundle holds: the ONNX, the export report, config and tokenizer, the compile inputs for SDK 1.22."""
    files = {"onnx/model.onnx": retained_state_onnx(), "export.json": json.dumps({"layers": LAYERS}).encode(),
             **CARRIED, **compile_files(LAYERS, CompileOptions.parse(OPTIONS))}
    files["compile/command.json"] = b'{"argv": ["qaic-compile"]}\n'
    return files


def publish_bundle(root: Path) -> tuple[object, Manifest]:
    """A local store holding one published export bundle of MODEL (blobs, manifest, bundle-* refs)."""
    store = open_store(str(root / "store"))
    staging = root / "bundle-files"
    entries = []
    for rel, body in sorted(bundle_files().items()):
        path = staging / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
        store.put_blob(path, sha256(body))
        entries.append(FileEntry(path=rel, sha256=sha256(body), size=len(body)))
    build_id = sha256(b"the export bundle's build")
    m = Manifest(build_id=build_id, format="qaic-export-bundle", files=entries, runtime_profiles=[],
                 model=ModelInfo(id=MODEL, revision="main", commit=COMMIT, source="test", content_digest=sha256(b"src")),
                 recipe=RecipeInfo(id=RECIPE, kind="qaic", digest=sha256(b"recipe"), options=OPTIONS),
                 toolchain={"hive_aot_test": "1"}, build={"state": "compile_pending", "needs": "the Cloud AI SDK"},
                 validation={"mxfp6": PREDICTION})
    store.write_bytes(manifest_key(MODEL, RECIPE, build_id), m.to_bytes())
    for tag in (f"bundle-{COMMIT}", "bundle-latest"):
        store.write_bytes(ref_key(MODEL, RECIPE, tag), ref_document(MODEL, RECIPE, m))
    return store, m


@pytest.fixture
def bundle(tmp_path):
    return publish_bundle(tmp_path)


@pytest.fixture
def sdk(tmp_path, monkeypatch):
    """The stand-in compiler in an SDK-shaped directory (Apps SDK 1.22.0), found by find_sdk()."""
    root = make_sdk(tmp_path / "sdk-1.22", "1.22.0")
    monkeypatch.setenv("HIVE_AOT_QAIC_SDK", str(root))
    return find_sdk()


def scripted_sdk(root: Path, program: bytes | None):
    """STAND-IN compiler that ignores its inputs: exits 0 having written `program` as programqpc.bin (None:
    nothing at all). For the publish conditions only; qaic_standin.py is the one that checks inputs."""
    make_sdk(root, "1.22.0")
    script = root / "exec" / "qaic-compile"
    write = "" if program is None else (
        f"out = pathlib.Path(next(a.split('=', 1)[1] for a in sys.argv if a.startswith('-aic-binary-dir=')))\n"
        f"out.mkdir(parents=True, exist_ok=True)\n(out / 'programqpc.bin').write_bytes({program!r})\n")
    script.write_text(f"#!{sys.executable}\n# STAND-IN for qaic-compile (tests/targets/qaic/test_qaic_qpc.py): NOT a compiler\n"
                      f"import pathlib, sys\n{write}")
    script.chmod(0o755)


def blob(store_root: Path, digest: str) -> Path:
    return store_root / "blobs" / "sha256" / digest[:2] / digest


def stored_manifest(store, build_id: str) -> Manifest:
    return Manifest.parse(store.read_bytes(manifest_key(MODEL, RECIPE, build_id)), "test")


def ref_build(store, tag: str) -> str | None:
    ref = store.read_ref(ref_key(MODEL, RECIPE, tag))
    return None if ref is None else ref["build_id"]


def test_a_published_bundle_compiles_into_a_published_qpc(bundle, sdk, tmp_path):
    store, b = bundle
    res = compile_bundle(store, b, sdk)
    assert res.state == "published" and res.format == "qpc" and not res.skipped and res.build_id != b.build_id
    m = stored_manifest(store, res.build_id)
    files = {f.path: f for f in m.files}
    # what serves: the program, its compile inputs and the SDK, config and tokenizer; never the ONNX or the report
    assert set(files) == {"qpc/programqpc.bin", "compile/specializations.json", "compile/custom_io.yaml",
                          "compile/command.json", "compile/sdk.json", "config.json", "tokenizer.json"}
    for path, body in CARRIED.items():
        assert files[path].sha256 == sha256(body) and files[path].size == len(body)
    for f in m.files:  # every listed file is in the store under its digest, whole
        data = blob(tmp_path / "store", f.sha256).read_bytes()
        assert sha256(data) == f.sha256 and len(data) == f.size, f.path
    program = blob(tmp_path / "store", files["qpc/programqpc.bin"].sha256).read_bytes()
    assert program.startswith(LABEL)  # the stand-in's placeholder: marked so that pull refuses it by default
    assert "stand-in" in m.build["stand_in"] and "qaic-compile" in m.build["stand_in"]
    assert m.validation["qpc"] == {"program_bytes": len(program), "files": 1}
    assert m.validation["mxfp6"] == PREDICTION  # the bundle's prediction travels with the QPC
    assert res.validation["qpc"]["compile_seconds"] >= 0  # reported, never in the manifest's bytes
    assert m.build["input"] == {"recipe": RECIPE, "build_id": b.build_id, "format": "qaic-export-bundle"}
    # the SDK as its versions/*.xml name it (make_sdk: base_version 1.22, build_id 0)
    sdk_doc = json.loads(blob(tmp_path / "store", files["compile/sdk.json"].sha256).read_text())
    assert sdk_doc["qaic_apps_sdk"] == sdk_doc["qaic_platform_sdk"] == "1.22.0"
    assert sdk_doc["qaic_compiler"] == "qaic-compile" and m.toolchain["qaic_apps_sdk"] == "1.22.0"
    # the command as run, with placeholders and the compiler's bare name: nothing of this host's paths
    recorded = m.build["compile"]["command"]
    assert recorded[0] == "qaic-compile" and "-m={bundle}/onnx/model.onnx" in recorded
    assert "-aic-binary-dir={qpc}" in recorded and not any(str(tmp_path) in a for a in recorded)
    assert json.loads(blob(tmp_path / "store", files["compile/command.json"].sha256).read_text())["argv"] == recorded
    # the QPC takes `latest` and the commit's tag; the bundle keeps its own
    assert ref_build(store, "latest") == ref_build(store, COMMIT) == res.build_id
    assert ref_build(store, "bundle-latest") == b.build_id
    # no runtime profiles without a configuration: nothing claims to serve it
    assert m.runtime_profiles == [] and m.serving == {}


def test_the_same_bundle_and_sdk_is_the_same_qpc_and_refs_are_repaired(bundle, sdk, tmp_path):
    store, b = bundle
    first = compile_bundle(store, b, sdk)
    manifest_bytes = store.read_bytes(manifest_key(MODEL, RECIPE, first.build_id))
    store.delete(ref_key(MODEL, RECIPE, "latest"))  # as an interrupted publish leaves it
    again = compile_bundle(store, b, sdk)
    assert again.skipped and again.state == "skipped" and again.build_id == first.build_id
    assert ref_build(store, "latest") == first.build_id  # repaired
    assert store.read_bytes(manifest_key(MODEL, RECIPE, first.build_id)) == manifest_bytes


def test_a_damaged_qpc_blob_is_compiled_again_not_skipped(bundle, sdk, tmp_path):
    store, b = bundle
    first = compile_bundle(store, b, sdk)
    entry = next(f for f in stored_manifest(store, first.build_id).files if f.path == "qpc/programqpc.bin")
    path = blob(tmp_path / "store", entry.sha256)
    path.chmod(0o644)
    path.write_bytes(b"\0" * entry.size)  # same size, other bytes: only the content check sees it
    again = compile_bundle(store, b, sdk)
    assert not again.skipped and again.state == "published" and again.build_id == first.build_id
    # the manifest now names a program that is whole (the stand-in's bytes name its work directory, so a
    # recompile's program may be another blob: the manifest follows it)
    for f in stored_manifest(store, again.build_id).files:
        assert sha256(blob(tmp_path / "store", f.sha256).read_bytes()) == f.sha256, f.path


def test_another_sdk_is_another_qpc_and_the_bundles_blobs_stay_as_published(bundle, sdk, tmp_path, monkeypatch):
    """An SDK before 1.22 reads the flat specialization list and compiles with qaic-exec -compile-only: the
    inputs are re-derived for it into the QPC, while the bundle's blobs (hard-linked into the compile's work
    directory) keep the bytes they were published with."""
    store, b = bundle
    modern = compile_bundle(store, b, sdk)
    monkeypatch.setenv("HIVE_AOT_QAIC_SDK", str(make_sdk(tmp_path / "sdk-1.20", "1.20.2.0")))
    legacy = compile_bundle(store, b, find_sdk())
    assert legacy.build_id not in (modern.build_id, b.build_id)
    m = stored_manifest(store, legacy.build_id)
    files = {f.path: f for f in m.files}
    specs = json.loads(blob(tmp_path / "store", files["compile/specializations.json"].sha256).read_text())
    assert specs["specializations"][0] == {"batch_size": "1", "seq_len": "16", "ctx_len": "64", "full_batch_size": "2"}
    assert m.build["compile"]["command"][0] == "qaic-exec" and "-compile-only" in m.build["compile"]["command"]
    assert m.toolchain["qaic_apps_sdk"] == "1.20.2.0"
    for f in b.files:
        assert sha256(blob(tmp_path / "store", f.sha256).read_bytes()) == f.sha256, f.path
    assert ref_build(store, "latest") == legacy.build_id  # the last compile published moves latest


@pytest.mark.parametrize("program", [None, b""], ids=["no-program", "empty-program"])
def test_a_compiler_that_exits_0_without_a_program_publishes_nothing(bundle, program, tmp_path, monkeypatch):
    store, b = bundle
    scripted_sdk(tmp_path / "sdk", program)
    monkeypatch.setenv("HIVE_AOT_QAIC_SDK", str(tmp_path / "sdk"))
    before = sorted(p.relative_to(tmp_path / "store") for p in (tmp_path / "store").rglob("*"))
    with pytest.raises(EngineFailed) as e:
        compile_bundle(store, b, find_sdk())
    msg = str(e.value)
    assert "\n" not in msg and "wrote no qpc/programqpc.bin; nothing was published" in msg
    assert msg.startswith(f"AI 100 compile of {MODEL} ({RECIPE}, bundle {b.build_id[:12]})")
    assert sorted(p.relative_to(tmp_path / "store") for p in (tmp_path / "store").rglob("*")) == before


def test_a_real_compilers_program_is_not_marked_as_a_stand_in(bundle, tmp_path, monkeypatch):
    store, b = bundle
    scripted_sdk(tmp_path / "sdk", b"QPC\x01" + bytes(60))  # anything but the stand-in's label
    monkeypatch.setenv("HIVE_AOT_QAIC_SDK", str(tmp_path / "sdk"))
    res = compile_bundle(store, b, find_sdk())
    m = stored_manifest(store, res.build_id)
    assert "stand_in" not in m.build and m.validation["qpc"]["program_bytes"] == 64


def test_a_bundle_blob_that_changed_is_refused_before_compiling(bundle, sdk, tmp_path):
    store, b = bundle
    onnx_entry = next(f for f in b.files if f.path == "onnx/model.onnx")
    path = blob(tmp_path / "store", onnx_entry.sha256)
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError) as e:
        compile_bundle(store, b, sdk)
    assert "\n" not in str(e.value) and "blob for onnx/model.onnx does not match its manifest digest" in str(e.value)
    assert ref_build(store, "latest") is None and len(store.list(f"manifests/test-org--qpc-tiny/{RECIPE}/")) == 1


def test_bundle_manifest_finds_the_bundle_and_refuses_what_is_not_one(bundle, sdk, tmp_path):
    store, b = bundle
    assert bundle_manifest(store, MODEL, RECIPE).build_id == b.build_id  # by bundle-latest
    assert bundle_manifest(store, MODEL, RECIPE, b.build_id).build_id == b.build_id
    with pytest.raises(StoreError) as e:
        bundle_manifest(store, MODEL, "qaic-other")
    assert "\n" not in str(e.value)
    assert f"{MODEL}: no export bundle of qaic-other is published" in str(e.value)
    assert "hive-aot build SOURCE --recipe qaic-other" in str(e.value)
    qpc = compile_bundle(store, b, sdk)
    with pytest.raises(StoreError, match=rf"build {qpc.build_id[:12]} of {RECIPE} is a qpc, not an export bundle"):
        bundle_manifest(store, MODEL, RECIPE, qpc.build_id)


def test_the_hardware_step_without_an_sdk_leaves_the_bundle_pending(bundle, config, tmp_path, monkeypatch):
    from pipelines.targets.build_result import BuildResult

    store, b = bundle
    monkeypatch.setenv("HIVE_AOT_QAIC_SDK", str(tmp_path / "no-sdk"))
    step = QpcCompile()
    assert "no Cloud AI SDK on this host" in step.missing()
    pending = BuildResult(build_id=b.build_id, model_id=MODEL, recipe=RECIPE, manifest="m", skipped=False,
                          state="published", format="qaic-export-bundle")
    out = step.finish(pending, store, config)
    assert out is pending and out.state == "compile_pending"
    assert out.reason.startswith("exported, compile pending: no Cloud AI SDK on this host")
    with pytest.raises(NotApplicableError, match="cannot compile for AI 100 here: no Cloud AI SDK"):
        step.finish_published(MODEL, config, store)
    assert ref_build(store, "latest") is None


def test_the_hardware_step_compiles_for_the_registrys_qpc_profiles(bundle, sdk, config, tmp_path):
    """On an SDK host, a recipe this registry does not define gets every active profile that loads QPCs (read
    from registry.yaml here); a model with no bundle of any AI 100 recipe is one line saying how to make one."""
    store, b = bundle
    step = QpcCompile()
    assert step.missing() is None
    (res,) = step.finish_published(MODEL, config, store, recipe=RECIPE)
    profiles = yaml.safe_load((Path.cwd() / "registry.yaml").read_text())["runtime_profiles"]
    qpc_profiles = [p["id"] for p in profiles if "qpc" in p.get("loads", []) and p.get("active", True)]
    m = stored_manifest(store, res.build_id)
    assert qpc_profiles and m.runtime_profiles == qpc_profiles == list(m.serving)
    serving = m.serving[qpc_profiles[0]]
    assert serving["engine_args"]["max_model_len"] == OPTIONS["ctx_len"]
    assert serving["engine_args"]["max_num_seqs"] == OPTIONS["full_batch_size"]
    with pytest.raises(StoreError) as e:
        step.finish_published("test-org/no-bundles", config, store)
    assert "\n" not in str(e.value) and "test-org/no-bundles: no export bundle is published" in str(e.value)
