"""Prepared vLLM weights for CUDA, ROCm and XPU: one portable HF-format directory per tier.

- `quantization: none` (recipe vllm-bf16): bf16 safetensors shards + index, normalized config, tokenizer
  and chat template; unchanged bf16 source shards are carried byte for byte. Also the artifact of the
  transformers fallback, for architectures vLLM does not run natively.
- `quantization: fp8-dynamic` (recipe vllm-fp8): compressed-tensors FP8 W8A8 dynamic (fp8.py).
- `quantization: w4a16-gptq` (recipe vllm-w4a16): compressed-tensors INT4 weight-only, groups of 128, GPTQ over
  the calibration text on the streamed model; `quantization: int8-dynamic` (recipe vllm-w8a8-int8): INT8
  W8A8, per-channel weights and per-token activations (int_tiers.py).

Validated in transformers and in a real vLLM (validate.py, engine.py); described per runtime profile
(serving.py) so `pull --target vllm-rocm` prints the exact `vllm serve` command.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from ...config.thresholds import Thresholds, check_thresholds, gate, metric_text
from .. import BuildContext, BuiltArtifact, Target, ValidationReport
from .server import VLLM_SERVER
from .vision import VLM_ARCHITECTURES, language_architecture

if TYPE_CHECKING:
    from ...compat.database import Architecture

# Bump when the bytes this target writes change for the same inputs (part of every build id).
# 2: the config carries the keys vLLM reads that transformers does not write (LFM2's conv_dim, block_dim); the
#    processor files travel with a VLM; FP8's `ignore` names stored modules (MoE experts quantized per expert)
FORMAT_VERSION = 2
QUANTIZATIONS = ("none", "fp8-dynamic", "w4a16-gptq", "int8-dynamic")
# Each tier's weights in CNCF ModelPack's words (describe_weights): (precision, quantization). The bf16 tier converts
# every source to bf16; FP8 is e4m3fn weights rounded per channel; W4A16 INT4 made by GPTQ; W8A8 INT8 rounded.
TIER_WEIGHTS = {"none": ("bfloat16", ""), "fp8-dynamic": ("float8_e4m3", "fp8"), "w4a16-gptq": ("int4", "gptq"),
                "int8-dynamic": ("int8", "w8a8-int8")}
DEFAULT_MAX_SHARD = "5GB"
# Families whose every transformers nn.Linear is a vLLM linear layer under the same name (so the FP8
# `ignore` list can be derived from the transformers class): dense decoders of the Llama lineage.
FP8_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
    "Gemma2ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM", "Phi3ForCausalLM", "CohereForCausalLM",
    "StableLmForCausalLM",
})
# MoE families whose released checkpoints store each expert's projections as their own tensors, which vLLM's
# compressed-tensors MoE schemes load per expert (fp8.fp8_selection): their attention and experts are quantized,
# routers stay bf16. Fused-expert releases (gpt-oss, Llama 4) are not here: no per-expert weights to scale.
QUANTIZED_MOE_ARCHITECTURES = frozenset({
    "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM",
})


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


class VllmThresholds(Thresholds):
    """Gates for prepared vLLM weights. The first four compare the artifact (in transformers fp32) with
    the source's fp32 reference; the vllm_* gates compare vLLM with transformers on the artifact."""

    min_top1_agreement: float = Field(ge=0.0, le=1.0, json_schema_extra=gate("top1_agreement", "top-1 agreement"))
    max_mean_kl: float = Field(ge=0.0, json_schema_extra=gate("mean_kl", "mean KL", ".5f"))
    max_abs_logit_delta: float | None = Field(default=None, ge=0.0,
                                              json_schema_extra=gate("max_abs_logit_delta", "max |delta logit|"))
    require_token_parity: bool = Field(default=True, json_schema_extra=gate("token_parity", "tokenizer id parity", ".3f"))
    require_engine_load: bool = Field(default=True, json_schema_extra=gate("vllm_loaded", "vLLM load", ".0f"))
    min_vllm_top1_agreement: float | None = Field(
        default=None, ge=0.0, le=1.0, json_schema_extra=gate("vllm_top1_agreement", "vLLM vs transformers top-1 agreement"))
    max_vllm_logprob_delta: float | None = Field(
        default=None, ge=0.0, json_schema_extra=gate("vllm_max_logprob_delta", "vLLM vs transformers max |delta logprob|"))
    min_vllm_greedy_agreement: float | None = Field(
        default=None, ge=0.0, le=1.0, json_schema_extra=gate("vllm_greedy_agreement", "vLLM greedy parity"))
    min_vllm_reference_top1_agreement: float | None = Field(
        default=None, ge=0.0, le=1.0,
        json_schema_extra=gate("vllm_reference_top1_agreement", "vLLM vs fp32 reference top-1 agreement"))
    max_weight_rel_error: float | None = Field(
        default=None, ge=0.0, json_schema_extra=gate("max_weight_rel_error", "max weight relative error"))
    # A vision-language model's image prompt (vision.py), after the image: vLLM against transformers on the same
    # processor tensors. Gated only where the model reads images.
    min_vllm_image_top1_agreement: float | None = Field(
        default=None, ge=0.0, le=1.0,
        json_schema_extra=gate("vllm_image_top1_agreement", "vLLM vs transformers top-1 agreement after the image"))
    max_vllm_image_logprob_delta: float | None = Field(
        default=None, ge=0.0,
        json_schema_extra=gate("vllm_image_max_logprob_delta", "vLLM vs transformers max |delta logprob| after the image"))


