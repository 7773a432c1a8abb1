"""The vLLM target's memory and disk estimate, per step (prepare, publish, reference, validate), and the
layout of its validation at a given budget (which the validation itself follows).

- prepare streams: source shards that need no change are linked; every other tensor is converted a chunk of
  rows at a time (bf16 rounding, or FP8 / INT8 quantization with per-row scales), so memory is a few chunks
  whatever the model's size.
- calibrate (W4A16 only): GPTQ over the calibration text on the streamed model, in a child (calibrate.py): one
  decoder layer resident in fp32, the Hessians of its inputs (three hidden-wide ones and the widest input's),
  one more widest-input matrix while GPTQ factors it, a few copies of the largest weight and the calibration
  tokens' activations; the quantized layers written to the work dir before the shards are.
- validate runs, one after the other, beside the parent (which holds the tokenizers and the logits it
  compares): the artifact in transformers (resident when its fp32 copy fits the budget with margin, else
  streamed unit by unit in a child, like the reference); on a slice check, the slice in transformers and the
  source's slice; and the vLLM engine on the whole artifact or the slice (engine_check.py). The step's peak
  is the largest of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...model.memory import (
    ACTIVATION_COPIES,
    BASE_TORCH,
    BATCH_TOKENS,
    FP32,
    MIB,
    REFERENCE_LOGIT_COPIES,
    REFERENCE_UNIT_COPIES,
    SMALL_FILES,
    StepNeed,
    human_bytes,
    unit_text,
)
from .engine_check import EngineCheck, choose, weight_parameters
from .pack import GROUP_SIZE
from .vision import IMAGE_CHECK_TOKENS

if TYPE_CHECKING:
    from ...model.memory import ModelFacts, PlanEnv

PREPARE_CHUNK_BYTES = 64 * MIB  # fp32 rows converted at a time (prepare.CHUNK_BYTES)
PREPARE_CHUNK_COPIES = 4  # fp32 rows, their bits, the rounded bits / e4m3 bytes, the scaled copy
RESIDENT_FACTOR = 1.05  # a resident streamed model: its fp32 parameters and little else (measured on the 1B model)
PARENT_LOGIT_COPIES = 2  # the artifact's logits in memory (W8A8, W8A16; a slice's are read back memory-mapped)
ENGINE_TOKENS = 512  # vLLM's max_model_len for the validation's sequences (the KV cache it reserves)
# The calibration text's tokens at most (2.6 KB of text: SmolLM2's tokenizer makes 787 of it), run as one batch
CALIBRATION_TOKENS = 1024
# The MLP's intermediate activations per token beside the hidden-wide ones (ACTIVATION_COPIES): gate, up, their
# product, and the down projection's input kept by its Hessian hook
INTERMEDIATE_COPIES = 4
GPTQ_WEIGHT_COPIES = 3  # GPTQ's working copy of a weight, its dequantized result, the block update's product
UNITS_BESIDE_OUTPUT = 2  # calibrated layers still on disk while the shards are written (int_tiers._Calibrated)


@dataclass(frozen=True)
class ValidationLayout:
    resident: bool  # the artifact's fp32 model fits the budget with margin: kept in memory, in process
    check: EngineCheck
    slice_resident: bool = True  # a slice check's layers in transformers fit with margin (else streamed)

    def to_json(self) -> dict:
        return {"artifact_run": "resident" if self.resident else "streamed", "engine_check": self.check.to_json(),
                "slice_run": "resident" if self.slice_resident else "streamed"}


def vllm_bytes(facts: ModelFacts, quantization: str) -> int:
    if quantization == "none":
        return facts.parameters * 2 + SMALL_FILES  # bf16
    # FP8 / INT8 W8A8: the linear layers' weights one byte each (plus a scale per row); W4A16 half a byte (plus a
    # bf16 scale per 128); embeddings, lm_head and vectors stay bf16.
    kept_bf16 = facts.embedding + facts.lm_head + facts.vector_parameters
    linear = max(facts.parameters - kept_bf16, 0)
    if quantization == "w4a16-gptq":
        return quantized_linear_bytes(facts) + kept_bf16 * 2 + SMALL_FILES
    scales = facts.matrix_parameters // max(facts.hidden_size, 1) * FP32  # one fp32 scale per output row
    return linear + kept_bf16 * 2 + scales + SMALL_FILES


def quantized_linear_bytes(facts: ModelFacts) -> int:
    """W4A16's linear layers: two values a byte and a bf16 scale per group of 128 (narrower groups only where a
    layer's width is not a multiple of 128: small models, whose scales do not matter to the disk)."""
    linear = max(facts.parameters - facts.embedding - facts.lm_head - facts.vector_parameters, 0)
    return linear // 2 + linear // GROUP_SIZE * 2


def calibration_memory(facts: ModelFacts) -> tuple[int, str]:
    """The GPTQ child over the calibration text (calibrate.py), and the building parent waiting for it."""
    hidden, widest = facts.hidden_size, max(facts.widest_row, facts.hidden_size)
    layer = int(REFERENCE_UNIT_COPIES * (facts.largest_streamed_layer or facts.largest_layer) * FP32)
    hessians = (3 * hidden * hidden + 2 * widest * widest) * FP32
    weights = GPTQ_WEIGHT_COPIES * facts.largest_layer_tensor * FP32
    activations = CALIBRATION_TOKENS * (hidden * ACTIVATION_COPIES + widest * INTERMEDIATE_COPIES) * FP32
    embedding = int(REFERENCE_UNIT_COPIES * facts.embedding * FP32)  # the first unit, gone before the layers run
    total = 2 * BASE_TORCH + max(layer + hessians + weights, embedding) + activations
    return total, (f"a child: torch {human_bytes(BASE_TORCH)} + {REFERENCE_UNIT_COPIES:g} x a decoder layer "
                   f"{human_bytes(layer)} fp32 + its Hessians and GPTQ's factor {human_bytes(hessians)} (3 x "
                   f"{hidden}^2 + 2 x {widest}^2 fp32) + {GPTQ_WEIGHT_COPIES} x its largest weight "
                   f"{human_bytes(weights)} + {CALIBRATION_TOKENS} calibration tokens' activations "
                   f"{human_bytes(activations)}; the parent waiting {human_bytes(BASE_TORCH)}")


