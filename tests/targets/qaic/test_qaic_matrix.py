"""The Cloud AI 100 matrix as `check --hardware qaic-ai100` answers it (issue 25, items 4 and 6).

Every row of the seed (ai100-aot-supported-models.txt) either gets the qaic recipes, with the test that exports a
tiny random model of it and runs it in onnxruntime against transformers named here (and in docs/ai100.md's table),
or says that hive-aot has no exporter for it. Nothing is ever "compatible -> vllm-qaic" with no recipe, no other
task is routed to vllm-qaic, `reviewed: true` builds an exported architecture outside the matrix, and Gemma-2 is
served with the sliding window disabled, as its export computes it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from factories import TINY_CAUSAL_LMS, make_tiny_causal_lm, write_test_config

from pipelines.compat import classify, database

_ROOT = Path(__file__).resolve().parents[3]
_FAMILY = "test_qaic_export.py::test_family_runs_in_onnxruntime_with_transformers_parity"
_EXPORT = "test_qaic_export.py::test_export_runs_in_onnxruntime_with_transformers_parity"
_ENCODER = "test_qaic_encoders.py::test_ort_parity_with_transformers_padded_batches_included"
_WHISPER = "test_qaic_whisper.py::test_ort_parity_encoder_then_decode_steps_and_greedy_end_to_end"
_VISION = "test_qaic_vision.py::test_both_graphs_match_transformers_end_to_end_on_a_synthetic_image"
_QWEN25 = "test_qaic_vision_qwen2_5_vl.py::test_both_graphs_match_transformers_end_to_end_on_a_synthetic_image"
_QWEN3 = "test_qaic_vision_qwen3_vl.py::test_both_graphs_match_transformers_end_to_end_on_a_synthetic_image"
_MLLAMA = "test_qaic_vision_mllama.py::test_both_graphs_match_transformers_end_to_end"
_LLAMA4 = "test_qaic_vision_llama4.py::test_both_graphs_match_transformers_end_to_end_on_a_synthetic_image"
_INTERNVL_CHAT = ("test_qaic_vision_internvl_chat.py::"
                  "test_the_remote_checkpoint_exports_and_matches_the_native_model_end_to_end")
# The seed's rows hive-aot builds -> the test exporting a tiny random model of each in onnxruntime parity.
COVERED = {
    "LlamaForCausalLM": f"{_EXPORT}[llama]", "MistralForCausalLM": f"{_EXPORT}[mistral]",
    "Qwen2ForCausalLM": f"{_EXPORT}[qwen2]", "MixtralForCausalLM": f"{_FAMILY}[mixtral]",
    "Olmo2ForCausalLM": f"{_FAMILY}[olmo2]", "FalconForCausalLM": f"{_FAMILY}[falcon]",
    "Qwen3MoeForCausalLM": f"{_FAMILY}[qwen3_moe]", "GemmaForCausalLM": f"{_FAMILY}[gemma]",
    "Gemma2ForCausalLM": f"{_FAMILY}[gemma2]", "GptOssForCausalLM": f"{_FAMILY}[gpt_oss]",
    "GPTBigCodeForCausalLM": f"{_FAMILY}[gpt_bigcode]", "Starcoder2ForCausalLM": f"{_FAMILY}[starcoder2]",
    "GPTJForCausalLM": f"{_FAMILY}[gptj]", "GPT2LMHeadModel": f"{_FAMILY}[gpt2]",
    "GraniteForCausalLM": f"{_FAMILY}[granite]", "Phi3ForCausalLM": f"{_FAMILY}[phi3]",
    **{a: f"{_ENCODER}[{a}]" for a in ("BertModel", "MPNetForMaskedLM", "RobertaModel", "XLMRobertaModel",
                                       "XLMRobertaForSequenceClassification")},
    "WhisperForConditionalGeneration": f"{_WHISPER}[WhisperForConditionalGeneration]",
    **{a: f"{_VISION}[{a}]" for a in ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                                      "InternVLForConditionalGeneration")},
    "Qwen2_5_VLForConditionalGeneration": f"{_QWEN25}[Qwen2_5_VLForConditionalGeneration]",
    **{a: f"{_QWEN3}[{a}]" for a in ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")},
    "MllamaForConditionalGeneration": f"{_MLLAMA}[MllamaForConditionalGeneration]",
    "Llama4ForConditionalGeneration": f"{_LLAMA4}[Llama4ForConditionalGeneration]",
    # remote code, built as its native form InternVLForConditionalGeneration (pipelines/model/native_internvl.py)
    "InternVLChatModel": f"{_INTERNVL_CHAT}[InternVLChatModel]",
}
# The seed's rows without an exporter yet -> their task (none left; the tests below still run on the others).
NO_EXPORTER: dict[str, str] = {}
SANE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 512}
# What a row's config.json holds beyond SANE where its layout is not transformers' (InternVLChatModel's repositories:
# the language model in llm_config, the InternViT tower in vision_config, the remote code in auto_map)
ROW_CONFIG = {
    "InternVLChatModel": {"llm_config": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **SANE},
                          "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                            "num_attention_heads": 4, "image_size": 448, "patch_size": 14,
                                            "norm_type": "layer_norm", "qk_normalization": False, "qkv_bias": True},
                          "ps_version": "v2", "downsample_ratio": 0.5,
                          "auto_map": {"AutoModel": "modeling_internvl_chat.InternVLChatModel"}},
}


@pytest.fixture(scope="module")
def db(config):
    return database.build(config.registry)


def qaic(config, arch: str, **kw):
    cfg = {"architectures": [arch], **SANE, **ROW_CONFIG.get(arch, {}), **kw.pop("extra", {})}
    return classify(cfg, recipes=config.recipes.values(), registry=config.registry, files=["tokenizer.json"],
                    hardware="qaic-ai100", **kw)


def _known(c) -> str:
    return next(x.detail for x in c.checks if x.name == "architecture_known")


def test_the_registry_matrix_is_the_seed_rows(db):
    assert {a.name for a in db.architectures.values() if a.qaic} == set(COVERED) | set(NO_EXPORTER)


@pytest.mark.parametrize("arch", sorted(COVERED))
def test_every_covered_row_gets_the_qaic_recipes(arch, config):
    c = qaic(config, arch)
    assert (c.status, c.runtime_profile_id) == ("compatible", "vllm-qaic"), c.checks
    assert "qaic-export" in c.recipes and len(c.recipes) >= 2 and "in the AI 100 validated matrix" in _known(c)


@pytest.mark.parametrize("arch,task", sorted({**NO_EXPORTER, "PatchTSTForPrediction": "time-series",
                                              "BiTCN": "time-series", "MambaForCausalLM": "ssm-hybrid"}.items()))
def test_rows_without_an_exporter_say_so_and_are_never_routed(arch, task, config):
    for c in (qaic(config, arch), qaic(config, arch, reviewed=True),
              qaic(config, arch, reviewed=True, extra={"auto_map": {"AutoModel": "modeling_x.X"}})):
        assert (c.status, c.runtime_profile_id, c.recipes) == ("incompatible", None, []), c.checks
        assert _no_exporter(_known(c).split("; ", 1)[1]) in (task, arch), _known(c)


def _no_exporter(reason: str) -> str | None:
    """The task ("no hive-aot exporter for <task> models yet") or the architecture ("... for <Arch> yet (the AI 100
    <task> export covers ...)", a task with an exporter that does not cover this one) a refusal names."""
    m = re.match(r"no hive-aot exporter for (?:([\w-]+) models yet|(\w+)(?: yet|:))", reason)
    return m and (m.group(1) or m.group(2))


