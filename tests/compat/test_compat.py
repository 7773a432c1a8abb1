"""The compatibility check over the full architecture database: the seeds' expected answers, the
routing rules per vendor, requirements, and real snapshots (exact parameter counts)."""

from __future__ import annotations

import json

import pytest
from factories import GGUF_RECIPES, copy_model, edit_config
from safetensors import safe_open

from pipelines.compat import classify, classify_snapshot, database
from pipelines.compat.hardware import parse_hardware
from pipelines.config.kinds import target_for
from pipelines.core.errors import HiveError
from pipelines.source.fetch import fetch
from pipelines.targets.qaic.export import FAMILIES as QAIC_FAMILIES
from pipelines.targets.vllm import QUANTIZED_MOE_ARCHITECTURES

TESTED = {"GPT2LMHeadModel": 150, "MixtralForCausalLM": 120, "PhiForCausalLM": 110, "Phi3ForCausalLM": 105,
          "LlamaForCausalLM": 100, "MistralForCausalLM": 95, "GemmaForCausalLM": 90, "Qwen2ForCausalLM": 90,
          "QWenLMHeadModel": 85, "GPTNeoXForCausalLM": 80}
SSM = ["MambaForCausalLM", "Mamba2ForCausalLM", "FalconMambaForCausalLM", "JambaForCausalLM", "ZambaForCausalLM"]
TIME_SERIES = ["PatchTSTForPrediction", "PatchTSTForClassification", "BiTCN", "TimesFM"]
# Every architecture named in the two seeds' tables (compatibility families + AI 100 matrix).
SEED_NAMES = [
    "LlamaForCausalLM", "Llama4ForCausalLM", "CodeLlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM",
    "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "QWenLMHeadModel", "GemmaForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "PhiForCausalLM", "Phi3ForCausalLM", "PhiMoEForCausalLM",
    "DeepseekForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "GPT2LMHeadModel", "GPTNeoXForCausalLM",
    "GPTJForCausalLM", "BloomForCausalLM", "OPTForCausalLM", "FalconForCausalLM", "MPTForCausalLM", "ChatGLMModel",
    "Glm4ForCausalLM", "Glm4MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM", "NemotronHForCausalLM",
    "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration", "Mistral3ForConditionalGeneration",
    "Glm4vForConditionalGeneration", "InternVLForConditionalGeneration", "KimiVLForConditionalGeneration",
    "NemotronH_Nano_VL_V2", "BaichuanForCausalLM", "InternLMForCausalLM", "InternLM2ForCausalLM", "YiForCausalLM",
    "XverseForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM", "DbrxForCausalLM", "ArcticForCausalLM",
    "NemotronForCausalLM", "GraniteForCausalLM", "OlmoForCausalLM", "Olmo2ForCausalLM", "StableLmForCausalLM",
    "Starcoder2ForCausalLM", "ExaoneForCausalLM", "SolarForCausalLM", *SSM, *TIME_SERIES, "Glm4MoeLiteForCausalLM",
    # AI 100 matrix
    "GPTBigCodeForCausalLM", "InternVLChatModel", "QwenForCausalLM", "LlavaForConditionalGeneration",
    "MllamaForConditionalGeneration", "LlavaNextForConditionalGeneration", "Llama4ForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration", "BertModel", "MPNetForMaskedLM", "RobertaModel",
    "XLMRobertaForSequenceClassification", "XLMRobertaModel", "Whisper",
]
SEED_BACKENDS = ["vllm-cu121", "transformers-cu121", "tgi-cu121", "mamba-vllm-cu121", "diffusers-cu121",
                 "generative-cu121", "specialists-ts-cu121", "vllm-rocm", "transformers-rocm", "specialists-rocm",
                 "vllm-xpu", "ipex-xe", "specialists-ipex-xpu", "transformers-cpu", "specialist-cpu-optimized",
                 "llm-llamacpp-cpu"]
# The expected answer for every seed name on the default hardware (NVIDIA).
REMOTE_CODE_ONLY = ["BaichuanForCausalLM", "InternLMForCausalLM", "XverseForCausalLM", "MPTForCausalLM", "ArcticForCausalLM"]
SPECIALISTS = [*TIME_SERIES, "BertModel", "MPNetForMaskedLM", "RobertaModel", "XLMRobertaForSequenceClassification",
               "XLMRobertaModel", "Whisper"]
TRANSFORMERS_FALLBACK = ["MllamaForConditionalGeneration"]  # vLLM 0.33 serves Mllama no more; transformers does
EXPECTED = {
    **{a: ("compatible", "vllm-cu121") for a in SEED_NAMES
       if a not in SSM + REMOTE_CODE_ONLY + SPECIALISTS + TRANSFORMERS_FALLBACK},
    **{a: ("requires_review", "mamba-vllm-cu121") for a in SSM},
    **{a: ("requires_review", None) for a in REMOTE_CODE_ONLY},
    # transformers runs MPT natively (its MptForCausalLM, spelled otherwise): the repo's auto_map still needs review
    "MPTForCausalLM": ("requires_review", "transformers-cu121"),
    **{a: ("compatible", "specialists-ts-cu121") for a in SPECIALISTS},
    **{a: ("compatible", "transformers-cu121") for a in TRANSFORMERS_FALLBACK},
}
# our converter's families (pipelines/targets/gguf/families/), listed here so that adding or losing one is on purpose
GGUF_ARCHS = {"ApertusForCausalLM", "ArceeForCausalLM", "Cohere2ForCausalLM", "CohereForCausalLM",
              "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM",
              "Exaone4ForCausalLM", "FalconForCausalLM", "FalconH1ForCausalLM", "GPT2LMHeadModel",
              "GPTBigCodeForCausalLM", "GPTJForCausalLM", "GPTNeoXForCausalLM", "Gemma2ForCausalLM",
              "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "GemmaForCausalLM", "Glm4ForCausalLM",
              "Glm4MoeForCausalLM", "GptOssForCausalLM", "GraniteForCausalLM", "GraniteMoeForCausalLM",
              "GraniteMoeHybridForCausalLM", "HunYuanDenseV1ForCausalLM", "InternLM2ForCausalLM",
              "LFM2ForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Llama4ForCausalLM",
              "Llama4ForConditionalGeneration", "LlamaForCausalLM", "LlavaForConditionalGeneration",
              "MiniMaxM2ForCausalLM", "Ministral3ForCausalLM", "Mistral3ForConditionalGeneration",
              "MistralForCausalLM", "MixtralForCausalLM", "NemotronForCausalLM", "NemotronHForCausalLM",
              "Olmo2ForCausalLM", "Olmo3ForCausalLM", "OlmoForCausalLM", "OlmoeForCausalLM", "Phi3ForCausalLM",
              "PhiForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen2VLForConditionalGeneration",
              "Qwen2_5_VLForConditionalGeneration", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
              "Qwen3NextForCausalLM", "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
              "SeedOssForCausalLM", "SmolLM3ForCausalLM", "StableLmForCausalLM", "Starcoder2ForCausalLM"}
