"""The AI 100 targets' memory and disk estimates, per step.

qaic-export (decoders): the graph is traced from the config with placeholder weights (zero pages the kernel
never backs), then every weight streams from the safetensors into the external-data file in the stored
precision, a chunk of rows at a time (transposed where the graph multiplies by the transpose): memory is
the graph and a few chunks whatever the model's size; disk is the model at `weight_dtype` (fp16: half the
fp32 copy QEfficient writes). Its validation runs onnxruntime on the whole export when it fits the budget,
else on a layer slice of the same external-data file, next to the streamed reference of the same layers.
Encoders (BERT-class, at most a few hundred MB) are exported and checked whole. A vision-language model is a
decoder here (its language model streams the same way) plus its vision side (a few hundred MB to 2 GB in fp32),
held whole in every step.

qaic (a compile recipe): the bundle links the export's files; its validation predicts the device's quality
with the decoder streamed unit by unit, MXFP6 / fp16 applied to each weight as it loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...model.memory import (
    ACTIVATION_COPIES,
    BASE_STEP,
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
    whole_model,
)
from ...model.slicing import MIN_LAYERS

WEIGHT_DTYPES = ("float16", "float32")  # what the export stores weights as (option weight_dtype)

if TYPE_CHECKING:
    from ...model.memory import ModelFacts, PlanEnv

WEIGHT_BYTES = {"float16": 2, "float32": 4}
EXPORT_CHUNK_BYTES = 64 * MIB  # fp32 bytes of a weight converted at a time (export.CHUNK_BYTES)
EXPORT_CHUNK_COPIES = 4  # the rows read, widened, transposed, narrowed
GRAPH_BYTES_PER_LAYER = 8 * MIB  # the traced TorchScript graph and its ONNX protobuf, per decoder layer
BASE_ORT = 160 * MIB  # onnxruntime's session beyond the initializers it holds
ORT_WEIGHT_COPIES = 3  # each initializer as stored, its fp32 cast while a node runs, the allocator's arena
ENCODER_EXPORT_FACTOR = 2.2  # an encoder exported whole: the fp32 model and the protobuf's copy
PARITY_TOKENS = 64  # the ONNX parity prompts' length plus decode steps
QUALITY_CHUNK_ROWS = 4096  # quality._blockwise: rows emulated at a time
QUALITY_CHUNK_COPIES = 3  # fake_mxfp6's temporaries on one chunk at a time (blocks, rounded, result; measured)


@dataclass(frozen=True)
class OrtCheck:
    layers: int | None  # None: the whole export
    memory: int
    reason: str

    @property
    def mode(self) -> str:
        return "whole" if self.layers is None else "slice"

    def to_json(self) -> dict:
        return {"mode": self.mode, "layers": self.layers, "memory": self.memory, "memory_human": human_bytes(self.memory),
                "reason": self.reason}


def export_bytes(facts: ModelFacts, weight_dtype: str) -> int:
    """The export's external data: matrices at `weight_dtype`, vectors and RoPE tables fp32; a tied embedding is
    stored twice (the Gather's rows and the head's transposed MatMul weight)."""
    width = WEIGHT_BYTES[weight_dtype]
    tied_copy = facts.embedding if facts.tied else 0
    return (facts.matrix_parameters + tied_copy) * width + facts.vector_parameters * FP32 + SMALL_FILES


def slice_parameters(facts: ModelFacts, layers: int | None) -> int:
    if layers is None or layers >= facts.layers:
        return facts.parameters
    outside = max(facts.parameters - facts.layers * facts.largest_layer, facts.embedding + facts.lm_head)
    return outside + layers * facts.largest_layer


def ort_memory(facts: ModelFacts, layers: int | None, weight_dtype: str) -> int:
    width = WEIGHT_BYTES[weight_dtype]
    params = slice_parameters(facts, layers)
    largest_cast = facts.largest_tensor * FP32  # one initializer widened while its node runs
    return BASE_TORCH + BASE_ORT + params * width * ORT_WEIGHT_COPIES // 2 + largest_cast


def reference_resident(facts: ModelFacts, layers: int | None, budget: int) -> bool:
    """The reference of the checked layers kept in memory (as reference.reference_resident decides for the whole
    model: its fp32 copy 1.5 times over plus 1 GiB within the budget), else streamed unit by unit."""
    return slice_parameters(facts, layers) * FP32 * 3 // 2 + (1 << 30) < budget


def reference_slice_memory(facts: ModelFacts, layers: int | None, resident: bool) -> int:
    """The reference of the checked layers: resident (every unit kept) or streamed (one unit at a time), with
    prompt-sized activations and logits."""
    held = slice_parameters(facts, layers) if resident else max(facts.embedding, facts.largest_layer,
                                                                facts.lm_head or facts.embedding)
    return (BASE_TORCH + int(REFERENCE_UNIT_COPIES * held * FP32)
            + PARITY_TOKENS * facts.hidden_size * FP32 * ACTIVATION_COPIES
            + PARITY_TOKENS * facts.vocab_size * FP32 * REFERENCE_LOGIT_COPIES)


def ort_check(facts: ModelFacts, budget: int, weight_dtype: str) -> OrtCheck:
    whole = ort_memory(facts, None, weight_dtype)
    if whole <= budget or facts.layers <= MIN_LAYERS:
        return OrtCheck(None, whole, f"the whole export in onnxruntime needs {human_bytes(whole)}, within the budget "
                                     f"{human_bytes(budget)}")
    part = ort_memory(facts, MIN_LAYERS, weight_dtype)
    return OrtCheck(MIN_LAYERS, part, f"the whole export in onnxruntime would need {human_bytes(whole)}, over the budget "
                                      f"{human_bytes(budget)}: a graph of its first {MIN_LAYERS} layers over the same "
                                      f"external data ({human_bytes(part)})")


def vision_side(facts: ModelFacts, copies: float) -> tuple[int, str]:
    """A vision-language model's vision side held in fp32 `copies` times (0 for other models), and its words."""
    held = int(facts.vision_parameters * FP32 * copies)
    return held, (f" + the vision side held {human_bytes(held)} ({facts.vision_parameters / 1e9:.2f} B parameters "
                  f"x {copies:g} in fp32)" if held else "")