def test_no_answer_is_compatible_without_a_recipe_and_only_exported_tasks_are_routed(config, db):
    from pipelines.targets.qaic.support import EXPORTS, decoder_archs, encoder_archs, speech_archs, vision_archs

    assert {db.lookup(a).task for a in decoder_archs()} == {"causal-lm"}
    assert {db.lookup(a).task for a in speech_archs()} == {"seq2seq-audio"}
    assert {db.lookup(a).task for a in vision_archs()} == {"vision-language"}
    assert {db.lookup(a).task for a in encoder_archs()} <= {t for t, e in EXPORTS.items() if e == "encoder"}
    routed = set()
    for a in db.architectures:
        c = qaic(config, a)
        if c.status == "incompatible":
            assert c.runtime_profile_id is None and c.recipes == [], a
            continue
        assert c.runtime_profile_id == "vllm-qaic" and c.recipes, (a, c.status, c.checks)
        routed.add(db.lookup(a).task)
    assert routed == {"causal-lm", "embedding", "reranker", "seq2seq-audio", "vision-language"}
    phi = qaic(config, "PhiForCausalLM")  # a causal LM no family declares: named, with what is covered
    assert phi.status == "incompatible" and "no hive-aot exporter for PhiForCausalLM yet" in _known(phi)
    speech = qaic(config, "Speech2TextForConditionalGeneration")  # another seq2seq-audio model: Whisper only
    assert speech.status == "incompatible" and speech.recipes == [], speech.checks
    assert "no hive-aot exporter for Speech2TextForConditionalGeneration yet" in _known(speech)
    assert "covers WhisperForConditionalGeneration" in _known(speech)


