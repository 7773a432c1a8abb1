"""The GGUF target's memory and disk estimate, per step (convert, imatrix, quantize, publish, reference,
validate), from the model's facts (memory.ModelFacts) and the recipe's options.

The converter streams one tensor at a time; libllama's quantizer reads a lossless intermediate it maps and
writes the quantized file; llama.cpp evaluates the GGUF from its mapping (a quantized one repacked in
anonymous memory up to GGUF_REPACK_MAX_BYTES), beside the parent holding the reference logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.units import parse_size
from ...model.memory import BASE_PYTHON, BASE_TORCH, FP32, MIB, SMALL_FILES, StepNeed, human_bytes, reference_in_process
from .tensor_quant import direct as quantized_as_it_streams

if TYPE_CHECKING:
    from ...model.memory import ModelFacts, PlanEnv

BASE_LLAMA_QUANTIZE = 307 * MIB  # libllama's quantizer child (its own interpreter + llama.cpp)
# llama.cpp's evaluator child (interpreter, numpy, libllama and its graph), beside its logits and KV cache counted
# on their own: measured 125 MiB beyond the mapped file for SmolLM2-135M's f16 and Q4_1 GGUFs, of which ~55 MiB
# were its logits at the prompts' real length. (410 MiB until the validating parent stopped importing torch,
# whose 0.3 GiB hid how far over this was: the plan was 1.9x what a 207M model's validation used.)
BASE_LLAMA_EVAL = 96 * MIB
# The converter (convert.py) streams rowwise rules through row slices (SLICE_BYTES of fp32, widened and encoded on
# worker threads: a few in flight, each with its encoded copy) and holds whole only the tensors of a rule whose
# transform needs all of them (a Q/K permutation, a fused QKV split): those and their result.
CONVERT_SLICE_BYTES = 16 * MIB
CONVERT_SLICES = 4  # slices in flight (encode threads + 1) with their encoded copies, measured
WHOLE_RULE_COPIES = 2  # a whole-tensor rule's inputs in fp32 and its results
EXPERT_SLICE_COPIES = 2.5  # one expert of a fused tensor: its fp32 rows, their rearranged copy, the f16 result
QUANTIZE_TENSOR_COPIES = 2  # libllama dequantizes one tensor to fp32 and writes its quantized copy

# llama.cpp evaluation (validation of a GGUF): KV cache and output buffers at VALIDATE_CTX tokens.
VALIDATE_CTX = 512
LOSSLESS_GGUF_TYPES = ("f32", "f16", "bf16")
GGUF_SHARD_HEADER = 1 * MIB  # a split GGUF's later shards: their own header, tensor infos, split.* keys, padding
# validate.REPACK_MAX_BYTES (that module imports numpy; this one must not): larger GGUFs are evaluated from the
# mapped file, without a repacked copy
GGUF_REPACK_MAX_BYTES = 8 << 30
KV_BYTES = 4  # per cached value (llama.cpp's default f16 cache would be 2: the estimate keeps room for f32)
LLAMA_LOGIT_COPIES = 2  # llama.cpp's output buffer and llama-cpp-python's scores array
PARENT_LOGIT_COPIES = 2  # the parent's reference logits and the child's, loaded back for the comparison
RECURRENT_BYTES = 4  # llama.cpp keeps recurrent state (Mamba's conv and SSM state, ...) in f32, one per sequence


# Output sizes. GGUF: 1-D tensors stay f32; 2-D tensors take the file type's bits per weight (llama.cpp's
# averages over a model's mix of types: a k-quant keeps some tensors at a higher type); rows that are not
# whole blocks fall back to a larger type (counted as f16, the worst).
GGUF_DIRECT_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}
LLAMA_FTYPE_BITS = {
    "Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5, "Q2_K": 3.35, "Q3_K_S": 3.5, "Q3_K_M": 3.91,
    "Q3_K_L": 4.27, "Q4_K_S": 4.58, "Q4_K_M": 4.85, "Q5_K_S": 5.54, "Q5_K_M": 5.7, "Q6_K": 6.56, "IQ4_NL": 4.5,
    "IQ4_XS": 4.25, "TQ1_0": 1.69, "TQ2_0": 2.06,
}
UNKNOWN_FTYPE_BITS = 8.5  # a file type missing from the table: assume the largest quantized one
LLAMA_SUPERBLOCK_FTYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ", "TQ")  # file types of 256-blocks
FALLBACK_32_BITS = 8.5  # what a k-quant's rows of 32-blocks fall back to, at most (q8_0)
GGUF_METADATA_BASE = 1 * MIB  # hyperparameters, chat template
GGUF_METADATA_PER_TOKEN = 64  # token text, score, type and merges per vocabulary entry

def gguf_bytes(facts: ModelFacts, file_type: str) -> int:
    """The size of a GGUF of the model: `file_type` is a converter outtype (f16, q8_0, ...) or a llama.cpp
    ftype (Q4_K_M, ...)."""
    vectors = facts.vector_parameters * FP32
    metadata = GGUF_METADATA_BASE + facts.vocab_size * GGUF_METADATA_PER_TOKEN
    direct = GGUF_DIRECT_BYTES.get(file_type.lower())
    if direct is not None:
        if file_type.lower() == "q8_0":  # rows that are not whole q8_0 blocks are written f16
            whole = facts.kquant_rows_parameters + facts.q8_rows_parameters
            matrices = whole * direct + (facts.matrix_parameters - whole) * 2
        else:
            matrices = facts.matrix_parameters * direct
        return int(matrices) + vectors + metadata
    bits = LLAMA_FTYPE_BITS.get(file_type.upper(), UNKNOWN_FTYPE_BITS)
    if file_type.upper().startswith(LLAMA_SUPERBLOCK_FTYPES):
        # Rows of whole 32-blocks but not 256-superblocks fall back to a legacy type: q8_0 at most.
        blocked, legacy = facts.kquant_rows_parameters, facts.q8_rows_parameters * max(bits, FALLBACK_32_BITS)
    else:
        blocked, legacy = facts.kquant_rows_parameters + facts.q8_rows_parameters, 0.0
    other = facts.matrix_parameters - facts.kquant_rows_parameters - facts.q8_rows_parameters  # f16 fallback
    return int((blocked * bits + legacy) / 8) + other * 2 + vectors + metadata


def gguf_shards(facts: ModelFacts, file_type: str, split: int) -> int:
    """How many shards a split GGUF of `file_type` has: whole tensors packed in order into shards of at most
    `split` bytes, one larger than that alone in its own (the writer's rule), at the type's bytes per element."""
    per_element = gguf_bytes(facts, file_type) / max(1, facts.parameters)
    shards, used = 1, 0
    for n in facts.tensor_sizes or (facts.parameters,):
        size = n * per_element
        if used and used + size > split:
            shards, used = shards + 1, 0
        used += size
    return shards


def lossless_gguf_type(facts: ModelFacts) -> str:
    """The intermediate a k-quant is made from: the source's one float type, else f32 (as the GGUF target does)."""
    if len(facts.float_dtypes) == 1:
        return {"F32": "f32", "F16": "f16", "BF16": "bf16"}[facts.float_dtypes[0]]
    return "f32"


def recurrent_cache(config: dict) -> tuple[int | None, int]:
    """(layers with a KV cache, f32 values of recurrent state per sequence) of a recurrent or hybrid GGUF family
    (Family.kv_layers / recurrent_state: a Mamba-2 hybrid caches K and V in its attention layers only, and a
    state per Mamba layer); (None, 0) for the others and for configs the converter refuses."""
    from ...core.errors import ModelFormatError
    from .families import BY_ARCHITECTURE, HParams  # numpy, as `supports` already loaded it

    tc = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    family = BY_ARCHITECTURE.get(((tc.get("architectures") or config.get("architectures")) or [None])[0])
    if family is None:
        return None, 0
    hp = HParams(tc)
    try:
        family = family.for_config(hp)
        if family.recurrent_state is None:
            return None, 0
        return (None if family.kv_layers is None else family.kv_layers(hp)), family.recurrent_state(hp)
    except (ModelFormatError, TypeError, ValueError):  # refused in one line when it converts
        return None, 0


def plan_steps(env: PlanEnv) -> list[StepNeed]:
    facts, opts, work = env.facts, env.options, env.work
    largest = env.largest
    steps: list[StepNeed] = []
    # The building process imports torch only to compute a reference that fits in it: a streamed reference runs in
    # a child, the tokenizer's answers come from a cache or a child, conversion and llama.cpp need neither.
    parent_base = BASE_TORCH if reference_in_process(facts.fp32_bytes, env.budget) else BASE_PYTHON
    reference = env.reference(parent_base)
    validation_logits = VALIDATE_CTX * facts.vocab_size * FP32
    ftype = opts.get("ftype")
    out = gguf_bytes(facts, ftype or opts.get("outtype", "f16"))
    attention = facts.hidden_size * (facts.hidden_size + 2 * facts.kv_heads * facts.head_dim) * FP32  # a fused QKV
    whole = min(attention, env.largest)
    # a fused expert tensor [E, ...] is rearranged an expert at a time (sliced.py): a slice is at least one expert,
    # held in fp32 beside its rearranged copy and its encoded bytes
    slice_bytes = max(CONVERT_SLICE_BYTES, int(facts.largest_stacked_expert * FP32 * EXPERT_SLICE_COPIES))
    mem = BASE_PYTHON + CONVERT_SLICES * slice_bytes + WHOLE_RULE_COPIES * whole
    detail = (f"python {human_bytes(BASE_PYTHON)} + {CONVERT_SLICES} row slices of {human_bytes(slice_bytes)} + "
              f"{WHOLE_RULE_COPIES} x an attention projection {human_bytes(whole)} fp32 (rules that transform whole tensors)")
    split = parse_size(str(opts["split_max_size"]), "split_max_size") if opts.get("split_max_size") else 0
    if split:
        # Shards hold whole tensors, packed in order (a tensor larger than the limit gets a shard of its own),
        # each with its own header. A k-quant made through an intermediate keeps the intermediate's shards.
        lossless = lossless_gguf_type(facts) if ftype and not quantized_as_it_streams(opts) else None
        shards = gguf_shards(facts, lossless or ftype or opts.get("outtype", "f16"), split)
        out += (shards - 1) * GGUF_SHARD_HEADER
        detail += f"; about {shards} shard(s) of at most {human_bytes(split)}"
    if opts.get("imatrix"):
        # The streamed transformers model over the calibration text: the reference's memory, a small file.
        steps.append(StepNeed("imatrix", reference.memory, disk=SMALL_FILES, where=work,
                              detail=f"the streamed fp32 model over the calibration text ({reference.detail})"))
    if ftype and quantized_as_it_streams(opts):
        steps.append(StepNeed("convert", mem, disk=out, where=work, detail=(
            f"{detail}; each tensor quantized to {str(ftype).upper()} as it streams (no intermediate)")))
    elif ftype:
        inter_type = lossless_gguf_type(facts)
        inter = gguf_bytes(facts, inter_type)
        steps.append(StepNeed("convert", mem, disk=inter, where=work,
                              detail=f"{detail}; writes the {inter_type} intermediate"))
        qmem = BASE_PYTHON + BASE_LLAMA_QUANTIZE + QUANTIZE_TENSOR_COPIES * largest
        steps.append(StepNeed("quantize", qmem, mapped=inter, disk=inter + out, where=work, detail=(
            f"parent {human_bytes(BASE_PYTHON)} + libllama {human_bytes(BASE_LLAMA_QUANTIZE)} + "
            f"{QUANTIZE_TENSOR_COPIES} x largest tensor {human_bytes(largest)} fp32; the {inter_type} "
            f"intermediate mapped and the {str(ftype).upper()} output on disk at once")))
    else:
        steps.append(StepNeed("convert", mem, disk=out, where=work, detail=detail))
    steps += [env.publish(out, base=parent_base), reference]
    kv_layers, state_values = recurrent_cache(env.config)
    cached = facts.layers if kv_layers is None else kv_layers  # a hybrid's attention layers only
    kv = VALIDATE_CTX * cached * facts.kv_heads * facts.head_dim * 2 * KV_BYTES
    state = state_values * RECURRENT_BYTES  # one sequence's, whatever its length
    # llama.cpp's CPU backend repacks quantized weights (Q4_0, Q4_K, IQ4_NL, ...) into interleaved rows
    # in anonymous memory: measured at 8B, Q4_K_M's evaluator held 3.9 GiB anon for a 4.6 GiB file.
    # Up to GGUF_REPACK_MAX_BYTES only: a larger GGUF is evaluated from the mapped file.
    quantized = str(ftype or opts.get("outtype", "f16")).lower() not in LOSSLESS_GGUF_TYPES
    repacked = out if quantized and out <= GGUF_REPACK_MAX_BYTES else 0
    child = BASE_LLAMA_EVAL + kv + state + validation_logits * LLAMA_LOGIT_COPIES + repacked
    parent = parent_base + validation_logits * PARENT_LOGIT_COPIES
    steps.append(StepNeed("validate", child + parent, mapped=out, disk=env.placed(out) + validation_logits, where=work,
                          detail=(f"llama.cpp {human_bytes(BASE_LLAMA_EVAL)} + KV cache {human_bytes(kv)} + "
                                  + (f"recurrent state {human_bytes(state)} + " if state else "")
                                  + f"{LLAMA_LOGIT_COPIES} x logits {human_bytes(validation_logits)}"
                                  + (f" + repacked weights {human_bytes(repacked)}" if repacked else "")
                                  + f"; parent {human_bytes(parent_base)} + {PARENT_LOGIT_COPIES} x logits; "
                                  "the GGUF mapped")))
    return steps