VLLM_RECIPES = ["vllm-bf16", "vllm-fp8", "vllm-w4a16", "vllm-w8a8-int8"]
QAIC_RECIPES = ["qaic-export", "qaic-fp16", "qaic-mxfp6"]
# Dense Llama-lineage families vLLM runs natively get the quantized tiers too; the rest the portable tier only.
FP8_TESTED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GemmaForCausalLM", "Phi3ForCausalLM"}
SANE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def db(config):
    return database.build(config.registry)


def check(config, arch_or_cfg, **kw):
    cfg = arch_or_cfg if isinstance(arch_or_cfg, dict) else {"architectures": [arch_or_cfg], **SANE}
    return classify(cfg, recipes=config.recipes.values(), registry=config.registry, files=["tokenizer.json"], **kw)


def _check(compat, name):
    return next(c for c in compat.checks if c.name == name)


def test_every_seed_architecture_and_backend_is_present(db, config):
    missing = [n for n in SEED_NAMES if db.lookup(n) is None]
    assert missing == []
    assert db.lookup("CodeLlamaForCausalLM").name == "LlamaForCausalLM"
    assert db.lookup("QwenForCausalLM").name == "Qwen2ForCausalLM"
    assert db.lookup("Whisper").name == "WhisperForConditionalGeneration"
    profiles = {p.id: p for p in config.registry.runtime_profiles}
    assert set(SEED_BACKENDS) <= {p for p, v in profiles.items() if v.active}
    assert not profiles["vllm-rocm60"].active and not profiles["transformers-rocm60"].active
    assert profiles["vllm-qaic"].loads == ["qpc"] and profiles["llm-llamacpp-cpu"].loads == ["gguf"]


AUTO_MAP = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}


@pytest.mark.parametrize("arch", SEED_NAMES)
def test_every_seed_architecture_gets_its_expected_answer(arch, config):
    # the remote-code-only rows' repositories ship their modeling code (auto_map), as the real ones do
    cfg = {"architectures": [arch], **SANE, **({"auto_map": AUTO_MAP} if arch in REMOTE_CODE_ONLY else {})}
    c = check(config, cfg)
    assert (c.status, c.runtime_profile_id) == EXPECTED[arch], c.checks


@pytest.mark.parametrize("arch", ["ArcticForCausalLM", "MPTForCausalLM", "BaichuanForCausalLM", "QWenLMHeadModel"])
@pytest.mark.parametrize("hardware", ["nvidia", "cpu"])
def test_remote_code_answers_agree_with_themselves(arch, hardware, config):
    """Red team round two, item 22: Arctic and MPT without auto_map passed remote_code ("no custom code") yet were
    requires_review "with the repo's own modeling code"; `reviewed: true` changed nothing for QWenLMHeadModel or
    Baichuan."""
    plain = check(config, arch, hardware=hardware)
    with_code = check(config, {"architectures": [arch], **SANE, "auto_map": AUTO_MAP}, hardware=hardware)
    reviewed = check(config, {"architectures": [arch], **SANE, "auto_map": AUTO_MAP}, hardware=hardware, reviewed=True)
    # without auto_map nothing of the repo's own runs: served natively, or not at all (never "requires review")
    assert plain.status in ("compatible", "incompatible"), plain.checks
    if arch == "ArcticForCausalLM":  # only its own code could serve it, and this config declares none
        assert plain.status == "incompatible" and "no auto_map" in _check(plain, "architecture_known").detail
    assert _check(plain, "remote_code").detail == "no custom code"
    assert with_code.status == "requires_review" and _check(with_code, "remote_code").status == "warn"
    assert reviewed.status == "compatible" and reviewed.runtime_profile_id is not None
    assert _check(reviewed, "remote_code").status == "pass" and "reviewed" in _check(reviewed, "remote_code").detail


def test_a_class_spelled_otherwise_by_vllm_is_known_to_transformers(config):
    """Item 22: PhiMoE on cpu said "no transformers class": vLLM spells it PhiMoEForCausalLM, transformers
    PhimoeForCausalLM."""
    c = check(config, "PhiMoEForCausalLM", hardware="cpu")
    assert (c.status, c.runtime_profile_id) == ("compatible", "transformers-cpu"), c.checks


def test_database_size_and_sources(db):
    active = db.active()
    assert len(active) >= 415  # at least the vLLM 0.33 set (the seed snapshot counted 393)
    assert db.sources["vllm"] == "0.33.0"
    assert sum(1 for a in db.architectures.values() if a.vllm_support) >= 415
    assert {a.task for a in active} >= {"causal-lm", "embedding", "reranker", "vision-language", "seq2seq-audio",
                                        "time-series", "ssm-hybrid"}


@pytest.mark.parametrize("arch,tok_s", sorted(TESTED.items()))
def test_tested_rows_are_compatible_on_vllm_cu121(arch, tok_s, config, db):
    c = check(config, arch)
    assert (c.status, c.runtime_profile_id) == ("compatible", "vllm-cu121"), c.checks
    assert f"tested on vllm-cu121 ({tok_s} tok/s)" in _check(c, "architecture_known").detail
    assert db.lookup(arch).tested == {"vllm-cu121": tok_s}
    # The recipes listed are those vllm-cu121 loads; the GGUF ones belong to the CPU tier's answer.
    # Qwen 1 has no transformers class (remote code only): no reference to validate a prepared directory against.
    # per-expert MoE families: bf16 and FP8 (experts quantized per expert); the integer tiers are for dense models
    moe = ["vllm-bf16", "vllm-fp8"] if arch in QUANTIZED_MOE_ARCHITECTURES else ["vllm-bf16"]
    expected = [] if arch == "QWenLMHeadModel" else VLLM_RECIPES if arch in FP8_TESTED else moe
    assert sorted(c.recipes) == expected
    cpu = check(config, arch, hardware="cpu")
    if arch in GGUF_ARCHS:
        assert (cpu.runtime_profile_id, sorted(cpu.recipes)) == ("llm-llamacpp-cpu", GGUF_RECIPES)
    elif arch != "QWenLMHeadModel":  # remote code: requires review, no profile until reviewed
        assert (cpu.runtime_profile_id, cpu.recipes) == ("transformers-cpu", [])
    # AI 100: the export and its compiles, for the architectures our decoder exports (test_qaic_matrix.py)
    qaic_expected = QAIC_RECIPES if arch in QAIC_FAMILIES else []
    assert sorted(check(config, arch, hardware="qaic-ai100").recipes) == qaic_expected


