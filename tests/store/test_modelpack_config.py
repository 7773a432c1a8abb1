"""The ModelPack config of what the OCI store publishes (pipelines/store/oci_modelpack.py), filled from the manifest's
`describe` section (pipelines/engine/model_description.py, each kind's `describe_weights`).

A tiny Llama with a model card licence is built and published to a real registry (Distribution 2.8); skopeo, an
independent client, reads the config blobs back: family, architecture, paramSize, precision, quantization,
format, licences, revision and createdAt, valid against ModelPack's own JSON schema (tests/data/modelpack, vendored
unchanged from modelpack/model-spec). The parameter count is checked against the safetensors library's shapes,
paramSize against the spec's grammar. Manifests written before `describe` keep their exact bytes (a ref names
their sha256), and each kind says what its recipes' weights are.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import uuid
from datetime import datetime
from pathlib import Path

import pytest
from factories import write_test_config

from pipelines.config.kinds import target_for
from pipelines.config.registry import Config
from pipelines.engine.build import build_and_publish
from pipelines.store import manifest_key, open_store
from pipelines.store.layout import ref_document
from pipelines.store.manifest import Manifest
from pipelines.store.oci_modelpack import param_size
from pipelines.targets import Target

REPO = Path.cwd()
SCHEMA = Path(__file__).resolve().parents[1] / "data" / "modelpack" / "config-schema.json"
SCHEMA_SHA256 = "2b47aec475d4e1d82075a1ac414e4b42830ca89f701da47c84425a336ef6a2c3"  # model-spec d78bf32's file
MODEL, SLUG = "test-org/Tiny-Described", "test-org--tiny-described"
RECIPE = "gguf-q8_0"  # quantized, so precision and quantization say something; written directly (cheap)
# ModelPack's precision table (docs/config.md), then what describe_weights adds: N-bit integer codes, MX elements
PRECISIONS = {"float32", "float64", "float16", "bfloat16", "float8_e4m3", "float8_e5m2", "complex32", "complex64",
              "complex128", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"}
EXTENDED = {"int2", "int3", "int4", "int5", "int6", "float6_e2m3", ""}
PARAM_SIZE = re.compile(r"^[0-9]+(\.[0-9])?[QTBMKqtbmk]$")  # the spec: a count with at most one decimal, a prefix


def _skopeo_config(ref: str) -> dict:
    proc = subprocess.run(["skopeo", "inspect", "--raw", "--config", "--tls-verify=false", f"docker://{ref}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _schema_errors(doc: dict) -> list[str]:
    from jsonschema import Draft202012Validator

    schema = json.loads(SCHEMA.read_text())
    return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in Draft202012Validator(schema).iter_errors(doc)]


def _source_parameters(model_dir: Path) -> int:
    """The checkpoint's parameter count from the safetensors library's own header reading."""
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "np") as f:
            for name in f.keys():
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


@pytest.fixture(scope="module")
def published(oci_registry, tiny_llama, tmp_path_factory):
    """The tiny Llama, with a model card that names its licence, built as gguf-q8_0 into a fresh oci:// store."""
    root = tmp_path_factory.mktemp("modelpack-config")
    source = root / "tiny-described"
    shutil.copytree(tiny_llama, source)
    (source / "README.md").write_text("---\nlicense: apache-2.0\n---\n# A tiny Llama\n")
    uri = f"oci://{oci_registry}/hive-{uuid.uuid4().hex[:8]}"
    config = Config.load(write_test_config(root / "cfg", REPO))
    res = build_and_publish(str(source), RECIPE, config, uri, MODEL)
    assert res.state == "published", res
    return {"uri": uri, "repo": f"{oci_registry}/{uri.rsplit('/', 1)[1]}/{SLUG}", "res": res, "source": source}


def test_the_manifest_records_what_the_model_is(published):
    res, source = published["res"], published["source"]
    raw = open_store(published["uri"]).read_bytes(manifest_key(MODEL, RECIPE, res.build_id))
    described = json.loads(raw)["describe"]
    assert described == {"family": "llama", "architecture": "LlamaForCausalLM",
                         "parameters": _source_parameters(source), "precision": "int8", "quantization": "gguf-q8_0"}


