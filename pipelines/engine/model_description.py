"""What a build's manifest says the published model is: its `describe` section.

hive-aot's own readers need none of it; other tools do. The OCI store shows it in the artifact's CNCF ModelPack
config (family, architecture, paramSize, precision, quantization), so a registry UI, modctl or a platform's
inventory tells a 4-bit llama from a bf16 qwen2 without downloading either.

Every value comes from what already defines the build id, so every host writes the same section for one build id:
the source's config.json and safetensors headers (files of the snapshot, whose digests the id covers) and the
recipe, through its kind's `describe_weights` (the kind's format version covers its code). Nothing is measured
on the artifact: the parameter count is the source model's, also for a quantized tier (an FP8 or INT4 vLLM
checkpoint, a GGUF k-quant), whose stored tensors (packed codes, scales) would count something else.
"""

from __future__ import annotations

from typing import Any


def source_facts(config: dict[str, Any], parameters: int) -> dict[str, Any]:
    """family (config.json's `model_type`: "llama", "qwen2"), architecture (its first `architectures` class:
    "LlamaForCausalLM") and the parameter count; "" for what config.json does not say."""
    archs = config.get("architectures")
    first = next((a for a in archs if isinstance(a, str)), "") if isinstance(archs, list) else ""
    family = config.get("model_type")
    return {"family": family if isinstance(family, str) else "", "architecture": first, "parameters": int(parameters)}


def describe_build(config: dict[str, Any], parameters: int, target: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The `describe` section of a build of `target` (a Target) with the recipe's `options`, from the source's
    config.json and its parameter count (the memory plan's, read from the safetensors headers)."""
    weights = target.describe_weights(options, config)
    return {**source_facts(config, parameters),
            "precision": str(weights.get("precision") or ""), "quantization": str(weights.get("quantization") or "")}