def test_every_other_vllm_causal_lm_is_compatible_on_vllm(config, db):
    archs = [a.name for a in db.active() if a.vllm_support and a.task in ("causal-lm", "vision-language")
             and not a.trust_remote_code]
    assert len(archs) > 250
    wrong = {a: (c.status, c.runtime_profile_id) for a in archs
             if ((c := check(config, a)).status, c.runtime_profile_id) != ("compatible", "vllm-cu121")}
    assert wrong == {}


def test_transformers_only_causal_lms_fall_back(config, db):
    archs = [a.name for a in db.active() if a.task == "causal-lm" and not a.vllm_support and a.transformers_known]
    assert len(archs) > 20
    for a in archs:
        c = check(config, a)
        assert (c.status, c.runtime_profile_id) == ("compatible", "transformers-cu121"), a
        assert "transformers fallback" in _check(c, "architecture_known").detail


@pytest.mark.parametrize("arch", SSM)
def test_ssm_rows_are_not_ready_to_call(arch, config):
    c = check(config, arch)
    assert (c.status, c.runtime_profile_id) == ("requires_review", "mamba-vllm-cu121")
    assert "fine-tuning templates only" in _check(c, "architecture_known").detail


@pytest.mark.parametrize("arch", TIME_SERIES)
def test_time_series_go_to_specialists(arch, config):
    c = check(config, arch)
    assert (c.status, c.runtime_profile_id) == ("compatible", "specialists-ts-cu121")
    assert check(config, arch, hardware="amd").runtime_profile_id == "specialists-rocm"


@pytest.mark.parametrize("arch", ["BertModel", "XLMRobertaForSequenceClassification", "Whisper"])
def test_embeddings_rerankers_and_speech_go_to_specialists(arch, config):
    assert check(config, arch).runtime_profile_id == "specialists-ts-cu121"
    assert check(config, arch, hardware="intel").runtime_profile_id == "specialists-ipex-xpu"
    # AI 100: vllm-qaic for the encoders and the Whisper graph hive-aot exports (test_qaic_matrix.py)
    assert check(config, arch, hardware="qaic-ai100").runtime_profile_id == "vllm-qaic"


def test_diffusers_pipeline(config, tmp_path):
    c = classify({"_diffusers_pipeline": "StableDiffusionXLPipeline"}, registry=config.registry)
    assert (c.status, c.runtime_profile_id, c.task) == ("compatible", "diffusers-cu121", "diffusion")
    assert classify({"_diffusers_pipeline": "FluxPipeline"}, registry=config.registry, hardware="amd").status == "incompatible"
    # a real diffusers layout: model_index.json, no top-level config.json
    d = tmp_path / "sdxl"
    (d / "unet").mkdir(parents=True)
    (d / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline", "_diffusers_version": "0.30.0"}))
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((4, 4), dtype=np.float16)}, str(d / "unet" / "diffusion_pytorch_model.safetensors"))
    c = classify_snapshot(fetch(str(d), "test-org/sdxl"), registry=config.registry)
    assert (c.status, c.runtime_profile_id) == ("compatible", "diffusers-cu121")


def test_unknown_class_without_remote_code_is_incompatible(config):
    c = check(config, "LlamaForCausalLMv9")
    assert (c.status, c.runtime_profile_id, c.recipes) == ("incompatible", None, [])
    detail = _check(c, "architecture_known").detail
    assert "LlamaForCausalLMv9 is not in the architecture database" in detail
    assert "closest known: LlamaForCausalLM (llama family)" in detail


def test_unknown_class_with_auto_map_requires_review(config):
    cfg = {"architectures": ["AcmeForCausalLM"], "auto_map": {"AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"}, **SANE}
    c = check(config, cfg)
    assert (c.status, c.runtime_profile_id) == ("requires_review", None)
    assert _check(c, "remote_code").status == "warn"
    reviewed = check(config, cfg, reviewed=True)  # reviewed: served by transformers with its code (item 22)
    assert (reviewed.status, reviewed.runtime_profile_id) == ("compatible", "transformers-cu121")


def test_known_class_with_auto_map_requires_review(config):
    c = check(config, {"architectures": ["LlamaForCausalLM"], "auto_map": {"AutoModelForCausalLM": "m.X"}, **SANE})
    assert (c.status, c.runtime_profile_id) == ("requires_review", "vllm-cu121")
    assert sorted(c.recipes) == VLLM_RECIPES  # applicable, but build() refuses until the registry says reviewed


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "CodeLlamaForCausalLM", "Qwen2ForCausalLM"])
def test_cpu_tier_goes_to_llamacpp_when_a_gguf_recipe_applies(arch, config):
    c = check(config, arch, hardware="cpu")
    assert (c.status, c.runtime_profile_id) == ("compatible", "llm-llamacpp-cpu")
    assert sorted(c.recipes) == GGUF_RECIPES
    other = check(config, "OPTForCausalLM", hardware="cpu")  # no GGUF family: the transformers tier
    assert (other.status, other.runtime_profile_id) == ("compatible", "transformers-cpu")


def test_deactivated_backends_are_never_chosen(config, db):
    inactive = {p.id for p in config.registry.runtime_profiles if not p.active}
    assert inactive == {"vllm-rocm60", "transformers-rocm60"}
    for hw in ("nvidia", "amd", "intel", "cpu", "qaic"):
        for a in list(db.architectures)[::7]:
            assert check(config, a, hardware=hw).runtime_profile_id not in inactive