def test_a_refs_config_read_back_through_the_registry_is_complete_and_valid(published):
    res, repo = published["res"], published["repo"]
    store = open_store(published["uri"])
    manifest = json.loads(store.read_bytes(manifest_key(MODEL, RECIPE, res.build_id)))
    ref = store.read_ref(f"refs/{MODEL.replace('/', '--')}/{RECIPE}/latest")
    config = _skopeo_config(f"{repo}:{RECIPE}.latest")
    assert _schema_errors(config) == []
    count = _source_parameters(published["source"])
    assert 10**6 <= count < 10**7  # so the expected paramSize below is in millions
    assert config["descriptor"] == {"name": MODEL, "family": "llama", "revision": manifest["model"]["commit"],
                                    "licenses": ["apache-2.0"], "createdAt": ref["created_at"]}
    assert config["config"] == {"architecture": "LlamaForCausalLM", "paramSize": f"{count / 10**6:.1f}M",
                                "precision": "int8", "quantization": "gguf-q8_0", "format": "gguf"}
    assert PARAM_SIZE.match(config["config"]["paramSize"])
    created = datetime.fromisoformat(config["descriptor"]["createdAt"])  # RFC 3339 with its offset
    assert created.utcoffset() is not None
    layers = json.loads(subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false",
                                        f"docker://{repo}:{RECIPE}.latest"], capture_output=True, text=True,
                                       timeout=120, check=True).stdout)["layers"]
    assert config["modelfs"] == {"type": "layers", "diffIds": [layer["digest"] for layer in layers]}


def test_the_build_manifests_own_config_has_no_time(published):
    """The `_m.` artifact's bytes are deterministic for a build id: the same description, no createdAt."""
    res, repo = published["res"], published["repo"]
    config = _skopeo_config(f"{repo}:_m.{RECIPE}.{res.build_id}")
    assert _schema_errors(config) == []
    assert "createdAt" not in config["descriptor"] and config["descriptor"]["family"] == "llama"
    assert config["config"]["quantization"] == "gguf-q8_0"


def test_the_vendored_schema_is_model_specs_and_refuses_what_the_spec_forbids():
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == SCHEMA_SHA256
    good = {"descriptor": {"name": "m"}, "config": {"paramSize": "7.6B"}, "modelfs": {"type": "layers", "diffIds": ["sha256:0"]}}
    assert _schema_errors(good) == []
    for bad in ({**good, "extra": 1}, {**good, "config": {"parameters": 7}}, {k: good[k] for k in ("descriptor", "config")},
                {**good, "modelfs": {"type": "layers", "diffIds": []}}, {**good, "descriptor": {"name": ""}}):
        assert _schema_errors(bad), bad


@pytest.mark.parametrize("count,text", [
    (134515008, "135M"), (7615616512, "7.6B"), (70553706496, "70.6B"), (8030261248, "8B"), (1_230_000, "1.2M"),
    (99_940_000, "99.9M"), (99_960_000, "100M"), (999_960_000, "1B"), (1000, "1K"), (405 * 10**9, "405B"),
    (10**18, "1000Q"),
])
def test_param_size_has_at_most_one_decimal(count, text):
    assert param_size(count) == text
    assert PARAM_SIZE.match(text)


@pytest.mark.parametrize("count", [0, -5, 999, None, "7B", 7.6e9, True])
def test_param_size_of_no_usable_count_is_empty(count):
    assert param_size(count) == ""


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
WHISPER = {"architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper"}
GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}


@pytest.mark.parametrize("recipe,model_config,precision,quantization", [
    ("gguf-f16", LLAMA, "float16", ""), ("gguf-bf16", LLAMA, "bfloat16", ""), ("gguf-q8_0", LLAMA, "int8", "gguf-q8_0"),
    ("gguf-q4_0", LLAMA, "int4", "gguf-q4_0"), ("gguf-q4_k_m", LLAMA, "int4", "gguf-q4_k_m"),
    ("gguf-q6_k", LLAMA, "int6", "gguf-q6_k"), ("gguf-q2_k", LLAMA, "int2", "gguf-q2_k"),
    ("gguf-iq2_xs", LLAMA, "", "gguf-iq2_xs"),  # codebook indices: no integer type
    ("gguf-f16", GPT_OSS, "", "mxfp4"),  # the experts kept MXFP4 as stored
    ("vllm-bf16", LLAMA, "bfloat16", ""), ("vllm-fp8", LLAMA, "float8_e4m3", "fp8"),
    ("vllm-w4a16", LLAMA, "int4", "gptq"), ("vllm-w8a8-int8", LLAMA, "int8", "w8a8-int8"),
    ("qaic-export", LLAMA, "float16", ""), ("qaic-export", WHISPER, "float32", ""),
    ("qaic-mxfp6", LLAMA, "float6_e2m3", "mxfp6"), ("qaic-fp16", LLAMA, "float16", ""),
    ("qaic-whisper-fp16", WHISPER, "float16", ""),
])
def test_each_kind_describes_its_recipes_weights(config, recipe, model_config, precision, quantization):
    r = config.recipes[recipe]
    assert target_for(r.kind).describe_weights(r.options, model_config) == {"precision": precision,
                                                                             "quantization": quantization}