class VllmTarget(Target):
    kind = "vllm"
    format_version = FORMAT_VERSION
    Thresholds = VllmThresholds
    build_step = "prepare"
    server_programs = (VLLM_SERVER,)

    @staticmethod
    def option_problems(options: dict[str, Any]) -> list[str]:
        from ...core.errors import ConfigError
        from ...core.units import parse_size

        problems = [f"unknown option {k!r}" for k in options if k not in ("quantization", "max_shard_size")]
        if options.get("quantization", "none") not in QUANTIZATIONS:
            problems.append(f"quantization {options['quantization']!r} is not one of {', '.join(QUANTIZATIONS)}")
        try:
            if parse_size(options.get("max_shard_size", DEFAULT_MAX_SHARD), "max_shard_size") < 1 << 20:
                problems.append("max_shard_size must be at least 1MiB")
        except ConfigError:
            problems.append(f"max_shard_size {options['max_shard_size']!r} is not a size (e.g. 5GB)")
        return problems

    @staticmethod
    def plan_steps(env) -> list:
        from .plan import plan_steps

        return plan_steps(env)

    @staticmethod
    def artifact_format(options: dict[str, Any]) -> str:
        return "compressed-tensors" if options.get("quantization", "none") != "none" else "hf-safetensors"

    @staticmethod
    def describe_weights(options: dict[str, Any], config: dict[str, Any]) -> dict[str, str]:
        precision, quantization = TIER_WEIGHTS[options.get("quantization", "none")]
        return {"precision": precision, "quantization": quantization}

    def supports(self, arch: Architecture | None, architecture: str, config: dict[str, Any],
                 options: dict[str, Any]) -> bool:
        """Text causal LMs that transformers can load (the reference and the validation need its class),
        served by vLLM (natively or through its Transformers backend) or the transformers fallback.
        Quantized tiers only natively in vLLM: FP8 for the dense families of FP8_ARCHITECTURES and the per-expert
        MoE families of QUANTIZED_MOE_ARCHITECTURES; W4A16 and INT8 (int_tiers.py) for the dense ones only. The
        vision-language models of vision.VLM_ARCHITECTURES vLLM runs natively: bf16, and FP8 where their language
        model is FP8's."""
        if arch is not None and arch.task == "vision-language" and arch.name in VLM_ARCHITECTURES:
            # a VLM: the vision side stays bf16; FP8 where its language model's family takes it (vision.py)
            quantization = options.get("quantization", "none")
            return arch.vllm_support == "native" and (quantization == "none" or quantization == "fp8-dynamic" and
                                                      language_architecture(arch.name, config) in FP8_ARCHITECTURES)
        if arch is None or not arch.active or arch.task != "causal-lm" or not arch.transformers_known:
            return False
        from .int_tiers import INT_TIERS

        if options.get("quantization", "none") in INT_TIERS:  # W4A16 / INT8: dense only (MoE experts would stay bf16)
            return arch.name in FP8_ARCHITECTURES and arch.vllm_support == "native"
        if options.get("quantization", "none") != "none":
            return arch.name in FP8_ARCHITECTURES | QUANTIZED_MOE_ARCHITECTURES and arch.vllm_support == "native"
        return True

    def toolchain(self) -> dict[str, str]:
        from . import engine

        return {
            "hive_aot_vllm_format": str(FORMAT_VERSION),
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "numpy": _version("numpy"),
            "vllm_validation": engine.version(),
        }

    def build(self, ctx: BuildContext, out_dir: Path) -> BuiltArtifact:
        from .build import prepare_directory

        return prepare_directory(ctx, out_dir)

    def validate(self, ctx: BuildContext, artifact_dir: Path, files: dict[str, str]) -> ValidationReport:
        from ...core.host import memory_budget
        from ...model.memory import model_facts
        from .plan import layout
        from .validate import validate_prepared
        from .vision import is_vlm

        thresholds = ctx.recipe.validation
        digests = sorted(files.items())  # verified when staged: no second read of the artifact
        quantized = ctx.recipe.options.get("quantization", "none") != "none"
        how = layout(model_facts(ctx.snapshot), memory_budget()[0])  # what the plan of this budget counted
        metrics, details = validate_prepared(ctx, artifact_dir, digests, quantized,
                                             engine_required=bool(thresholds.require_engine_load), how=how)
        known_defect = details.get("vllm", {}).get("gating") is False  # engine_defects.py: vLLM's answer is not the model's
        if (not metrics.get("vllm_loaded") and not thresholds.require_engine_load) or known_defect:
            # The engine could not run this tier here (recorded in details.vllm): its gates wait for a host that can.
            thresholds = thresholds.model_copy(update={f: None for f in type(thresholds).model_fields
                                                       if f.startswith(("min_vllm_", "max_vllm_"))})
            if known_defect:  # one the engine cannot run at all is not required to load
                thresholds = thresholds.model_copy(update={"require_engine_load": False})
        if not is_vlm(ctx.config):  # no image prompt to gate
            thresholds = thresholds.model_copy(update={f: None for f in type(thresholds).model_fields if "_image_" in f})
        failures = check_thresholds(metrics, thresholds)
        return ValidationReport(passed=not failures, failures=failures, metrics=metrics, details=details)

    @staticmethod
    def summary(validation: dict[str, Any]) -> str:
        met = validation.get("metrics", {})
        line = Target.summary(validation)
        if met.get("vllm_loaded"):
            line += (f"; in vLLM: top-1 {metric_text(met.get('vllm_top1_agreement'), '.4f')} vs transformers, "
                     f"greedy {met.get('vllm_greedy_tokens_matched')} tokens")
            if "vllm_image_top1_agreement" in met:
                line += f"; with an image: top-1 {metric_text(met['vllm_image_top1_agreement'], '.4f')}"
            if validation.get("vllm", {}).get("gating") is False:
                names = ", ".join(d["name"] for d in validation["vllm"]["known_engine_defects"])
                line += f" (not gating: known engine defect {names})"
        elif "vllm_loaded" in met:
            line += f"; vLLM load not checked here: {validation.get('vllm', {}).get('reason', '')}"
        return line

    def serving(self, ctx: BuildContext, files: list[str]) -> dict[str, dict[str, Any]]:
        from .serving import describe

        return describe(ctx)


__all__ = ["VllmTarget", "FORMAT_VERSION"]