def test_glm4_moe_tested_on_xpu_without_figure(config, db):
    for arch in ("Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "Glm4MoeMTPModel", "Glm4MoeLiteMTPModel"):
        assert db.lookup(arch).tested == {"vllm-xpu": None}
        c = check(config, arch, hardware="intel")
        assert (c.status, c.runtime_profile_id) == ("compatible", "vllm-xpu"), arch


def test_notes_from_the_seeds(db):
    assert db.lookup("FalconForCausalLM").trust_remote_code and db.lookup("Phi3ForCausalLM").trust_remote_code
    assert any("disable_sliding_window" in n for n in db.lookup("GemmaForCausalLM").notes)
    assert all(db.lookup(a).task == "ssm-hybrid" for a in SSM)


def test_gemma_sliding_window_check(config):
    c = check(config, {"architectures": ["Gemma2ForCausalLM"], **SANE, "sliding_window": 4096})
    assert _check(c, "sliding_window").status == "warn" and "disable_sliding_window" in _check(c, "sliding_window").detail


def test_conflicting_architectures_are_incompatible(config):
    c = check(config, {"architectures": ["LlamaForCausalLM", "GPT2LMHeadModel"], **SANE})
    assert c.status == "incompatible" and "conflicting" in c.reason()
    same = check(config, {"architectures": ["LlamaForCausalLM", "CodeLlamaForCausalLM"], **SANE})
    assert same.status == "compatible"


@pytest.mark.parametrize("spec,vendor,model,mem", [
    ("nvidia-a100-80gb", "nvidia", "a100", 80), ("nvidia-a100-40gb", "nvidia", "a100", 40), ("nvidia", "nvidia", "a100", 80),
    ("amd-mi300x-192gb", "amd", "mi300x", 192), ("intel-max-1550", "intel", "max-1550", 128), ("cpu", "cpu", None, None),
    ("qaic-ai100", "qaic", "ai100", 32), ("nvidia-rtx4090-24gb", "nvidia", "rtx4090", 24)])
def test_hardware_specs(spec, vendor, model, mem):
    hw = parse_hardware(spec)
    assert (hw.vendor, hw.model, hw.memory_gb) == (vendor, model, mem)


@pytest.mark.parametrize("spec", ["tpu", "nvidia-rtx9999", "amd-"])
def test_bad_hardware_specs(spec, config):
    with pytest.raises(HiveError):
        check(config, "LlamaForCausalLM", hardware=spec)


def test_requirements_follow_the_documented_formula(config):
    from pipelines.compat.requirements import GIB, WeightsSummary

    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 131072}
    params = 8_030_261_248
    w = WeightsSummary(params, {"BF16": params * 2}, {"model.embed_tokens.weight": (128256, 4096)}, 4, 291)
    c = classify(cfg, weights=w, registry=config.registry, hardware="nvidia-a100-80gb", files=["tokenizer.json"])
    req = c.estimated_requirements
    kv_per_token = 2 * 32 * 8 * 128 * 2
    assert req["kv_cache_bytes_per_token"] == kv_per_token
    assert req["vram_bytes"] == params * 2 + kv_per_token * 8192 * 16 + GIB + params * 2 // 10
    rc = req["recommended_config"]
    assert rc["tensor_parallel_size"] == 1 and rc["max_model_len"] == 8192 and rc["dtype"] == "bfloat16"
    small = classify(cfg, weights=w, registry=config.registry, hardware="nvidia-t4", files=["tokenizer.json"])
    assert small.estimated_requirements["recommended_config"]["tensor_parallel_size"] == 2
    huge = WeightsSummary(10**12, {"BF16": 2 * 10**12}, {}, 100, 1)
    no = classify(cfg, weights=huge, registry=config.registry, hardware="nvidia-a100-80gb", files=["tokenizer.json"])
    assert no.status == "incompatible" and _check(no, "fits_hardware").status == "fail"
    qaic = classify(cfg, weights=w, registry=config.registry, hardware="qaic-ai100", files=["tokenizer.json"])
    assert qaic.estimated_requirements["recommended_config"]["mxfp6"] is True
    assert qaic.estimated_requirements["recommended_config"]["prefill_seq_len"] == 128


@pytest.mark.parametrize("cfg", [{}, {"architectures": []}, {"architectures": None}, {"architectures": [7]},
                                 {"architectures": "LlamaForCausalLM"}])
def test_no_architectures_is_incompatible(cfg, config):
    c = check(config, {**cfg, **SANE})
    assert c.status == "incompatible" and c.runtime_profile_id is None and c.recipes == []
    assert "no architectures field" in _check(c, "architecture_known").detail


def test_missing_config_is_incompatible():
    c = classify(None)
    assert c.status == "incompatible" and c.checks[0].name == "config" and "config.json is missing" in c.checks[0].detail
    assert "not valid JSON" in classify(None, config_error="config.json is not valid JSON (x)").reason()


@pytest.mark.parametrize("key,value", [("hidden_size", 10 ** 9), ("num_hidden_layers", 100000), ("vocab_size", -5),
                                       ("intermediate_size", 0), ("num_attention_heads", "4"),
                                       ("max_position_embeddings", 1 << 40), ("head_dim", True),
                                       ("num_key_value_heads", 2.5)])
def test_absurd_sizes_are_incompatible(key, value, config):
    c = check(config, {"architectures": ["LlamaForCausalLM"], **SANE, key: value})
    assert c.status == "incompatible" and c.runtime_profile_id is None and c.recipes == []
    assert f"{key}={value!r} is not plausible" in _check(c, "config_sane").detail


def test_nested_text_config_is_checked(config):
    assert check(config, {"architectures": ["LlamaForCausalLM"],
                          "text_config": {**SANE, "hidden_size": 1 << 30}}).status == "incompatible"


# --- real snapshots ----------------------------------------------------------------------------