def test_every_recipe_says_a_precision_in_modelpacks_words(config):
    for r in config.recipes.values():
        said = target_for(r.kind).describe_weights(r.options, LLAMA)
        assert set(said) == {"precision", "quantization"} and said["precision"] in PRECISIONS | EXTENDED, (r.id, said)
        assert said["quantization"] == "" or said["precision"] != "float32", r.id  # nothing quantized stays fp32


def test_a_kind_that_says_nothing_describes_nothing():
    assert Target.describe_weights({"any": 1}, LLAMA) == {"precision": "", "quantization": ""}


def _old_manifest_bytes() -> bytes:
    """A manifest as hive-aot wrote it before `describe` (every field it had, canonical JSON and a newline),
    written here by hand: the bytes a store already holds."""
    doc = {"schema_version": 1, "build_id": "ab" * 32,
           "model": {"id": "org/m", "revision": "main", "commit": "c" * 40, "source": "hf", "license": None,
                     "gated": False, "content_digest": "d" * 64},
           "recipe": {"id": "gguf-f16", "kind": "gguf", "digest": "e" * 64, "options": {"outtype": "f16"}},
           "runtime_profiles": ["llm-llamacpp-cpu"], "format": "gguf",
           "files": [{"path": "m.gguf", "sha256": "f" * 64, "size": 10}], "toolchain": {"gguf": "0.19.0"},
           "build": {}, "validation": None, "serving": {}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def test_a_manifest_from_before_describe_keeps_its_bytes_and_its_refs_sha256():
    old = _old_manifest_bytes()
    m = Manifest.parse(old, "old store")
    assert m.describe == {} and m.to_bytes() == old
    ref = json.loads(ref_document("org/m", "gguf-f16", m))  # what `tag` and a commit's repair write for it
    assert ref["manifest_sha256"] == hashlib.sha256(old).hexdigest()
    assert Manifest.parse(json.loads(old) | {"describe": {}}, "old store").to_bytes() == old


def test_a_described_manifest_round_trips_exactly():
    doc = json.loads(_old_manifest_bytes()) | {"describe": {"family": "llama", "architecture": "LlamaForCausalLM",
                                                            "parameters": 134515008, "precision": "float16",
                                                            "quantization": ""}}
    raw = Manifest.parse(doc, "new store").to_bytes()
    assert json.loads(raw)["describe"] == doc["describe"]
    assert Manifest.parse(raw, "new store").to_bytes() == raw


def test_a_compiled_qpc_says_what_its_bundle_said(tmp_path, monkeypatch):
    """The AI 100 compile publishes the QPC from the bundle's manifest alone (qpc.py): its description travels."""
    from qaic_standin import make_sdk
    from test_qaic_qpc import publish_bundle

    from pipelines.targets.qaic.compile import find_sdk
    from pipelines.targets.qaic.qpc import compile_bundle

    store, bundle = publish_bundle(tmp_path)
    described = {"family": "llama", "architecture": "LlamaForCausalLM", "parameters": 134515008,
                 **target_for("qaic").describe_weights(bundle.recipe.options, LLAMA)}
    monkeypatch.setenv("HIVE_AOT_QAIC_SDK", str(make_sdk(tmp_path / "sdk", "1.22.0")))
    res = compile_bundle(store, bundle.model_copy(update={"describe": described}), find_sdk())
    assert res.state == "published"
    qpc = Manifest.parse(store.read_bytes(manifest_key(bundle.model.id, bundle.recipe.id, res.build_id)), "qpc")
    assert qpc.describe == described and described["quantization"] == "mxfp6"