def test_whisper_gets_its_own_compile_and_no_other(config):
    """Whisper: the export and the transcribe compile only; a causal LM or an embedder never gets it."""
    whisper = qaic(config, "WhisperForConditionalGeneration")
    assert (whisper.status, whisper.runtime_profile_id) == ("compatible", "vllm-qaic"), whisper.checks
    assert sorted(whisper.recipes) == ["qaic-export", "qaic-whisper-fp16"]
    for other in ("LlamaForCausalLM", "BertModel"):
        assert "qaic-whisper-fp16" not in qaic(config, other).recipes


def test_the_docs_matrix_names_each_row_and_its_test(db):
    text = (_ROOT / "docs" / "ai100.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| .*\| `tests/targets/qaic/(test_qaic_\w+\.py::[\w\[\]]+)` \|$", text, re.M))
    assert rows == COVERED
    missing = re.findall(r"^\| `(\w+)` \| .*\| (no hive-aot exporter for [^|]*?) \|$", text, re.M)
    assert {arch: _no_exporter(reason) for arch, reason in missing} == {
        arch: arch if task == "vision-language" else task for arch, task in NO_EXPORTER.items()}
    for test in COVERED.values():  # each named test exists, with that case
        path, func, case = re.fullmatch(r"(\S+)::(\w+)\[(\w+)\]", test).groups()
        body = (_ROOT / "tests" / "targets" / "qaic" / path).read_text()
        assert f"def {func}(" in body and (case in TINY_CAUSAL_LMS or f'"{case}"' in body), test


def _config(tmp_path: Path, model_id: str, source: Path, reviewed: bool):
    from pipelines.config.registry import Config

    models = [{"id": model_id, "source": str(source), "recipes": ["qaic-mxfp6"], "reviewed": reviewed}]
    return Config.load(write_test_config(tmp_path / f"cfg-{reviewed}", _ROOT, models=models))


def test_reviewed_builds_an_exported_architecture_outside_the_matrix(tmp_path):
    """Qwen3 (exported, not in the seed's matrix): requires_review with the qaic recipes, and once the registry says
    `reviewed: true` the plan goes through; before, the answer stayed "recipe qaic-export does not apply"."""
    from pipelines.core.errors import NotApplicableError
    from pipelines.engine.planning import plan

    model = make_tiny_causal_lm("qwen3", tmp_path / "qwen3", max_position_embeddings=4096)  # qaic-mxfp6: 2048
    with pytest.raises(NotApplicableError) as refused:
        plan(str(model), "qaic-mxfp6", _config(tmp_path, "test-org/qwen3", model, False), "test-org/qwen3", hashed=False)
    assert "requires review" in str(refused.value) and "set reviewed: true" in str(refused.value)
    p = plan(str(model), "qaic-mxfp6", _config(tmp_path, "test-org/qwen3", model, True), "test-org/qwen3", hashed=False)
    assert (p.compatibility.status, p.compatibility.runtime_profile_id) == ("compatible", "vllm-qaic")
    assert p.recipe.id == "qaic-mxfp6" and p.parent.recipe.id == "qaic-export"
    assert "reviewed: hive-aot's export builds it" in _known(p.compatibility)


