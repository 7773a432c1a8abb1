"""The vLLM target's memory and disk estimate, per step (prepare, publish, reference, validate), and the
layout of its validation at a given budget (which the validation itself follows).

- prepare streams: source shards that need no change are linked; every other tensor is converted a chunk of
  rows at a time (bf16 rounding, or FP8 quantization with per-row scales), so memory is a few chunks
  whatever the model's size.
- validate runs, one after the other, beside the parent (which holds the tokenizers and the logits it
  compares): the artifact in transformers (resident when its fp32 copy fits the budget with margin, else
  streamed unit by unit in a child, like the reference); on a slice check, the slice in transformers and the
  source's slice; and the vLLM engine on the whole artifact or the slice (engine_check.py). The step's peak
  is the largest of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...memory import (ACTIVATION_COPIES, BASE_TORCH, BATCH_TOKENS, FP32, MIB, REFERENCE_LOGIT_COPIES,
                       REFERENCE_UNIT_COPIES, SMALL_FILES, StepNeed, human_bytes, unit_text)
from .engine_check import EngineCheck, choose, weight_parameters

if TYPE_CHECKING:
    from ...memory import ModelFacts, PlanEnv

PREPARE_CHUNK_BYTES = 64 * MIB  # fp32 rows converted at a time (prepare.CHUNK_BYTES)
PREPARE_CHUNK_COPIES = 4  # fp32 rows, their bits, the rounded bits / e4m3 bytes, the scaled copy
RESIDENT_FACTOR = 1.05  # a resident streamed model: its fp32 parameters and little else (measured on the 1B model)
PARENT_LOGIT_COPIES = 2  # the artifact's logits in memory (W8A8, W8A16; a slice's are read back memory-mapped)
ENGINE_TOKENS = 512  # vLLM's max_model_len for the validation's sequences (the KV cache it reserves)


@dataclass(frozen=True)
class ValidationLayout:
    resident: bool  # the artifact's fp32 model fits the budget with margin: kept in memory, in process
    check: EngineCheck
    slice_resident: bool = True  # a slice check's layers in transformers fit with margin (else streamed)

    def to_json(self) -> dict:
        return {"artifact_run": "resident" if self.resident else "streamed", "engine_check": self.check.to_json(),
                "slice_run": "resident" if self.slice_resident else "streamed"}


def vllm_bytes(facts: "ModelFacts", quantization: str) -> int:
    if quantization == "none":
        return facts.parameters * 2 + SMALL_FILES  # bf16
    # FP8 W8A8: the linear layers' weights one byte each (plus a scale per row); embeddings, lm_head and
    # vectors stay bf16.
    kept_bf16 = facts.embedding + facts.lm_head + facts.vector_parameters
    scales = facts.matrix_parameters // max(facts.hidden_size, 1) * FP32  # one fp32 scale per output row
    return max(facts.parameters - kept_bf16, 0) + kept_bf16 * 2 + scales + SMALL_FILES


def parent_memory(facts: "ModelFacts") -> int:
    """The validating parent: torch and the tokenizers, the logits it holds for the comparisons."""
    return BASE_TORCH + PARENT_LOGIT_COPIES * BATCH_TOKENS * facts.vocab_size * FP32


def resident_memory(facts: "ModelFacts", parameters: int) -> int:
    return int(parameters * FP32 * RESIDENT_FACTOR) + BATCH_TOKENS * facts.vocab_size * FP32 * REFERENCE_LOGIT_COPIES


def streamed_memory(facts: "ModelFacts") -> int:
    """The artifact streamed unit by unit in a child over the batched parity texts: two units, the batch's
    activations and logits (the reference's terms, at the batch's size)."""
    unit = max(facts.embedding, facts.largest_layer, facts.lm_head or facts.embedding)
    return (BASE_TORCH + int(REFERENCE_UNIT_COPIES * unit * FP32)
            + BATCH_TOKENS * facts.hidden_size * FP32 * ACTIVATION_COPIES
            + BATCH_TOKENS * facts.vocab_size * FP32 * REFERENCE_LOGIT_COPIES)


def fits_resident(facts: "ModelFacts", parameters: int, budget: int) -> bool:
    """The reference's rule (reference.reference_resident): the fp32 copy 1.5 times over plus 1 GiB, within the
    budget; and beside the validating parent."""
    return (parameters * FP32 * 3 // 2 + (1 << 30) < budget
            and parent_memory(facts) + resident_memory(facts, parameters) < budget)


def layout(facts: "ModelFacts", budget: int) -> ValidationLayout:
    """How this budget lets the validation run: the artifact resident or streamed, the engine on the whole
    artifact or a slice, the slice's layers in transformers resident or streamed."""
    check = choose(facts, budget, parent_memory(facts), ENGINE_TOKENS)
    return ValidationLayout(fits_resident(facts, facts.parameters, budget), check,
                            fits_resident(facts, weight_parameters(facts, check.layers), budget))


def plan_steps(env: "PlanEnv") -> list[StepNeed]:
    facts, opts = env.facts, env.options
    quantization = opts.get("quantization", "none")
    out = vllm_bytes(facts, quantization)
    prepare = BASE_TORCH + PREPARE_CHUNK_COPIES * PREPARE_CHUNK_BYTES
    steps = [StepNeed("prepare", prepare, disk=out, where=env.work,
                      detail=f"torch {human_bytes(BASE_TORCH)} + {PREPARE_CHUNK_COPIES} x a chunk of rows "
                             f"{human_bytes(PREPARE_CHUNK_BYTES)} (source shards that need no change are linked)"),
             env.publish(out), env.reference()]
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