def test_tiny_llama_snapshot(tiny_llama, config):
    snap = fetch(str(tiny_llama), "test-org/tiny-llama")
    c = classify_snapshot(snap, config.recipes.values(), registry=config.registry)
    assert c.status == "compatible" and c.runtime_profile_id == "vllm-cu121"
    assert all(ch.status == "pass" for ch in c.checks), c.checks
    assert sorted(c.recipes) == VLLM_RECIPES
    cpu = classify_snapshot(snap, config.recipes.values(), hardware="cpu", registry=config.registry)
    assert (cpu.runtime_profile_id, sorted(cpu.recipes)) == ("llm-llamacpp-cpu", GGUF_RECIPES)
    numel, nbytes = 0, 0
    with safe_open(str(tiny_llama / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            numel += t.numel()
            nbytes += t.numel() * t.element_size()
    req = c.estimated_requirements
    assert req["parameters"] == numel
    assert req["weights_bytes"] == nbytes == req["weights_bytes_by_dtype"]["BF16"]
    cpu = classify_snapshot(snap, config.recipes.values(), hardware="cpu", registry=config.registry)
    assert cpu.status == "compatible" and cpu.runtime_profile_id == "llm-llamacpp-cpu"


def test_vocab_size_mismatch_is_incompatible(tiny_llama, tmp_path, config):
    d = copy_model(tiny_llama, tmp_path / "m")
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    edit_config(d, vocab_size=vocab + 64)
    c = classify_snapshot(fetch(str(d), "test-org/m"), config.recipes.values(), registry=config.registry)
    assert c.status == "incompatible" and c.recipes == []
    assert (_check(c, "vocab_consistent").detail
            == f"config vocab_size={vocab + 64} but model.embed_tokens.weight has {vocab} rows")


def test_malformed_config_snapshot_is_incompatible(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "m")
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    c = classify_snapshot(fetch(str(d), "test-org/m"))
    assert c.status == "incompatible" and "config.json is not valid JSON" in c.reason()


def test_missing_tokenizer_warns(tiny_llama, tmp_path, config):
    d = copy_model(tiny_llama, tmp_path / "m")
    (d / "tokenizer.json").unlink()
    c = classify_snapshot(fetch(str(d), "test-org/m"), registry=config.registry)
    assert _check(c, "tokenizer_present").status == "warn"


# --- the generated snapshot and the registry commands --------------------------------------------

def test_static_parse_of_a_vllm_registry():
    from pipelines.compat.sync import VLLM_TASKS, parse_vllm_registry

    tables = "\n".join(f"{t} = {{}}" for t in VLLM_TASKS if t != "_TEXT_GENERATION_MODELS")
    src = (f'_TEXT_GENERATION_MODELS = {{"FooForCausalLM": ("foo", "FooForCausalLM"), **OTHER}}\n{tables}\n'
           '_PREVIOUSLY_SUPPORTED_MODELS = {"OldForCausalLM": "0.9.0"}\n_VLLM_MODELS = {**_TEXT_GENERATION_MODELS}\n')
    parsed = parse_vllm_registry(src)
    assert parsed["_TEXT_GENERATION_MODELS"] == {"FooForCausalLM": ("foo", "FooForCausalLM")}
    assert parsed["_PREVIOUSLY_SUPPORTED_MODELS"] == {"OldForCausalLM": "0.9.0"}
    with pytest.raises(HiveError, match="format changed"):
        parse_vllm_registry("_TEXT_GENERATION_MODELS = {}\n")


def test_committed_snapshot_is_the_vllm_0_33_set():
    snap = database._snapshot()
    archs = snap["architectures"]
    vllm = {n: r["vllm"] for n, r in archs.items() if (r.get("vllm") or {}).get("support")}
    assert snap["sources"]["vllm"] == "0.33.0" and len(vllm) == 415
    assert sum(1 for v in vllm.values() if v["support"] == "transformers-backend") == 35
    assert vllm["LlamaForCausalLM"] == {"support": "native", "module": "llama", "class": "LlamaForCausalLM",
                                        "table": "text_generation_models"}
    assert archs["QWenLMHeadModel"]["vllm"]["last_version"] == "0.23.0"


def test_registry_commands_list_architectures_and_backends():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pipelines.cli", "registry", "architectures", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    records = doc["architectures"]
    assert sum(1 for r in records if r["active"] is True) >= 393
    assert all(isinstance(r["active"], bool) for r in records)
    assert doc["aliases"]["CodeLlamaForCausalLM"] == "LlamaForCausalLM"
    out = subprocess.run([sys.executable, "-m", "pipelines.cli", "registry", "backends", "--json"],
                         capture_output=True, text=True, timeout=120)
    backends = {b["id"]: b for b in json.loads(out.stdout)}
    assert len(backends) == 19 and backends["vllm-rocm60"]["active"] is False


# --- hostile configs (issue 7): range checks, model_type, quantization_config, malformed fields -----------------

@pytest.mark.parametrize("key,value", [
    ("rms_norm_eps", -1e-5), ("rms_norm_eps", 0.0), ("rms_norm_eps", float("nan")), ("rms_norm_eps", float("inf")),
    ("rms_norm_eps", 1.5), ("rms_norm_eps", "1e-5"), ("layer_norm_eps", -1e-12), ("layer_norm_epsilon", True),
    ("rope_theta", 0), ("rope_theta", -10000.0), ("rope_theta", float("inf")), ("rope_theta", "10000"),
    ("rope_scaling", "linear"), ("rope_scaling", ["linear", 2.0]), ("rope_parameters", "default"),
    ("sliding_window", 0), ("sliding_window", -4096), ("sliding_window", True), ("sliding_window", "4096"),
])
def test_engine_config_values_are_range_checked(key, value, config):
    c = check(config, {"architectures": ["LlamaForCausalLM"], **SANE, key: value})
    assert c.status == "incompatible" and c.runtime_profile_id is None and c.recipes == []
    assert f"{key}={value!r} is not plausible" in _check(c, "config_sane").detail


@pytest.mark.parametrize("rope", [{"rope_scaling": {"rope_type": "linear", "factor": -2.0}},
                                  {"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}},
                                  {"rope_parameters": {"rope_type": "yarn", "factor": float("nan")}}])
def test_rope_objects_are_range_checked(rope, config):
    c = check(config, {"architectures": ["LlamaForCausalLM"], **SANE, **rope})
    assert c.status == "incompatible" and "must be a finite number > 0" in _check(c, "config_sane").detail


def test_kv_heads_must_divide_attention_heads(config):
    c = check(config, {"architectures": ["LlamaForCausalLM"], **SANE, "num_key_value_heads": 3})
    assert c.status == "incompatible"
    assert _check(c, "config_sane").detail == "num_attention_heads=4 is not divisible by num_key_value_heads=3"


def test_real_engine_values_pass(config):
    real = {"rms_norm_eps": 1e-6, "rope_theta": 500000.0, "sliding_window": None, "max_window_layers": 28,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}}
    assert check(config, {"architectures": ["LlamaForCausalLM"], **SANE, **real}).status == "compatible"
    v5 = {"layer_norm_eps": 1e-12, "sliding_window": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    c = check(config, {"architectures": ["MistralForCausalLM"], **SANE, **v5})
    assert c.status == "compatible" and _check(c, "config_sane").status == "pass"


@pytest.mark.parametrize("arch,model_type", [
    ("LlamaForCausalLM", "llama"), ("CodeLlamaForCausalLM", "llama"), ("MistralForCausalLM", "mistral"),
    ("Qwen2ForCausalLM", "qwen2"), ("Gemma3ForCausalLM", "gemma3_text"), ("GPT2LMHeadModel", "gpt2"),
    ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl"), ("LlavaForConditionalGeneration", "llava"),
])
def test_model_type_that_matches_the_architecture_passes(arch, model_type, config):
    c = check(config, {"architectures": [arch], "model_type": model_type, **SANE})
    assert c.status != "incompatible" and not any(ch.name == "model_type_consistent" for ch in c.checks), c.checks


@pytest.mark.parametrize("arch,model_type", [("LlamaForCausalLM", "qwen2"), ("Qwen2ForCausalLM", "bert"),
                                             ("MistralForCausalLM", "llama"), ("LlamaForCausalLM", 7)])
def test_model_type_contradicting_the_architecture_is_incompatible(arch, model_type, config):
    c = check(config, {"architectures": [arch], "model_type": model_type, **SANE})
    assert (c.status, c.runtime_profile_id, c.recipes) == ("incompatible", None, [])
    detail = _check(c, "model_type_consistent").detail
    assert repr(model_type) in detail and arch in detail


def test_remote_code_may_bring_its_own_model_type(config):
    c = check(config, {"architectures": ["LlamaForCausalLM"], "model_type": "acme", "auto_map": {"AutoConfig": "c.C"}, **SANE})
    assert c.status == "requires_review"


def test_every_model_type_transformers_maps_to_a_known_class_agrees(db):
    """No false alarms: every (class, model_type) pair of transformers' own auto mappings passes."""
    from transformers.models.auto import modeling_auto as auto

    from pipelines.compat.check import _model_type_problem
    from pipelines.compat.sync import TRANSFORMERS_TASKS

    tables = [getattr(auto, t, {}) for t, _task in TRANSFORMERS_TASKS] + [auto.MODEL_MAPPING_NAMES]
    pairs = {(cls, mt) for table in tables for mt, classes in table.items()
             for cls in (classes if isinstance(classes, (list, tuple)) else [classes])}
    wrong = [(cls, mt) for cls, mt in sorted(pairs) if db.lookup(cls) is not None
             and _model_type_problem({"model_type": mt}, db.lookup(cls), cls)]
    assert len(pairs) > 500 and wrong == []


@pytest.mark.parametrize("qc,detail", [
    ("yes", "quantization_config='yes' is not an object with a quant_method"),
    (["gptq"], "quantization_config=['gptq'] is not an object with a quant_method"),
    ({"bits": 4}, "quantization_config has unknown quant_method None"),
    ({"quant_method": "banana"}, "quantization_config has unknown quant_method 'banana'"),
])
def test_garbage_quantization_config_is_incompatible(qc, detail, config):
    c = check(config, {"architectures": ["LlamaForCausalLM"], **SANE, "quantization_config": qc})
    assert (c.status, c.runtime_profile_id, c.recipes) == ("incompatible", None, [])
    assert _check(c, "quantization_config").detail == detail


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8", "bitsandbytes", "compressed-tensors"])
def test_prequantized_models_are_served_but_never_converted_as_floats(method, config):
    cfg = {"architectures": ["LlamaForCausalLM"], **SANE, "quantization_config": {"quant_method": method, "bits": 4}}
    c = check(config, cfg)
    assert (c.status, c.runtime_profile_id, c.recipes) == ("compatible", "vllm-cu121", [])
    assert ("gguf, qaic, qaic-export, vllm recipes do not apply (they convert unquantized float weights only)"
            in _check(c, "quantization_config").detail)
    cpu = check(config, cfg, hardware="cpu")  # the CPU tier cannot be the GGUF one without a GGUF recipe
    assert (cpu.status, cpu.runtime_profile_id, cpu.recipes) == ("compatible", "transformers-cpu", [])


@pytest.mark.parametrize("change,refusal", [
    ({"rms_norm_eps": -1e-5}, "config_sane: rms_norm_eps=-1e-05 is not plausible"),
    ({"rope_scaling": "linear"}, "config_sane: rope_scaling='linear' is not plausible (must be an object)"),
    ({"model_type": "qwen2"}, "model_type_consistent: model_type 'qwen2' contradicts architecture LlamaForCausalLM"),
    ({"quantization_config": {"quant_method": "banana"}},
     "quantization_config: quantization_config has unknown quant_method 'banana'"),
])
def test_hostile_config_is_refused_by_check_and_by_build(change, refusal, tiny_llama, tmp_path, config):
    """Issue 7 items 10, 11, 9a: `check` said compatible, then build aborted in llama.cpp or raised a traceback."""
    from pipelines.core.errors import NotApplicableError
    from pipelines.engine.build import build_and_publish

    d = copy_model(tiny_llama, tmp_path / "m")
    edit_config(d, **change)
    c = classify_snapshot(fetch(str(d), "test-org/m"), config.recipes.values(), registry=config.registry)
    assert (c.status, c.recipes) == ("incompatible", []) and refusal in c.reason()
    with pytest.raises(NotApplicableError, match=r"^test-org/m is incompatible: ") as e:
        build_and_publish(str(d), "gguf-f16", config, str(tmp_path / "store"), "test-org/m")
    assert refusal in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "store" / "manifests").exists()


def test_prequantized_snapshot_is_not_built_as_unquantized(tiny_llama, tmp_path, config):
    from pipelines.core.errors import NotApplicableError
    from pipelines.engine.build import build_and_publish

    d = copy_model(tiny_llama, tmp_path / "m")
    edit_config(d, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    with pytest.raises(NotApplicableError,
                       match=r"recipe gguf-f16 does not apply to test-org/m .*recipes that profile loads: none"):
        build_and_publish(str(d), "gguf-f16", config, str(tmp_path / "store"), "test-org/m")


def test_deeply_nested_config_is_one_line(tiny_llama, tmp_path, config):
    """Issue 7 item 9a: json.loads raised RecursionError out of check and build."""
    from pipelines.core.errors import NotApplicableError
    from pipelines.engine.build import build_and_publish

    d = copy_model(tiny_llama, tmp_path / "m")
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    c = classify_snapshot(fetch(str(d), "test-org/m"), config.recipes.values(), registry=config.registry)
    assert c.status == "incompatible" and "config.json is nested too deeply" in c.reason()
    with pytest.raises(NotApplicableError, match="config.json is nested too deeply"):
        build_and_publish(str(d), "gguf-f16", config, str(tmp_path / "store"), "test-org/m")


# Every hardware spec docs/compatibility.md names: the recipes listed are exactly those the routed profile loads.
DOCUMENTED_HARDWARE = {
    "nvidia": "vllm-cu121", "nvidia-a100-40gb": "vllm-cu121", "nvidia-h100": "vllm-cu121", "nvidia-h200": "vllm-cu121",
    "nvidia-l4": "vllm-cu121", "nvidia-t4": "vllm-cu121", "amd": "vllm-rocm", "amd-mi300x-192gb": "vllm-rocm",
    "amd-mi250": "vllm-rocm", "amd-mi325x": "vllm-rocm", "intel": "vllm-xpu", "intel-max-1550": "vllm-xpu",
    "intel-max-1100": "vllm-xpu", "intel-arc-a770": "vllm-xpu", "cpu": "llm-llamacpp-cpu", "qaic-ai100": "vllm-qaic",
    "qaic-ai100-ultra": "vllm-qaic",
}


@pytest.mark.parametrize("hardware,profile", sorted(DOCUMENTED_HARDWARE.items()))
def test_check_lists_only_recipes_the_routed_profile_loads(hardware, profile, tiny_llama, config):
    snap = fetch(str(tiny_llama), "test-org/tiny-llama")
    c = classify_snapshot(snap, config.recipes.values(), hardware=hardware, registry=config.registry)
    assert c.runtime_profile_id == profile
    loads = set(config.registry.profile(profile).loads)
    for rid in c.recipes:
        r = config.recipe(rid)
        target = target_for(r.kind)
        # an intermediate artifact (the AI 100 ONNX export) is read by the compile recipes, not loaded
        assert profile in r.runtime_profiles and (target.artifact_format(r.options) in loads or target.intermediate)
    expected = {"llm-llamacpp-cpu": GGUF_RECIPES, "vllm-qaic": QAIC_RECIPES}.get(profile, VLLM_RECIPES)
    assert sorted(c.recipes) == expected


def test_gguf_archs_are_the_converters_families():
    from pipelines.targets.gguf.families import BY_ARCHITECTURE

    assert set(BY_ARCHITECTURE) == GGUF_ARCHS


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory):
    """Llama-3-70B's shapes as a header-only repo (sparse shards: what `check` reads are the headers)."""
    from factories import make_sharded_llama

    d, params = make_sharded_llama(tmp_path_factory.mktemp("70b") / "repo", hidden=8192, intermediate=28672, layers=80,
                                   vocab=128256, heads=64, kv_heads=8, shards=4)
    return d, params


def _check_json(d, hardware: str) -> dict:
    import contextlib
    import io

    from pipelines.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["check", str(d), "--model-id", "test-org/llama-70b", "--hardware", hardware, "--json"])
    return json.loads(out.getvalue())


def test_the_memory_figures_of_a_70b_agree_with_each_other(llama70b, capsys):
    """Red team round two, item 18: check's summary said 199241.6 MB (16 sequences) while the recommended config
    and fits_hardware said 4 sequences and 155.6 GiB; 70B on qaic-ai100 said 68 GiB on 2 devices of 32 GB; 70B on a
    T4 was incompatible without saying that vllm-fp8 halves the weights."""
    from pipelines.cli.main import main
    from pipelines.core.units import human_bytes

    d, params = llama70b
    h100 = _check_json(d, "nvidia-h100")
    req, fits = h100["estimated_requirements"], next(c for c in h100["checks"] if c["name"] == "fits_hardware")
    rc = req["recommended_config"]
    assert f"~{human_bytes(req['vram_bytes'])} at" in fits["detail"] and f"{rc['max_num_seqs']} seqs" in fits["detail"]
    qaic = _check_json(d, "qaic-ai100")
    req = qaic["estimated_requirements"]
    devices = req["recommended_config"]["num_devices"]
    assert req["vram_bytes"] <= devices * 32 * 2**30 * 0.9 < req["vram_bytes"] + 32 * 2**30 * 0.9, (req, devices)
    t4 = _check_json(d, "nvidia-t4")
    fits = next(c for c in t4["checks"] if c["name"] == "fits_hardware")
    assert t4["status"] == "incompatible" and "vllm-fp8 (8-bit weights" in fits["detail"], fits
    capsys.readouterr()
    main(["check", str(d), "--model-id", "test-org/llama-70b", "--hardware", "nvidia-h100"])
    summary = capsys.readouterr().out
    assert f"estimated memory {human_bytes(h100['estimated_requirements']['vram_bytes'])}" in summary, summary


def test_the_docs_count_the_database_as_it_is(db):
    """Item 22: the README said 783 active architectures, the database had 788 (the count is in
    docs/compatibility.md now)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "compatibility.md").read_text()
    m = re.search(r"(\d+) records,\s+(\d+)\s+active", text)
    assert m and (int(m.group(1)), int(m.group(2))) == (len(db.architectures), len(db.active()))


def test_a_causal_lm_released_as_its_base_model_is_an_embedding_model(tiny_llama, tmp_path, config):
    """Qwen3-Embedding's layout: config.json names the causal LM, the weights are the base model (no `model.`
    prefix, no lm_head), as sentence-transformers saves it. `check` says what it is from the headers and
    offers no recipe that builds a text generator (the GGUF build used to fail on a missing tensor)."""
    from factories import rewrite_safetensors_header

    d = copy_model(tiny_llama, tmp_path / "embedder")
    rewrite_safetensors_header(d / "model.safetensors", lambda h: h.update(
        {k.removeprefix("model."): h.pop(k) for k in [k for k in h if k.startswith("model.")]}))
    snap = fetch(str(d), "test-org/embedder")
    for hardware in ("cpu", "nvidia"):
        c = classify_snapshot(snap, config.recipes.values(), hardware=hardware, registry=config.registry)
        assert c.task == "embedding" and c.recipes == [], (hardware, c.task, c.recipes)
        detail = _check(c, "checkpoint_layout").detail
        assert "base model" in detail and "no lm_head" in detail and "embedding model" in detail
        assert "specialists backends" in detail and "pooling runner" in detail  # why no vLLM recipe either
        assert c.runtime_profile_id.startswith("specialist")
    # the causal LM it came from is still a causal LM with its GGUF recipes
    lm = classify_snapshot(fetch(str(tiny_llama), "test-org/lm"), config.recipes.values(), hardware="cpu",
                           registry=config.registry)
    assert lm.task == "causal-lm" and sorted(lm.recipes) == GGUF_RECIPES
    assert not [ch for ch in lm.checks if ch.name == "checkpoint_layout"]


# hive-aot's own mappings onto a llama.cpp graph that llama.cpp's converter does not make (gptj.py says why)
OWN_GGUF_MAPPINGS = {"GPTJForCausalLM": "phi2"}


def test_every_gguf_family_is_an_architecture_the_pinned_llama_cpp_converts_the_same_way(db, llamacpp_tree):
    """The database's llama.cpp column is read from the pinned converter (compat/llama_cpp_archs.py): each
    architecture a GGUF family declares is one it converts, to the same llama.cpp architecture (a spelling only
    the converter knows, such as LFM2ForCausalLM, has no database record: it is in the converter's own list)."""
    import llamacpp_converter

    from pipelines.targets.gguf.families import BY_ARCHITECTURE

    only_converter = llamacpp_converter.architectures(llamacpp_tree)
    for arch, family in sorted(BY_ARCHITECTURE.items()):
        rec = db.lookup(arch)
        if rec is None:
            assert arch in only_converter, arch
            continue
        expected = OWN_GGUF_MAPPINGS.get(arch)
        got = rec.llama_cpp_arch if rec is not None else None
        assert (got or expected) == family.gguf_arch, (arch, family.gguf_arch, got)
    assert db.sources["llama_cpp_python"] == "0.3.36"


def test_an_architecture_llama_cpp_converts_without_a_gguf_family_says_so(config, db):
    """On the CPU tier an architecture llama.cpp's converter knows but no GGUF recipe converts goes to the
    transformers fallback, and the answer says what llama.cpp would make of it."""
    from pipelines.targets.gguf.families import BY_ARCHITECTURE

    arch = next(a.name for a in sorted(db.architectures.values(), key=lambda a: a.name)
                if a.llama_cpp_arch and a.name not in BY_ARCHITECTURE and a.task == "causal-lm" and a.transformers_known
                and a.active and not a.trust_remote_code)
    c = check(config, arch, hardware="cpu")
    assert c.runtime_profile_id == "transformers-cpu" and c.recipes == []
    detail = _check(c, "architecture_known").detail
    assert f"llama.cpp's converter makes it a {db.lookup(arch).llama_cpp_arch} GGUF" in detail
    assert "no GGUF recipe here converts it" in detail


def test_the_llama_cpp_column_is_what_the_pinned_converter_registers(db, llamacpp_tree):
    """The committed snapshot's llama.cpp entries are exactly what `registry sync` reads from the pinned sdist's
    converter (not a hand-kept list), and the parser follows base classes to the GGUF architecture."""
    import llamacpp_converter

    from pipelines.compat import llama_cpp_archs
    from pipelines.compat.sync import snapshot_path

    # the sdist's conversion/ modules as `make setup` extracted them (the same files from_sdist reads)
    converted = llama_cpp_archs.parse({p.name: p.read_text() for p in (llamacpp_tree / "conversion").glob("*.py")})
    recorded = {name: rec["llama_cpp"] for name, rec in json.loads(snapshot_path().read_text())["architectures"].items()
                if "llama_cpp" in rec}
    assert recorded == {name: converted[name] for name in recorded}
    assert set(converted) - set(recorded) <= llamacpp_converter.architectures(llamacpp_tree)
    assert converted["Qwen3NextForCausalLM"] == {"arch": "qwen3next"}  # declared on a subclass of Qwen2-MoE's
    assert converted["LlavaForConditionalGeneration"] == {"arch": "llama", "mmproj": True}
    parsed = llama_cpp_archs.parse({"a.py": (
        "@ModelBase.register('XForCausalLM')\nclass X(Base):\n    pass\n"
        "class Base(TextModel):\n    model_arch = gguf.MODEL_ARCH.QWEN3\n"
        "@ModelBase.register('XForCausalLM')\nclass XVision(MmprojModel):\n    model_arch = gguf.MODEL_ARCH.MMPROJ\n")})
    assert parsed == {"XForCausalLM": {"arch": "qwen3", "mmproj": True}}


def test_every_gguf_family_architecture_is_offered_its_gguf_recipes_on_cpu(config, db):
    """`check --hardware cpu` routes every architecture a GGUF family declares (causal LMs, hybrids, the VLM
    wrappers) to the llama.cpp tier with the GGUF recipes; LFM2ForCausalLM, a spelling only llama.cpp's converter
    knows, is not in the database (released LFM2 configs name Lfm2ForCausalLM)."""
    from pipelines.targets.gguf.families import BY_ARCHITECTURE

    for arch in sorted(a for a in BY_ARCHITECTURE if db.lookup(a) is not None):
        c = check(config, arch, hardware="cpu")
        assert (c.runtime_profile_id, sorted(c.recipes)) == ("llm-llamacpp-cpu", GGUF_RECIPES), (arch, c.checks)
    assert [a for a in BY_ARCHITECTURE if db.lookup(a) is None] == ["LFM2ForCausalLM"]


def test_the_converter_modules_are_read_from_the_sdist_as_packed(tmp_path):
    """`registry sync` reads the sdist as pip downloads it: only `vendor/llama.cpp/conversion/*.py`, never run."""
    import io
    import tarfile

    from pipelines.compat import llama_cpp_archs
    from pipelines.core.errors import HiveError

    sdist = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        for name, text in (("llama_cpp_python-9.9.9/vendor/llama.cpp/conversion/a.py",
                            "@ModelBase.register('AForCausalLM')\nclass A(TextModel):\n"
                            "    model_arch = gguf.MODEL_ARCH.LLAMA\n"),
                           ("llama_cpp_python-9.9.9/vendor/llama.cpp/other/b.py",
                            "@ModelBase.register('BForCausalLM')\nclass B(TextModel):\n"
                            "    model_arch = gguf.MODEL_ARCH.LLAMA\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    assert llama_cpp_archs.from_sdist(sdist) == {"AForCausalLM": {"arch": "llama"}}
    empty = tmp_path / "empty.tar.gz"
    with tarfile.open(empty, "w:gz"):
        pass
    with pytest.raises(HiveError, match="has no vendor/llama.cpp/conversion/"):
        llama_cpp_archs.from_sdist(empty)
