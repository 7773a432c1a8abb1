"""The target interface (pipelines/targets/__init__.py): one registry of kinds, per-kind threshold schemas,
generic gates, serving descriptions and their use by pull."""

from __future__ import annotations

import pytest

from pipelines.manifest import Manifest
from pipelines.targets import KINDS, check_thresholds, serve_command, target_class, target_for


def test_every_kind_implements_the_interface():
    for kind in KINDS:
        t = target_for(kind)
        assert t.kind == kind and isinstance(t.format_version, int)
        for method in ("option_problems", "artifact_format", "supports", "toolchain", "build", "validate", "serving"):
            assert callable(getattr(t, method)), (kind, method)
        for name, field in t.Thresholds.model_fields.items():  # every gate names its metric
            assert name.startswith(("min_", "max_", "require_")) and field.json_schema_extra["metric"], (kind, name)
    with pytest.raises(ValueError, match=r"unknown target kind 'qpc' \(known: gguf, vllm, qaic-export, qaic\)"):
        target_class("qpc")


def test_gates_by_prefix_and_unmeasured_metrics_fail():
    gates = target_class("vllm").Thresholds(min_top1_agreement=0.9, max_mean_kl=0.01, require_token_parity=True,
                                            require_engine_load=True, min_vllm_greedy_agreement=1.0)
    good = {"top1_agreement": 0.95, "mean_kl": 0.001, "token_parity": 1.0, "vllm_loaded": 1.0, "vllm_greedy_agreement": 1.0}
    assert check_thresholds(good, gates) == []
    bad = {**good, "top1_agreement": 0.5, "mean_kl": 0.2, "token_parity": 0.9, "vllm_loaded": 0.0}
    del bad["vllm_greedy_agreement"]
    assert check_thresholds(bad, gates) == [
        "top-1 agreement 0.5000 < 0.9", "mean KL 0.20000 > 0.01", "tokenizer id parity 0.900 < 1.0",
        "vLLM load 0 < 1.0", "vLLM greedy parity was not measured"]
    assert check_thresholds({**good, "finite": False}, gates) == ["logits are not finite (NaN/Inf in weights or activations)"]


def test_thresholds_of_one_kind_are_refused_for_another():
    from pipelines.config import Recipe

    with pytest.raises(ValueError, match=r"require_engine_load: Extra inputs are not permitted \(gguf thresholds: "):
        Recipe.model_validate({"id": "x", "kind": "gguf", "runtime_profiles": ["llm-llamacpp-cpu"],
                               "validation": {"min_top1_agreement": 0.9, "max_mean_kl": 0.1, "require_engine_load": True}})


def test_serve_command_fills_in_the_pulled_directory():
    desc = {"command": ["vllm", "serve", "{model_dir}", "--served-model-name", "org/m"]}
    assert serve_command(desc, "/models/m") == ["vllm", "serve", "/models/m", "--served-model-name", "org/m"]
    assert serve_command({"command": None}, "/x") is None


def _manifest(serving: dict) -> Manifest:
    return Manifest.model_validate({
        "build_id": "0" * 64, "model": {"id": "o/m", "revision": "r", "commit": "c", "source": "local",
                                        "content_digest": "d"},
        "recipe": {"id": "gguf-f16", "kind": "gguf", "digest": "x", "options": {}},
        "runtime_profiles": ["llm-llamacpp-cpu"], "format": "gguf", "files": [], "toolchain": {}, "serving": serving})


def test_manifests_from_before_per_profile_serving_still_describe_their_profile():
    legacy = _manifest({"engine": "llama.cpp", "model_file": "m.gguf", "n_ctx": 2048})
    assert legacy.serving_for("llm-llamacpp-cpu") == {"engine": "llama.cpp", "model_file": "m.gguf", "n_ctx": 2048}
    current = _manifest({"llm-llamacpp-cpu": {"engine": "llama.cpp", "command": ["llama-server"]}})
    assert current.serving_for("llm-llamacpp-cpu")["command"] == ["llama-server"]
    assert current.serving_for("vllm-cu121") == {}