def export_steps(env: PlanEnv, encoder: bool, whole: str = "encoder", vision: bool = False) -> list[StepNeed]:
    """`encoder`: the model is loaded whole (an encoder, Whisper: `whole` names it), else a decoder streamed from
    its safetensors; `vision`: a vision-language model, its language model streamed as a decoder, its vision side
    held (its graph exported with its weights, checked whole in onnxruntime)."""
    facts = env.facts
    if encoder:
        out = facts.fp32_bytes + SMALL_FILES
        mem, detail = whole_model(facts, ENCODER_EXPORT_FACTOR, f"the {whole} loaded and exported whole, and its protobuf")
        check, detail_v = whole_model(facts, 2.2, f"the reference {whole} and the onnxruntime session")
        return [StepNeed("export", mem, disk=2 * out, where=env.work, detail=detail), env.publish(out),
                StepNeed("validate", check, disk=env.placed(out), where=env.work, detail=detail_v)]
    weight_dtype = env.options.get("weight_dtype", "float16")
    out = export_bytes(facts, weight_dtype)
    graph = facts.layers * GRAPH_BYTES_PER_LAYER
    held, held_text = vision_side(facts, ENCODER_EXPORT_FACTOR if vision else 0)  # weights + protobuf copy
    mem = BASE_TORCH + graph + EXPORT_CHUNK_COPIES * EXPORT_CHUNK_BYTES + held
    check = ort_check(facts, env.budget, weight_dtype)
    reference = reference_slice_memory(facts, check.layers, reference_resident(facts, check.layers, env.budget))
    checked, checked_text = vision_side(facts, 2 if vision else 0)  # the reference's and onnxruntime's
    validate = max(check.memory, reference) + checked
    return [StepNeed("export", mem, disk=out, where=env.work, detail=(
                f"torch {human_bytes(BASE_TORCH)} + the graph of {facts.layers} layers {human_bytes(graph)} + "
                f"{EXPORT_CHUNK_COPIES} x a chunk {human_bytes(EXPORT_CHUNK_BYTES)}{held_text}; weights in "
                f"{weight_dtype}")),
            env.publish(out),
            StepNeed("validate", validate, disk=env.placed(out) + SMALL_FILES, where=env.work, detail=(
                f"the larger of onnxruntime {human_bytes(check.memory)} and the streamed reference of the same "
                f"layers {human_bytes(reference)}{checked_text}; {check.reason}"))]


def bundle_steps(env: PlanEnv, decoder: bool, weight_dtype: str = "float16", whole: str = "encoder",
                 vision: bool = False) -> list[StepNeed]:
    facts = env.facts
    onnx = export_bytes(facts, weight_dtype)  # the input export, placed in the work dir
    steps = [StepNeed("bundle", BASE_STEP, disk=env.placed(onnx) + SMALL_FILES, where=env.work,
                      detail="the input export placed (hard links from a local store) and the compile inputs"),
             env.publish(SMALL_FILES, new_blobs=False)]
    if decoder:
        steps.append(env.reference())
        unit = max(facts.embedding, facts.largest_layer, facts.lm_head or facts.embedding)
        chunk = min(QUALITY_CHUNK_ROWS * max(facts.widest_row, facts.hidden_size) * FP32, facts.largest_tensor * FP32)
        held, held_text = vision_side(facts, 2 if vision else 0)  # read, and its fp16 emulation
        mem = (BASE_TORCH + 2 * unit * FP32 + QUALITY_CHUNK_COPIES * chunk + held
               + BATCH_TOKENS * facts.hidden_size * FP32 * ACTIVATION_COPIES
               + BATCH_TOKENS * facts.vocab_size * FP32)  # the logits of every position, kept for the comparison
        detail = (f"the retained-state decoder streamed: torch {human_bytes(BASE_TORCH)} + 2 x "
                  f"unit {human_bytes(unit * FP32)} (a weight and its emulated copy) + {QUALITY_CHUNK_COPIES} x a chunk "
                  f"{human_bytes(chunk)} for the MX emulation{held_text} + activations and logits of the parity texts")
    else:
        mem, detail = whole_model(facts, 2.2, f"the {whole} and its emulated copy")
    steps.append(StepNeed("validate", mem, disk=env.placed(onnx), where=env.work, detail=detail,
                          unit=unit_text(facts) if decoder else ""))
    return steps
