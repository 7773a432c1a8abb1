"""The compatibility check on the minimal architecture table, on configs and on real tiny models."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from factories import copy_model, edit_config
from pipelines.compat import classify, classify_snapshot
from pipelines.compat.database import ARCHITECTURES
from pipelines.errors import HiveError
from pipelines.sources import fetch

TESTED = ["GPT2LMHeadModel", "MixtralForCausalLM", "PhiForCausalLM", "Phi3ForCausalLM", "LlamaForCausalLM",
          "MistralForCausalLM", "GemmaForCausalLM", "Qwen2ForCausalLM", "QWenLMHeadModel", "GPTNeoXForCausalLM"]
GGUF_RECIPES = ["gguf-f16", "gguf-q4_k_m", "gguf-q8_0"]
SANE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 512}


def _check(compat, name):
    return next(c for c in compat.checks if c.name == name)


def test_database_holds_the_ten_tested_rows():
    assert sorted(ARCHITECTURES) == sorted(TESTED)
    assert all(a.tested and a.default_profile == "vllm-cu121" and a.task == "causal-lm" for a in ARCHITECTURES.values())
    assert ARCHITECTURES["LlamaForCausalLM"].throughput_tok_s == 100


@pytest.mark.parametrize("arch", TESTED)
def test_tested_rows_are_compatible_on_vllm(arch, config):
    c = classify({"architectures": [arch], **SANE}, recipes=config.recipes.values())
    assert c.status == "compatible", c.checks
    assert c.runtime_profile_id == "vllm-cu121"
    assert c.architecture == arch and c.family == ARCHITECTURES[arch].family
    assert _check(c, "architecture_known").status == "pass"
    assert "tested on vllm-cu121" in _check(c, "architecture_known").detail
    # our converters: GGUF for the Llama layout only
    assert sorted(c.recipes) == (GGUF_RECIPES if arch in ("LlamaForCausalLM", "MistralForCausalLM") else [])


@pytest.mark.parametrize("hardware,profile", [("amd", "vllm-rocm"), ("intel", "vllm-xpu"), ("qaic", "vllm-qaic")])
def test_vendor_switch(hardware, profile):
    c = classify({"architectures": ["Qwen2ForCausalLM"], **SANE}, hardware=hardware)
    assert c.status == "compatible" and c.runtime_profile_id == profile and c.hardware == hardware


def test_llama_on_cpu_goes_to_llamacpp(config):
    c = classify({"architectures": ["LlamaForCausalLM"], **SANE}, hardware="cpu", recipes=config.recipes.values())
    assert c.status == "compatible"
    assert c.runtime_profile_id == "llm-llamacpp-cpu"
    assert sorted(c.recipes) == GGUF_RECIPES


def test_cpu_without_a_gguf_converter_is_incompatible(config):
    c = classify({"architectures": ["GPT2LMHeadModel"], **SANE}, hardware="cpu", recipes=config.recipes.values())
    assert c.status == "incompatible" and c.runtime_profile_id is None
    assert "no GGUF recipe applies to GPT2LMHeadModel" in _check(c, "cpu_tier").detail


def test_unknown_hardware_is_an_error():
    with pytest.raises(HiveError, match="unknown hardware 'tpu'"):
        classify({"architectures": ["LlamaForCausalLM"]}, hardware="tpu")


def test_unknown_architecture_requires_review(config):
    c = classify({"architectures": ["LlamaForCausalLMv9"], **SANE}, recipes=config.recipes.values())
    assert c.status == "requires_review"
    assert c.runtime_profile_id is None
    chk = _check(c, "architecture_known")
    assert chk.status == "warn"
    assert "LlamaForCausalLMv9 is not in the architecture database yet" in chk.detail
    assert "closest known: LlamaForCausalLM" in chk.detail
    assert c.recipes == []  # no converter for it either


@pytest.mark.parametrize("cfg", [{}, {"architectures": []}, {"architectures": None}, {"architectures": [7]},
                                 {"architectures": "LlamaForCausalLM"}])
def test_no_architectures_is_incompatible(cfg, config):
    c = classify({**cfg, **SANE}, recipes=config.recipes.values())
    assert c.status == "incompatible" and c.runtime_profile_id is None and c.recipes == []
    assert _check(c, "architecture_known").status == "fail"
    assert "no architectures field" in _check(c, "architecture_known").detail


def test_missing_config_is_incompatible():
    c = classify(None)
    assert c.status == "incompatible" and c.checks[0].name == "config" and "config.json is missing" in c.checks[0].detail
    c = classify(None, config_error="config.json is not valid JSON (x)")
    assert "not valid JSON" in c.reason()


def test_auto_map_requires_review(config):
    cfg = {"architectures": ["LlamaForCausalLM"], "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}, **SANE}
    c = classify(cfg, recipes=config.recipes.values())
    assert c.status == "requires_review"
    assert c.runtime_profile_id == "vllm-cu121"  # the platform would serve it once reviewed
    assert _check(c, "remote_code").status == "warn" and "auto_map" in _check(c, "remote_code").detail
    assert sorted(c.recipes) == GGUF_RECIPES
    assert "remote_code" in c.reason()


@pytest.mark.parametrize("key,value", [("hidden_size", 10 ** 9), ("num_hidden_layers", 100000), ("vocab_size", -5),
                                       ("intermediate_size", 0), ("num_attention_heads", "4"),
                                       ("max_position_embeddings", 1 << 40), ("head_dim", True),
                                       ("num_key_value_heads", 2.5)])
def test_absurd_sizes_are_incompatible(key, value, config):
    c = classify({"architectures": ["LlamaForCausalLM"], **SANE, key: value}, recipes=config.recipes.values())
    assert c.status == "incompatible" and c.runtime_profile_id is None and c.recipes == []
    chk = _check(c, "config_sane")
    assert chk.status == "fail" and f"{key}={value!r} is not plausible" in chk.detail


def test_indivisible_heads_are_incompatible():
    c = classify({"architectures": ["LlamaForCausalLM"], **SANE, "hidden_size": 66})
    assert c.status == "incompatible"
    assert "hidden_size=66 is not divisible by num_attention_heads=4" in _check(c, "config_sane").detail


def test_nested_text_config_is_checked():
    c = classify({"architectures": ["LlamaForCausalLM"], "text_config": {**SANE, "hidden_size": 1 << 30}})
    assert c.status == "incompatible"


# --- real snapshots ----------------------------------------------------------------------------

def test_tiny_llama_snapshot(tiny_llama, config):
    snap = fetch(str(tiny_llama), "test-org/tiny-llama")
    c = classify_snapshot(snap, config.recipes.values())
    assert c.status == "compatible" and c.runtime_profile_id == "vllm-cu121"
    assert all(ch.status == "pass" for ch in c.checks), c.checks
    assert sorted(c.recipes) == GGUF_RECIPES
    # exact parameter count and bytes from our header parser == the safetensors library
    numel, nbytes = 0, 0
    with safe_open(str(tiny_llama / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            numel += t.numel()
            nbytes += t.numel() * t.element_size()
    req = c.estimated_requirements
    assert req["parameters"] == numel
    assert req["weights_bytes"] == nbytes == req["weights_bytes_by_dtype"]["BF16"]
    cpu = classify_snapshot(snap, config.recipes.values(), hardware="cpu")
    assert cpu.status == "compatible" and cpu.runtime_profile_id == "llm-llamacpp-cpu"


def test_mistral_snapshot_gets_gguf_recipes(smollm2_dir, tmp_path, config):
    from factories import make_llama

    d = make_llama(tmp_path / "tiny-mistral", smollm2_dir, arch="MistralForCausalLM", num_hidden_layers=1)
    c = classify_snapshot(fetch(str(d), "test-org/tiny-mistral"), config.recipes.values())
    assert c.status == "compatible" and c.architecture == "MistralForCausalLM" and sorted(c.recipes) == GGUF_RECIPES


def test_vocab_size_mismatch_is_incompatible(tiny_llama, tmp_path, config):
    d = copy_model(tiny_llama, tmp_path / "m")
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    edit_config(d, vocab_size=vocab + 64)
    c = classify_snapshot(fetch(str(d), "test-org/m"), config.recipes.values())
    assert c.status == "incompatible" and c.recipes == []
    assert _check(c, "vocab_consistent").detail == (
        f"config vocab_size={vocab + 64} but model.embed_tokens.weight has {vocab} rows")


def test_malformed_config_snapshot_is_incompatible(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "m")
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    c = classify_snapshot(fetch(str(d), "test-org/m"))
    assert c.status == "incompatible" and "config.json is not valid JSON" in c.reason()


def test_missing_tokenizer_warns(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "m")
    (d / "tokenizer.json").unlink()
    c = classify_snapshot(fetch(str(d), "test-org/m"))
    assert _check(c, "tokenizer_present").status == "warn"
