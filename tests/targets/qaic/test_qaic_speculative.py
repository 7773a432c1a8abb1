"""Speculative decoding on Cloud AI 100 (issue 25, item 3): the target LM of vllm-qaic's n-gram speculation.

An export with `target_lm: true` has QEfficient's `num_logits_to_keep` input and returns the logits of the last N
positions; a compile recipe with `num_speculative_tokens: K` specializes its decode for K+1 tokens and is served
with `--speculative-config '{"method":"ngram","num_speculative_tokens":K}'`, the QPC in
VLLM_QAIC_SPEC_TARGET_QPC_PATH. onnxruntime runs the export in speculative steps (drafts accepted and rejected,
the retained state fed back) against transformers fp32 on the same ids; the compile goes through the labelled
STAND-IN compiler (tests/support/qaic_standin.py), which checks every flag and file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from factories import write_test_config
from qaic_standin import LABEL, make_sdk
from test_cli import doc, hive, one_error_line

from pipelines.targets.qaic.compile import NOT_A_TARGET_LM, CompileOptions, command, specializations

MODEL = "test-org/tiny-llama"
SLUG = "test-org--tiny-llama"
K = 5  # the seed's quick start
SHAPE = {"num_cores": 4, "ctx_len": 128, "prefill_seq_len": 32, "batch_size": 1, "full_batch_size": 4,
         "num_devices": 1, "mxfp6": True, "mxint8": True, "sdk_version": "1.22"}
SPEC_CONFIG = '{"method":"ngram","num_speculative_tokens":5}'


# --- the target LM in onnxruntime ----------------------------------------------------------------------


def test_target_lm_export_verifies_drafts_in_onnxruntime_like_transformers(tiny_llama, tmp_path):
    """Prefill, then K+1 decode steps of K+1 tokens (accepting 0..K drafts, the rejected drafts' K/V left in the
    cache to be masked and overwritten): every logit against transformers fp32 on the same ids."""
    import onnx

    from pipelines.targets.qaic.export import export
    from pipelines.targets.qaic.ort import ort_parity

    out = tmp_path / "model.onnx"
    rep = export(tiny_llama, out, ctx_len=32, batch_index=True, logits_to_keep=True)
    graph = onnx.load(str(out), load_external_data=False).graph
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(graph.input) + list(graph.output)}
    assert [i.name for i in graph.input][-2:] == ["batch_index", "num_logits_to_keep"] and rep.logits_to_keep
    assert dims["num_logits_to_keep"] == ["num_logits_to_keep", 1]
    assert dims["logits"] == ["batch_size", "num_logits_to_keep", rep.vocab]
    prompt = random.Random(0).sample(range(512), 12)
    [r] = ort_parity(tiny_llama, out, [prompt], decode_steps=8, ctx_len=64, speculative=K)
    spec = r["speculative"]
    print({k: v for k, v in r.items() if k != "tokens"})
    assert spec["accepted"] == [0, 1, 2, 3, 4, 5]  # every acceptance length, the greedy path kept throughout
    assert (spec["steps"], spec["positions"], spec["num_speculative_tokens"]) == (K + 1, (K + 1) ** 2, K)
    assert spec["top1_agreement"] == 1.0 and spec["max_abs_logit_delta"] < 1e-3
    assert r["top1_agreement"] == 1.0 and r["max_abs_logit_delta"] < 1e-3 and len(set(r["tokens"])) > 1


# --- the compile contract ------------------------------------------------------------------------------


def test_specializations_of_the_target_lm_and_an_unchanged_command():
    opts = CompileOptions.parse({**SHAPE, "num_speculative_tokens": K})
    assert specializations(opts) == {"specializations": [
        {"name": "Prefill", "symbols": {"batch_size": "1", "seq_len": "32", "ctx_len": "128", "full_batch_size": "4",
                                        "num_logits_to_keep": "1"}},
        {"name": "Decode", "symbols": {"batch_size": "4", "seq_len": "6", "ctx_len": "128", "full_batch_size": "4",
                                       "num_logits_to_keep": "6"}}]}
    plain = CompileOptions.parse({**SHAPE, "full_batch_size": None, "num_speculative_tokens": 1})
    assert specializations(plain, "1.20")["specializations"][1] == {"batch_size": "1", "seq_len": "2", "ctx_len": "128",
                                                                     "num_logits_to_keep": "2"}
    # QEfficient adds no flag for a target LM: the command is the plain one
    assert command(opts, "onnx/model.onnx") == command(CompileOptions.parse(SHAPE), "onnx/model.onnx")
    assert "num_speculative_tokens" not in CompileOptions.parse(SHAPE).recorded()
    assert opts.recorded()["num_speculative_tokens"] == K


@pytest.mark.parametrize("value, message", [
    (0, "num_speculative_tokens: Input should be greater than or equal to 1"),
    (-2, "num_speculative_tokens: Input should be greater than or equal to 1"),
    (1000, "num_speculative_tokens: Input should be less than or equal to 16"),
    ("5", "num_speculative_tokens: Input should be a valid integer"),
    (True, "num_speculative_tokens: Input should be a valid integer"),
    (32, "num_speculative_tokens: Input should be less than or equal to 16"),
    (15, "num_speculative_tokens 15: a decode step of 16 tokens is longer than prefill_seq_len 8"),
])
def test_bad_numbers_of_speculative_tokens_are_one_line_each(value, message):
    problems = CompileOptions.problems({**SHAPE, "prefill_seq_len": 8, "num_speculative_tokens": value})
    assert len(problems) == 1 and message in problems[0] and "\n" not in problems[0], problems


def test_speculation_is_refused_for_what_is_not_a_causal_lm_decoder():
    from types import SimpleNamespace

    from pipelines.targets.qaic import QaicExportTarget, QaicTarget

    embed = CompileOptions.problems({**SHAPE, "task": "embedding", "full_batch_size": None, "num_speculative_tokens": K})
    assert embed == [f"options: {NOT_A_TARGET_LM}"] and "vision-language models cannot combine it" in NOT_A_TARGET_LM
    spd = {**SHAPE, "num_speculative_tokens": K}
    for config in ({"architectures": ["LlavaForConditionalGeneration"], "vision_config": {"model_type": "clip"}},
                   {"architectures": ["BertModel"], "max_position_embeddings": 512}):
        assert (QaicTarget().plan_problems(SimpleNamespace(recipe=SimpleNamespace(options=spd), config=config))
                == [NOT_A_TARGET_LM])
        tlm = SimpleNamespace(recipe=SimpleNamespace(options={"target_lm": True}), config=config)
        assert QaicExportTarget().plan_problems(tlm) == [f"target_lm: {NOT_A_TARGET_LM}"]
    llama = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 512}
    assert QaicTarget().plan_problems(SimpleNamespace(recipe=SimpleNamespace(options=spd), config=llama)) == []
    assert QaicExportTarget.option_problems({"target_lm": "yes"}) == ["target_lm must be true or false"]
    assert QaicTarget.input_problems(spd, {"batch_index": True})[0].startswith(
        "options.num_speculative_tokens: the target LM needs an input export with target_lm: true")
    assert "set num_speculative_tokens" in QaicTarget.input_problems(SHAPE, {"target_lm": True})[0]


def test_the_serving_policy_runs_only_the_speculative_config_hive_aot_writes(tmp_path):
    from pipelines.client.serve_policy import ServeRefused, check

    base = ["vllm", "serve", str(tmp_path), "--max-model-len", "128", "--speculative-config"]
    env = {"VLLM_QAIC_SPEC_TARGET_QPC_PATH": f"{tmp_path}/qpc"}
    assert check(base + [SPEC_CONFIG], env, str(tmp_path), remote_code_allowed=False)[2] == env
    for value, message in [('{"method":"draft_model","model":"evil/repo"}', "key 'model' is not one hive-aot writes"),
                           ('{"method":{"x":1}}', "method is not a plain value"),
                           ('{"method":"ngram; rm -rf /"}', "method is not a plain value"),
                           ("ngram", "is not a JSON object"), ("[5]", "is not a JSON object")]:
        with pytest.raises(ServeRefused, match=message):
            check(base + [value], env, str(tmp_path), remote_code_allowed=False)
    with pytest.raises(ServeRefused, match="must name a file in the pulled directory"):
        check(base + [SPEC_CONFIG], {"VLLM_QAIC_SPEC_TARGET_QPC_PATH": "/etc"}, str(tmp_path), remote_code_allowed=False)


# --- a build from the repo to the QPC and its serving arguments, through the stand-in compiler ------------


@pytest.fixture(scope="module")
def spd_store(tiny_llama, tmp_path_factory):
    """tiny-llama built with `qaic-spd-tiny` (num_speculative_tokens 5) from `qaic-export-tlm` (target_lm:
    true) on a host whose SDK is the STAND-IN: export, bundle and QPC in one build."""
    tmp = tmp_path_factory.mktemp("qaic-spd")
    repo = Path.cwd()
    reg = write_test_config(tmp / "cfg", repo, gates={},
                            models=[{"id": MODEL, "source": str(tiny_llama), "recipes": ["qaic-spd-tiny"]}])
    recipes = tmp / "cfg" / "recipes"
    export = yaml.safe_load((repo / "recipes" / "qaic-export.yaml").read_text())
    export.update(id="qaic-export-tlm", options={**export["options"], "target_lm": True})
    (recipes / "qaic-export-tlm.yaml").write_text(yaml.safe_dump(export, sort_keys=False))
    recipe = yaml.safe_load((repo / "recipes" / "qaic-mxfp6.yaml").read_text())
    recipe.update(id="qaic-spd-tiny", input="qaic-export-tlm", options={**SHAPE, "num_speculative_tokens": K},
                  validation={"min_predicted_top1": 0.5, "max_predicted_kl": 1.0})
    (recipes / "qaic-spd-tiny.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    store = tmp / "store"
    env = {"HIVE_AOT_QAIC_SDK": str(make_sdk(tmp / "sdk", "1.22.0"))}
    proc = hive("build", str(tiny_llama), "--model-id", MODEL, "--recipe", "qaic-spd-tiny", "--registry", str(reg),
                "--store", str(store), "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    return {"tmp": tmp, "reg": reg, "store": store, "doc": doc(proc)}


def _manifest(store: Path, recipe: str, build_id: str) -> dict:
    return json.loads((store / "manifests" / SLUG / recipe / f"{build_id}.json").read_text())


def _blob(store: Path, m: dict, path: str) -> bytes:
    entry = next(f for f in m["files"] if f["path"] == path)
    return (store / "blobs" / "sha256" / entry["sha256"][:2] / entry["sha256"]).read_bytes()


def test_the_target_lm_bundle_and_qpc_carry_the_speculative_compile_and_serving(spd_store, tmp_path):
    d, store = spd_store["doc"], spd_store["store"]
    assert d["state"] == "published" and d["format"] == "qpc"
    bundle = _manifest(store, "qaic-spd-tiny", d["bundle"]["build_id"])
    export = _manifest(store, "qaic-export-tlm", bundle["build"]["input"]["build_id"])
    metrics = export["validation"]["metrics"]
    assert export["validation"]["passed"] and metrics["ort_top1_agreement"] == 1.0
    assert metrics["ort_speculative_steps"] == 2 * (K + 1) and metrics["ort_max_abs_delta"] < 1e-3
    assert export["build"]["export"]["logits_to_keep"] is True
    assert bundle["build"]["compile"]["options"]["num_speculative_tokens"] == K
    specs = json.loads(_blob(store, bundle, "compile/specializations.json"))["specializations"]
    assert [s["symbols"]["seq_len"] for s in specs] == ["32", "6"]
    assert [s["symbols"]["num_logits_to_keep"] for s in specs] == ["1", "6"]
    # what the stand-in compiler was handed, flag by flag and file by file
    qpc = _manifest(store, "qaic-spd-tiny", d["build_id"])
    checked = json.loads(_blob(store, qpc, "qpc/programqpc.bin")[len(LABEL):])
    assert checked["flags"] == ["-aic-hw", "-convert-to-fp16", "-mxfp6-matmul", "-retained-state"]
    assert {k: v for k, v in checked["values"].items() if not k.startswith(("-m", "-network", "-custom", "-aic-binary"))} \
        == {"-aic-hw-version": "ai100", "-aic-num-cores": "4"}
    assert checked["specializations"] == specs and checked["inputs"][-2:] == ["batch_index", "num_logits_to_keep"]
    assert set(checked["custom_io"].values()) == {"mxint8"} and len(checked["custom_io"]) == 2 * 2 * 2
    serving = qpc["serving"]["vllm-qaic"]
    assert serving["env"] == {"HF_HUB_OFFLINE": "1", "VLLM_QAIC_SPEC_TARGET_QPC_PATH": "{model_dir}/qpc"}
    assert serving["engine_args"] == {"served_model_name": MODEL, "max_model_len": 128, "max_num_seqs": 4,
                                      "max_seq_len_to_capture": 32, "device_group": "0", "quantization": "mxfp6",
                                      "kv_cache_dtype": "mxint8", "speculative_config": SPEC_CONFIG}
    assert serving["compiled_for"]["num_speculative_tokens"] == K
    dest = tmp_path / "served"
    pulled = hive("pull", MODEL, "--target", "vllm-qaic", "--dest", str(dest), "--store", str(store),
                  "--registry", str(spd_store["reg"]), "--json", "--allow-stand-in")
    p = doc(pulled)
    assert pulled.returncode == 0 and p["serve_refused"] is None, pulled.stderr
    assert p["env"] == {"HF_HUB_OFFLINE": "1", "VLLM_QAIC_SPEC_TARGET_QPC_PATH": f"{dest}/qpc"}
    assert p["serve_argv"] == ["vllm", "serve", str(dest), "--served-model-name", MODEL, "--max-model-len", "128",
                               "--max-num-seqs", "4", "--max-seq-len-to-capture", "32", "--device-group", "0",
                               "--quantization", "mxfp6", "--kv-cache-dtype", "mxint8",
                               "--speculative-config", SPEC_CONFIG]


def test_a_target_lm_compile_needs_a_target_lm_export(tmp_path):
    reg = write_test_config(tmp_path, Path.cwd(), gates={})
    path = tmp_path / "recipes" / "qaic-mxfp6.yaml"
    data = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**data, "options": {**data["options"], "num_speculative_tokens": K}}))
    proc = hive("registry", "backends", "--registry", str(reg))
    assert "the target LM needs an input export with target_lm: true" in one_error_line(proc)