def test_gemma2_is_served_without_the_window_its_export_does_not_compute(tmp_path):
    from types import SimpleNamespace

    from pipelines.client import serve_policy
    from pipelines.targets.qaic import QaicTarget
    from pipelines.targets.qaic.compile import CompileOptions
    from pipelines.targets.qaic.families import window_served_full
    from pipelines.targets.qaic.serving import describe

    gemma2 = {"architectures": ["Gemma2ForCausalLM"], "sliding_window": 4096, "max_position_embeddings": 8192}
    assert window_served_full(gemma2) == 4096
    assert window_served_full({**gemma2, "architectures": ["Starcoder2ForCausalLM"]}) is None  # masked in the graph
    assert window_served_full({"architectures": ["GemmaForCausalLM"]}) is None  # no window at all
    opts = CompileOptions.parse({"ctx_len": 2048})
    served = describe(opts, {"image": "x"}, "google/gemma-2-2b", False, {}, disable_sliding_window=True)
    assert served["engine_args"]["disable_sliding_window"] is True and "--disable-sliding-window" in served["command"]
    argv = [a.replace("{model_dir}", "/m") for a in served["command"]]
    serve_policy.check(argv, {"VLLM_QAIC_QPC_PATH": "/m/qpc"}, "/m", remote_code_allowed=False)  # a server runs it
    plain = describe(opts, {"image": "x"}, "meta-llama/Llama-3.2-1B", False, {})
    assert "disable_sliding_window" not in plain["engine_args"]
    # beyond the window the full-attention graph would not be the model: refused before any work
    ctx = SimpleNamespace(recipe=SimpleNamespace(options={"ctx_len": 8192}), config=gemma2)
    [problem] = QaicTarget().plan_problems(ctx)
    assert "ctx_len 8192 is beyond the 4096-token sliding window" in problem and "\n" not in problem
    assert QaicTarget().plan_problems(SimpleNamespace(recipe=ctx.recipe, config={**gemma2, "sliding_window": None,
                                                                                 "max_position_embeddings": 8192})) == []
    recipe = yaml.safe_load((_ROOT / "recipes" / "qaic-mxfp6.yaml").read_text())
    assert recipe["options"]["ctx_len"] <= 4096  # the shipped shape serves every Gemma-2


def test_check_says_in_one_line_why_qwen3_and_llama4_text_need_review(config, db, tmp_path):
    """Qwen3 and Llama-4 text are exported but outside Qualcomm's list (which validates their MoE and vision forms):
    check's architecture_known line names what is not validated, what the list validates instead, what hive-aot
    checked, and what `reviewed: true` means; the text answer and --json carry that same one line."""
    from test_cli import doc, hive

    for arch in ("Qwen3ForCausalLM", "Llama4ForCausalLM"):
        c = qaic(config, arch)
        assert (c.status, c.runtime_profile_id) == ("requires_review", "vllm-qaic") and "qaic-mxfp6" in c.recipes
        line = _known(c)
        validated = re.search(r"Qualcomm's AOT list validates (.+) but not (\w+);", line)
        assert validated and validated.group(2) == arch, line
        kin = validated.group(1).split(", ")
        assert all(db.lookup(k).qaic for k in kin) and any(k.startswith(arch[:5]) for k in kin), kin
        assert "never compiled or run on an AI 100" in line and "`reviewed: true` on this model in registry.yaml" in line
        assert _known(qaic(config, arch, reviewed=True)).endswith("reviewed: hive-aot's export builds it")
    assert "Llama4ForConditionalGeneration" in _known(qaic(config, "Llama4ForCausalLM"))
    model = make_tiny_causal_lm("qwen3", tmp_path / "qwen3")
    args = ("check", str(model), "--model-id", "test-org/qwen3", "--hardware", "qaic-ai100")
    text, as_json = hive(*args), hive(*args, "--json")
    assert (text.returncode, as_json.returncode) == (4, 4), (text.stderr, as_json.stderr)  # requires_review
    detail = next(c["detail"] for c in doc(as_json)["checks"] if c["name"] == "architecture_known")
    assert f"  [warn] architecture_known: {detail}" in text.stdout.splitlines()
    assert "Qualcomm's AOT list validates Qwen3MoeForCausalLM" in detail and "\n" not in detail