def parent_memory(facts: ModelFacts) -> int:
    """The validating parent: torch and the tokenizers, the logits it holds for the comparisons."""
    return BASE_TORCH + PARENT_LOGIT_COPIES * BATCH_TOKENS * facts.vocab_size * FP32


def resident_memory(facts: ModelFacts, parameters: int) -> int:
    return int(parameters * FP32 * RESIDENT_FACTOR) + BATCH_TOKENS * facts.vocab_size * FP32 * REFERENCE_LOGIT_COPIES


def streamed_memory(facts: ModelFacts) -> int:
    """The artifact streamed unit by unit in a child over the batched parity texts: two units, the batch's
    activations and logits (the reference's terms, at the batch's size); a VLM's vision side held whole through
    its image prompt (vision.py)."""
    unit = max(facts.embedding, facts.largest_layer, facts.lm_head or facts.embedding)
    return (BASE_TORCH + int(REFERENCE_UNIT_COPIES * unit * FP32) + facts.vision_parameters * FP32
            + BATCH_TOKENS * facts.hidden_size * FP32 * ACTIVATION_COPIES
            + BATCH_TOKENS * facts.vocab_size * FP32 * REFERENCE_LOGIT_COPIES)


def fits_resident(facts: ModelFacts, parameters: int, budget: int) -> bool:
    """The reference's rule (reference.reference_resident): the fp32 copy 1.5 times over plus 1 GiB, within the
    budget; and beside the validating parent."""
    return (parameters * FP32 * 3 // 2 + (1 << 30) < budget
            and parent_memory(facts) + resident_memory(facts, parameters) < budget)


def layout(facts: ModelFacts, budget: int) -> ValidationLayout:
    """How this budget lets the validation run: the artifact resident or streamed, the engine on the whole
    artifact or a slice, the slice's layers in transformers resident or streamed."""
    # a vision-language model's image prompt takes up to IMAGE_CHECK_TOKENS more of the engine's context (vision.py)
    check = choose(facts, budget, parent_memory(facts), ENGINE_TOKENS + (IMAGE_CHECK_TOKENS if facts.vision_parameters else 0))
    return ValidationLayout(fits_resident(facts, facts.parameters, budget), check,
                            fits_resident(facts, weight_parameters(facts, check.layers), budget))


def plan_steps(env: PlanEnv) -> list[StepNeed]:
    facts, opts = env.facts, env.options
    quantization = opts.get("quantization", "none")
    out = vllm_bytes(facts, quantization)
    prepare = BASE_TORCH + PREPARE_CHUNK_COPIES * PREPARE_CHUNK_BYTES
    calibrated = quantized_linear_bytes(facts) if quantization == "w4a16-gptq" else 0  # the work dir's unit files
    # the shards take the calibrated units' tensors in checkpoint order, each unit file deleted once taken
    units_left = UNITS_BESIDE_OUTPUT * calibrated // max(facts.layers, 1)
    steps = [StepNeed("prepare", prepare, disk=out + units_left, where=env.work,
                      detail=f"torch {human_bytes(BASE_TORCH)} + {PREPARE_CHUNK_COPIES} x a chunk of rows "
                             f"{human_bytes(PREPARE_CHUNK_BYTES)} (source shards that need no change are linked)"
                             + (f"; {UNITS_BESIDE_OUTPUT} calibrated layers beside the output at most (each deleted "
                                "once the shards have its tensors)" if calibrated else "")),
             env.publish(out), env.reference()]
    if calibrated:
        memory, detail = calibration_memory(facts)
        steps.insert(0, StepNeed("calibrate", memory, disk=calibrated, where=env.work, detail=detail,
                                 unit=f"a decoder layer with its Hessians, {human_bytes(memory - 2 * BASE_TORCH)}"))
    how = layout(facts, env.budget)
    parent = parent_memory(facts)  # while the artifact's logits are held (until the engine compares with them)
    phases = {}
    if how.resident:
        phases["the artifact resident in transformers"] = parent + resident_memory(facts, facts.parameters)
    else:
        phases["the artifact streamed in a child"] = parent + streamed_memory(facts)
    if how.check.layers is None:
        phases["vLLM on the whole artifact"] = parent + how.check.memory
    else:  # a slice check: the whole artifact's logits were compared and dropped; the slice's are memory-mapped
        slice_params = weight_parameters(facts, how.check.layers)
        phases[f"its {how.check.layers}-layer slice in transformers (a child)"] = BASE_TORCH + (
            BASE_TORCH + resident_memory(facts, slice_params) if how.slice_resident else streamed_memory(facts))
        phases["vLLM on the slice"] = BASE_TORCH + how.check.memory
    peak = max(phases.values())
    slice_disk = 2 * weight_parameters(facts, how.check.layers) if how.check.layers is not None else 0
    steps.append(StepNeed("validate", peak, disk=env.placed(out) + SMALL_FILES + slice_disk, where=env.work,
        unit=unit_text(facts),
        detail="the largest of: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in phases.items())
        + f" (the validating parent included); {how.check.reason}"))
    return steps
