"""The memory and disk plan of a build: each step's peak need, estimated before any work, against what the
host has.

A build that cannot fit must say so in one line before it spends an hour, not die from the kernel's OOM
killer (which leaves no message of its own) or fill the disk halfway. So every recipe's steps estimate, from
the safetensors headers and config.json only (no weight is read):

- `memory`: peak resident anonymous memory of the step, all its processes together (a native engine's child
  and the parent waiting for it): what the kernel cannot drop. Checked against the budget:
  `HIVE_AOT_MEMORY_BUDGET` (`12G`, `12GiB`, `800M`, bytes), else the memory this host has available
  (MemAvailable, capped by the cgroup's limit).
- `mapped`: file pages the step maps read-only (llama.cpp reads GGUFs through mmap). The page cache can drop
  them and read them again, so they are reported and never counted against the budget.
- `disk`: bytes the step holds at once on the file system of `where` (the work root, the reference cache or a
  local store); `kept`: what of it stays after the step (the blobs in the store). A local store on the work
  root's file system receives the build's files as hard links, so publishing costs no second copy; an S3
  store costs only the work root.

The estimates are formulas over a few facts of the model (parameters, the largest tensor, the largest decoder
layer, the embedding and lm_head, the vocabulary); every constant is named below with what it stands for, so
measured peaks can recalibrate them. They err on the large side.

Disk full during a build (ENOSPC, a quota, or EFBIG from a process's file size limit) is the same kind of
error (`DiskFull`, a ResourceError): one line naming the step, the file system and its free space.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, DiskFull, ResourceError
from .paths import cache_root, work_root

if TYPE_CHECKING:
    from .build import Plan
    from .safetensors_io import TensorInfo
    from .sources import Snapshot
    from .store import Store

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
FP32 = 4  # bytes per float32 value

# --- Calibration constants (bytes or multipliers). Measured peaks should land just below the estimates. ---
# Resident size of a process before it holds any tensor:
BASE_PYTHON = 256 * MIB  # interpreter + numpy + gguf + tokenizers: the streaming converters' process
BASE_TORCH = 716 * MIB  # + torch and transformers: the reference, vLLM / AI 100 validation, the ONNX export
BASE_LLAMA_QUANTIZE = 307 * MIB  # libllama's quantizer child (its own interpreter + llama.cpp)
BASE_LLAMA_EVAL = 410 * MIB  # llama.cpp's evaluator child (interpreter + llama.cpp + its graph)
BASE_VLLM = 2 * GIB  # the vLLM CPU engine's process (vLLM, its torch and transformers) before weights
BASE_ORT = 128 * MIB  # onnxruntime's session overhead beyond the initializers it holds

# Streaming steps hold one tensor at a time, in a few float32 working copies:
CONVERT_TENSOR_COPIES = 3  # GGUF converter: fp32 widening, the family's transform, the encoded copy
QUANTIZE_TENSOR_COPIES = 2  # libllama dequantizes one tensor to fp32 and writes its quantized copy
PREPARE_TENSOR_COPIES = 4  # vLLM bf16: fp32, uint32 bits, the rounded bits, the bf16 result
PREPARE_FP8_TENSOR_COPIES = 6  # vLLM FP8: + the scaled copy and the relative error's difference
QUALITY_TENSOR_COPIES = 4  # AI 100 MX emulation rewrites one weight at a time next to the whole model

# The reference streams the model one unit at a time (the input embedding, each decoder layer, the final norm,
# the lm_head): two units resident (the one computing and the next one loading).
REFERENCE_UNIT_COPIES = 2
REFERENCE_TOKENS = 512  # the longest sequence a validation evaluates (parity texts, generation)
ACTIVATION_COPIES = 16  # hidden states, residuals, attention and MLP intermediates per token, fp32
REFERENCE_LOGIT_COPIES = 3  # the logits, their float copy and the cached result, [tokens x vocab] fp32

# llama.cpp evaluation (validation of a GGUF): KV cache and output buffers at VALIDATE_CTX tokens.
VALIDATE_CTX = 512
LOSSLESS_GGUF_TYPES = ("f32", "f16", "bf16")
GGUF_SHARD_HEADER = 1 * MIB  # a split GGUF's later shards: their own header, tensor infos, split.* keys, padding
GGUF_REPACK_MAX_BYTES = 8 << 30  # targets/gguf/validate.REPACK_MAX_BYTES (that module imports numpy; this one must not)  # llama.cpp evaluates these from the mapped file, no repacked copy
KV_BYTES = 4  # per cached value (llama.cpp's default f16 cache would be 2: the estimate keeps room for f32)
LLAMA_LOGIT_COPIES = 2  # llama.cpp's output buffer and llama-cpp-python's scores array
PARENT_LOGIT_COPIES = 2  # the parent's reference logits and the child's, loaded back for the comparison

# Steps that load a whole model through transformers, in fp32:
WHOLE_MODEL_FP32_FACTOR = 1.2  # the parameters plus from_pretrained's slack (buffers, allocator)
FP8_DEQUANTIZED_FACTOR = 2.2  # vLLM FP8 validation: the dequantized state dict and the model it fills
ONNX_EXPORT_FACTOR = 2.2  # the fp32 model and the ONNX protobuf's copy of every initializer
ORT_PARITY_FACTOR = 2.2  # the fp32 reference model and the onnxruntime session's initializers
VLLM_KV_CACHE_DEFAULT_GIB = 1  # VLLM_CPU_KVCACHE_SPACE the validation sets unless the environment does

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
KQUANT_BLOCK = 256  # row length a k-quant needs (llama.cpp falls back for other rows)
Q8_0_BLOCK = 32  # row length the legacy types (q4_0 ... q8_0) need; other rows are written f16
LLAMA_SUPERBLOCK_FTYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ", "TQ")  # file types of 256-blocks
FALLBACK_32_BITS = 8.5  # what a k-quant's rows of 32-blocks fall back to, at most (q8_0)
GGUF_METADATA_BASE = 1 * MIB  # hyperparameters, chat template
GGUF_METADATA_PER_TOKEN = 64  # token text, score, type and merges per vocabulary entry
ONNX_EXTERNAL_DATA_THRESHOLD = 2 * GIB  # export.EXTERNAL_DATA_THRESHOLD: past it the export goes through scratch
SMALL_FILES = 64 * MIB  # tokenizer, config, reports, a validation's result files

BUDGET_ENV = "HIVE_AOT_MEMORY_BUDGET"
BUILD_STEP = {"gguf": "convert", "vllm": "prepare", "qaic-export": "export", "qaic": "bundle"}
# Kinds whose build itself loads the whole model in fp32 (the others stream a tensor at a time).
WHOLE_MODEL_BUILD_KINDS = frozenset({"qaic-export"})

# Config sizes beyond these are not a model (compat.check.PLAUSIBLE refuses the same before any build; the plan
# refuses them too, so that nothing multiplies them into numbers no float can print).
_CONFIG_BOUNDS = {"hidden_size": 131072, "num_hidden_layers": 2048, "num_attention_heads": 4096,
                  "num_key_value_heads": 4096, "vocab_size": 8_388_608, "head_dim": 4096}
_CONFIG_KEYS = {
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "head_dim": ("head_dim",),
}
# A decoder/encoder layer's tensors share a `<...>.layers.N.` prefix (Llama, Mistral, Qwen), `h.N.` (GPT-2,
# Falcon, Bloom), `blocks.N.` (RWKV, Mamba) or `layer.N.` (BERT).
_LAYER = re.compile(r"^(.*?(?:^|\.)(?:layers|h|blocks|layer)\.\d+)\.")
_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "tok_embeddings.weight",
                       "embed_in.weight", "embedding.weight")
_LM_HEAD_SUFFIXES = ("lm_head.weight", "embed_out.weight", "output.weight")


@dataclass(frozen=True)
class ModelFacts:
    """What the estimates need from a model, in elements (not bytes) unless named otherwise."""

    parameters: int
    source_bytes: int  # the weights as stored
    bytes_by_dtype: dict[str, int]
    largest_tensor: int
    largest_tensor_name: str
    largest_layer: int  # the sum of one layer's tensors (the largest)
    layers: int
    embedding: int  # the input embedding (vocab x hidden)
    lm_head: int  # an untied output projection; 0 when tied to the embedding
    vocab_size: int
    hidden_size: int
    kv_heads: int
    head_dim: int
    vector_parameters: int  # 1-D tensors (norms, biases): f32 in every GGUF
    kquant_rows_parameters: int  # 2-D+ tensors whose rows are whole k-quant blocks (256)
    q8_rows_parameters: int  # 2-D+ tensors whose rows are whole q8_0 blocks (32) but not 256
    float_dtypes: tuple[str, ...]  # the source's float dtypes (F32/F16/BF16), sorted
    tensor_sizes: tuple[int, ...] = ()  # elements of each tensor, in header order (how shards pack)

    @property
    def fp32_bytes(self) -> int:
        return self.parameters * FP32

    @property
    def matrix_parameters(self) -> int:
        return self.parameters - self.vector_parameters

    @property
    def tied(self) -> bool:
        return self.lm_head == 0

    def summary(self) -> dict[str, Any]:
        return {
            "parameters": self.parameters, "source_bytes": self.source_bytes, "bytes_by_dtype": self.bytes_by_dtype,
            "fp32_bytes": self.fp32_bytes, "largest_tensor": self.largest_tensor_name,
            "largest_tensor_fp32_bytes": self.largest_tensor * FP32, "largest_layer_fp32_bytes": self.largest_layer * FP32,
            "layers": self.layers, "embedding_fp32_bytes": self.embedding * FP32, "lm_head_fp32_bytes": self.lm_head * FP32,
            "tied_embeddings": self.tied, "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        }


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    tc = cfg.get("text_config")
    return tc if isinstance(tc, dict) else cfg


def _config_size(cfg: dict[str, Any], name: str, model: str) -> int | None:
    """A size from config.json under any of its spellings; an absurd one refuses the plan in one line."""
    for key in _CONFIG_KEYS[name]:
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int):
            continue  # absent, null or not a number: the weights tell instead
        if v <= 0 or v > _CONFIG_BOUNDS[name]:
            shown = str(v) if abs(v) < 10**15 else f"{'-' if v < 0 else ''}~2^{v.bit_length() - 1}"
            raise ResourceError(f"{model}: config.json {key}={shown} is not a plausible model size (at most "
                                f"{_CONFIG_BOUNDS[name]:,}); refusing to plan memory for it; nothing was built")
        return v
    return None


def facts_from_tensors(tensors: Iterable[TensorInfo], config: dict[str, Any] | None = None,
                       model: str = "the model") -> ModelFacts:
    """The facts of a model from its tensors' headers (names, dtypes, shapes) and its config.json."""
    cfg = _text_config(config or {})
    parameters = source = vectors = kquant = q8 = 0
    by_dtype: dict[str, int] = {}
    largest, largest_name = 0, ""
    per_layer: dict[str, int] = {}
    embedding = lm_head = 0
    embedding_shape: tuple[int, ...] = ()
    floats = set()
    sizes: list[int] = []
    for t in tensors:
        n = t.numel
        sizes.append(n)
        parameters += n
        source += t.nbytes
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
        if t.dtype in ("F32", "F16", "BF16"):
            floats.add(t.dtype)
        if n > largest:
            largest, largest_name = n, t.name
        if len(t.shape) <= 1:
            vectors += n
        elif t.shape[-1] % KQUANT_BLOCK == 0:
            kquant += n
        elif t.shape[-1] % Q8_0_BLOCK == 0:
            q8 += n
        layer = _LAYER.match(t.name)
        if layer:
            per_layer[layer.group(1)] = per_layer.get(layer.group(1), 0) + n
        elif t.name.endswith(_EMBEDDING_SUFFIXES) and len(t.shape) == 2 and n > embedding:
            embedding, embedding_shape = n, t.shape
        elif t.name.endswith(_LM_HEAD_SUFFIXES) and len(t.shape) == 2:
            lm_head = max(lm_head, n)
    hidden = _config_size(cfg, "hidden_size", model) or (embedding_shape[1] if embedding_shape else 0)
    vocab = _config_size(cfg, "vocab_size", model) or (embedding_shape[0] if embedding_shape else 0)
    if not embedding:
        embedding = vocab * hidden
    heads = _config_size(cfg, "num_attention_heads", model) or 1
    kv_heads = _config_size(cfg, "num_key_value_heads", model) or heads
    head_dim = _config_size(cfg, "head_dim", model) or (hidden // heads if hidden else 0)
    layers = _config_size(cfg, "num_hidden_layers", model) or len(per_layer)
    return ModelFacts(
        parameters=parameters, source_bytes=source, bytes_by_dtype=by_dtype, largest_tensor=largest,
        largest_tensor_name=largest_name, largest_layer=max(per_layer.values(), default=0), layers=layers,
        embedding=embedding, lm_head=lm_head, vocab_size=vocab, hidden_size=hidden, kv_heads=kv_heads,
        head_dim=head_dim, vector_parameters=vectors, kquant_rows_parameters=kquant, q8_rows_parameters=q8,
        float_dtypes=tuple(sorted(floats)), tensor_sizes=tuple(sizes),
    )


def model_facts(snapshot: Snapshot) -> ModelFacts:
    """Facts from the snapshot's safetensors headers (a few KB read per file) and config.json."""
    # Imported here: it needs numpy, and the pull client imports this module for the disk-full helpers.
    from .safetensors_io import read_header

    tensors = [t for path in snapshot.safetensors_files() for t in read_header(path).tensors.values()]
    return facts_from_tensors(tensors, snapshot.config(), snapshot.model_id)


# --- Sizes -------------------------------------------------------------------------------------------------

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


def vllm_bytes(facts: ModelFacts, quantization: str) -> int:
    if quantization == "none":
        return facts.parameters * 2 + SMALL_FILES  # bf16
    # FP8 W8A8: the linear layers' weights one byte each (plus a scale per row); embeddings, lm_head and
    # vectors stay bf16.
    kept_bf16 = facts.embedding + facts.lm_head + facts.vector_parameters
    scales = facts.matrix_parameters // max(facts.hidden_size, 1) * FP32  # one fp32 scale per output row
    return max(facts.parameters - kept_bf16, 0) + kept_bf16 * 2 + scales + SMALL_FILES


# --- Memory of the shared steps ------------------------------------------------------------------------------

def reference_memory(facts: ModelFacts) -> tuple[int, str]:
    """The fp32 reference streamed one unit at a time: the base process, two units resident, the activations of
    REFERENCE_TOKENS tokens and their logits."""
    units = {"embedding": facts.embedding, "largest layer": facts.largest_layer,
             "lm_head": facts.lm_head or facts.embedding}  # tied: the embedding serves as the lm_head again
    unit_name, unit = max(units.items(), key=lambda kv: kv[1])
    activations = REFERENCE_TOKENS * facts.hidden_size * FP32 * ACTIVATION_COPIES
    logits = REFERENCE_TOKENS * facts.vocab_size * FP32 * REFERENCE_LOGIT_COPIES
    total = BASE_TORCH + REFERENCE_UNIT_COPIES * unit * FP32 + activations + logits
    detail = (f"torch {human_bytes(BASE_TORCH)} + {REFERENCE_UNIT_COPIES} x {unit_name} {human_bytes(unit * FP32)} fp32 "
              f"+ activations {human_bytes(activations)} + logits {human_bytes(logits)}")
    return total, detail


def reference_need(snapshot: Snapshot) -> int:
    """Peak memory of the transformers fp32 reference of `snapshot`, streamed one unit at a time."""
    return reference_memory(model_facts(snapshot))[0]


def reference_cache_bytes(facts: ModelFacts) -> int:
    """The cached reference logits (REFERENCE_TOKENS x vocab fp32 at most) beside the reference cache."""
    return REFERENCE_TOKENS * facts.vocab_size * FP32 + MIB


def _whole_model(facts: ModelFacts, factor: float, what: str) -> tuple[int, str]:
    need = BASE_TORCH + int(facts.fp32_bytes * factor)
    return need, f"torch {human_bytes(BASE_TORCH)} + {factor:g} x fp32 model {human_bytes(facts.fp32_bytes)} ({what})"


def _vllm_kv_cache() -> int:
    try:
        return int(float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", VLLM_KV_CACHE_DEFAULT_GIB)) * GIB)
    except ValueError:
        return VLLM_KV_CACHE_DEFAULT_GIB * GIB


# --- The plan ------------------------------------------------------------------------------------------------

@dataclass
class StepNeed:
    step: str
    memory: int  # peak resident anonymous memory, all the step's processes together (bytes)
    mapped: int = 0  # file pages mapped read-only: reclaimable page cache, reported, not counted
    disk: int = 0  # bytes held at once on the file system of `where` during the step
    where: str = ""  # a directory on that file system
    kept: int = 0  # bytes of `disk` that stay after the step (blobs in the store)
    detail: str = ""  # the estimate's terms, for people

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "memory_human": human_bytes(self.memory), "disk_human": human_bytes(self.disk)}


@dataclass
class MemoryPlan:
    model_id: str
    recipe: str
    steps: list[StepNeed]
    budget: int
    budget_source: str  # HIVE_AOT_MEMORY_BUDGET, or what the host has available
    disk_free: dict[str, int]  # where -> free bytes now
    facts: ModelFacts | None = None
    devices: dict[str, int] = field(default_factory=dict)  # where -> file system id (st_dev)

    @property
    def peak(self) -> StepNeed | None:
        return max(self.steps, key=lambda s: s.memory, default=None)

    @property
    def peak_memory(self) -> int:
        return self.peak.memory if self.peak else 0

    def disk_needs(self) -> list[tuple[StepNeed, int]]:
        """Each step's need on its file system, with what earlier steps keep there (blobs) added."""
        kept: dict[Any, int] = {}
        out = []
        for s in self.steps:
            fs = self.devices.get(s.where, s.where)
            out.append((s, s.disk + kept.get(fs, 0)))
            kept[fs] = kept.get(fs, 0) + s.kept
        return out

    def problems(self, steps: Iterable[str] | None = None) -> list[str]:
        only = set(steps) if steps is not None else None
        out = []
        # Memory: the step that needs the most, with the others over the budget named after it.
        over = sorted((s for s in self.steps if (only is None or s.step in only) and s.memory > self.budget),
                      key=lambda s: -s.memory)
        if over:
            others = ", ".join(f"'{s.step}' {human_bytes(s.memory)}" for s in over[1:])
            out.append(f"step '{over[0].step}' needs {human_bytes(over[0].memory)} of memory"
                       + (f" (also over it: {others})" if others else "")
                       + f", budget {human_bytes(self.budget)} ({self.budget_source})")
        for s, need in self.disk_needs():
            free = self.disk_free.get(s.where)
            if (only is None or s.step in only) and s.disk and free is not None and need > free:
                out.append(f"step '{s.step}' needs {human_bytes(need)} of disk in {s.where}, which has "
                           f"{human_bytes(free)} free")
        return out

    def fits(self) -> bool:
        return not self.problems()

    def check(self, steps: Iterable[str] | None = None, outcome: str = "nothing was built") -> None:
        """One ResourceError line naming every step that does not fit (all steps, or only `steps`)."""
        problems = self.problems(steps)
        if problems:
            raise ResourceError(f"{self.recipe} of {self.model_id}: {'; '.join(problems)}; {outcome}", plan=self.to_json())

    def to_json(self) -> dict[str, Any]:
        peak = self.peak
        return {
            "model_id": self.model_id, "recipe": self.recipe, "fits": self.fits(), "problems": self.problems(),
            "budget": self.budget, "budget_human": human_bytes(self.budget), "budget_source": self.budget_source,
            "peak_memory": self.peak_memory, "peak_memory_human": human_bytes(self.peak_memory),
            "peak_step": peak.step if peak else None, "disk_free": self.disk_free,
            "steps": [s.to_json() for s in self.steps], "model": self.facts.summary() if self.facts else None,
        }


def plan_build(p: Plan, store: Store | None = None) -> MemoryPlan:
    """The memory and disk plan of one recipe's build (its input's build is planned on its own)."""
    facts = model_facts(p.snapshot)
    budget, source = memory_budget()
    work = work_root()
    store_root = getattr(store, "root", None)  # a local store; S3 costs only the work root
    refs = cache_root()
    places = [str(work), str(refs)] + ([str(store_root)] if store_root is not None else [])
    devices = {w: _device(Path(w)) for w in places}
    linkable = store_root is not None and devices[str(store_root)] == devices[str(work)]
    steps = _steps(p, facts, str(work), str(store_root) if store_root is not None else None, str(refs), linkable)
    return MemoryPlan(model_id=p.model_id, recipe=p.recipe.id, steps=steps, budget=budget, budget_source=source,
                      disk_free={w: free_bytes(Path(w)) for w in places}, facts=facts, devices=devices)


def _steps(p: Plan, facts: ModelFacts, work: str, store: str | None, refs: str, linkable: bool) -> list[StepNeed]:
    kind, opts = p.recipe.kind, p.recipe.options
    largest = facts.largest_tensor * FP32

    def streamed(copies: int, base: int, base_name: str) -> tuple[int, str]:
        detail = (f"{base_name} {human_bytes(base)} + {copies} x largest tensor {human_bytes(largest)} fp32 "
                  f"({facts.largest_tensor_name})")
        return base + copies * largest, detail

    def publish(size: int, new_blobs: bool = True) -> StepNeed:
        # Hard links on the work root's file system; a copy on another one; nothing local for S3.
        if store is None:
            return StepNeed("publish", BASE_PYTHON, disk=0, where=work, detail="uploaded to S3 from the work root")
        if not new_blobs:
            return StepNeed("publish", BASE_PYTHON, disk=0, where=store, detail="its files are blobs of the input already")
        return StepNeed("publish", BASE_PYTHON, disk=0 if linkable else size, where=store, kept=size,
                        detail=("hard links into the store (same file system)" if linkable
                                else f"a copy of {human_bytes(size)} into the store"))

    def placed(size: int) -> int:
        """Disk for placing a published artifact in a work dir: links from a local store on the same file system."""
        return 0 if linkable else size

    steps: list[StepNeed] = []
    mem, detail = reference_memory(facts)
    reference = StepNeed("reference", mem, disk=reference_cache_bytes(facts), where=refs, detail=detail)
    validation_logits = VALIDATE_CTX * facts.vocab_size * FP32

    if kind == "gguf":
        ftype = opts.get("ftype")
        out = gguf_bytes(facts, ftype or opts.get("outtype", "f16"))
        mem, detail = streamed(CONVERT_TENSOR_COPIES, BASE_PYTHON, "python")
        split = parse_size(str(opts["split_max_size"]), "split_max_size") if opts.get("split_max_size") else 0
        if split:
            # Shards hold whole tensors, packed in order (a tensor larger than the limit gets a shard of its own),
            # each with its own header. A k-quant keeps its lossless intermediate's shards, so they count.
            lossless = lossless_gguf_type(facts) if ftype else None
            shards = gguf_shards(facts, lossless or opts.get("outtype", "f16"), split)
            out += (shards - 1) * GGUF_SHARD_HEADER
            detail += f"; about {shards} shard(s) of at most {human_bytes(split)}"
        if opts.get("imatrix"):
            # The streamed transformers model over the calibration text: the reference's memory, a small file.
            steps.append(StepNeed("imatrix", reference.memory, disk=SMALL_FILES, where=work,
                                  detail=f"the streamed fp32 model over the calibration text ({reference.detail})"))
        if ftype:
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
        steps += [publish(out), reference]
        kv = VALIDATE_CTX * facts.layers * facts.kv_heads * facts.head_dim * 2 * KV_BYTES
        # llama.cpp's CPU backend repacks quantized weights (Q4_0, Q4_K, IQ4_NL, ...) into interleaved rows
        # in anonymous memory: measured at 8B, Q4_K_M's evaluator held 3.9 GiB anon for a 4.6 GiB file.
        # Up to GGUF_REPACK_MAX_BYTES only: a larger GGUF is evaluated from the mapped file.
        quantized = str(ftype or opts.get("outtype", "f16")).lower() not in LOSSLESS_GGUF_TYPES
        repacked = out if quantized and out <= GGUF_REPACK_MAX_BYTES else 0  # larger: evaluated from the mapping
        child = BASE_LLAMA_EVAL + kv + validation_logits * LLAMA_LOGIT_COPIES + repacked
        parent = BASE_TORCH + validation_logits * PARENT_LOGIT_COPIES
        steps.append(StepNeed("validate", child + parent, mapped=out, disk=placed(out) + validation_logits, where=work,
                              detail=(f"llama.cpp {human_bytes(BASE_LLAMA_EVAL)} + KV cache {human_bytes(kv)} + "
                                      f"{LLAMA_LOGIT_COPIES} x logits {human_bytes(validation_logits)}"
                                      + (f" + repacked weights {human_bytes(repacked)}" if repacked else "")
                                      + f"; parent torch {human_bytes(BASE_TORCH)} + {PARENT_LOGIT_COPIES} x logits; "
                                      "the GGUF mapped")))
    elif kind == "vllm":
        quantization = opts.get("quantization", "none")
        out = vllm_bytes(facts, quantization)
        copies = PREPARE_TENSOR_COPIES if quantization == "none" else PREPARE_FP8_TENSOR_COPIES
        mem, detail = streamed(copies, BASE_TORCH, "torch")
        steps += [StepNeed("prepare", mem, disk=out, where=work, detail=detail), publish(out), reference]
        in_process, what = _whole_model(facts, WHOLE_MODEL_FP32_FACTOR if quantization == "none" else FP8_DEQUANTIZED_FACTOR,
                                        "the artifact in transformers")
        in_process += validation_logits * REFERENCE_LOGIT_COPIES
        engine = BASE_TORCH + BASE_VLLM + facts.fp32_bytes + _vllm_kv_cache()
        steps.append(StepNeed("validate", max(in_process, engine), disk=placed(out) + SMALL_FILES, where=work, detail=(
            f"the larger of {what} + logits, and vLLM {human_bytes(BASE_VLLM)} + fp32 model "
            f"{human_bytes(facts.fp32_bytes)} + KV cache {human_bytes(_vllm_kv_cache())} beside the parent's torch")))
    elif kind == "qaic-export":
        out = facts.fp32_bytes + SMALL_FILES
        scratch = facts.fp32_bytes if facts.fp32_bytes > ONNX_EXTERNAL_DATA_THRESHOLD else 0
        mem, detail = _whole_model(facts, ONNX_EXPORT_FACTOR, "the model and its ONNX protobuf")
        steps += [StepNeed("export", mem, disk=out + scratch, where=work,
                           detail=detail + ("; torch's scratch export beside the final one" if scratch else "")),
                  publish(out)]
        mem, detail = _whole_model(facts, ORT_PARITY_FACTOR, "the reference model and the onnxruntime session")
        steps.append(StepNeed("validate", mem + BASE_ORT, disk=placed(out), where=work, detail=detail))
    elif kind == "qaic":
        onnx = facts.fp32_bytes + SMALL_FILES  # the input export, placed in the work dir
        # The bundle is the export's files (already blobs in the store) plus small compile inputs.
        steps += [StepNeed("bundle", BASE_PYTHON, disk=placed(onnx) + SMALL_FILES, where=work,
                           detail="the input export placed (hard links from a local store) and the compile inputs"),
                  publish(SMALL_FILES, new_blobs=False)]
        decoder = opts.get("task", "generate") != "embedding"
        if decoder:
            steps.append(reference)
        mem, detail = _whole_model(facts, WHOLE_MODEL_FP32_FACTOR, "MX quality prediction")
        mem += QUALITY_TENSOR_COPIES * largest + (validation_logits * REFERENCE_LOGIT_COPIES if decoder else 0)
        steps.append(StepNeed("validate", mem, disk=placed(onnx), where=work,
                              detail=f"{detail} + {QUALITY_TENSOR_COPIES} x largest tensor fp32"))
    else:  # a kind this module does not know yet: the whole model in fp32, the safe side
        mem, detail = _whole_model(facts, WHOLE_MODEL_FP32_FACTOR, f"unknown kind {kind}")
        steps += [StepNeed(BUILD_STEP.get(kind, "build"), mem, disk=facts.fp32_bytes, where=work, detail=detail),
                  publish(facts.fp32_bytes), reference]
    return steps


# --- Budget and free space --------------------------------------------------------------------------------

_UNITS = {"": 1, "k": KIB, "m": MIB, "g": GIB, "t": 1 << 40, "p": 1 << 50}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str, what: str = BUDGET_ENV) -> int:
    """`12G`, `12GiB`, `800M`, `1.5g` or plain bytes. K/M/G/T/P are binary (`12G` = `12GiB`); `12GB` is decimal."""
    m = _SIZE.match(text or "")
    if m is None or (m.group(3).lower() == "i"):  # "12Gi" without the B is not a unit we read
        raise ConfigError(f"{what}={text!r} is not a size: use bytes or a number with K, M, G or T (e.g. 12G, 12GiB, 800M)")
    number, unit, suffix = float(m.group(1)), m.group(2).lower(), m.group(3).lower()
    decimal = suffix == "b" and unit != ""  # GB, MB: powers of 1000
    scale = 1000 ** " kmgtp".index(unit) if decimal else _UNITS[unit]
    value = int(number * scale)
    if value <= 0:
        raise ConfigError(f"{what}={text!r} is not a size: it must be more than 0 bytes")
    return value


def host_available_memory() -> int:
    """MemAvailable (what can be allocated without swapping, reclaimable cache included), capped by the memory
    cgroup's own limit where one is set."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * KIB
                break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            available = 0
    cgroup = _cgroup_available()
    return min(available, cgroup) if cgroup is not None else available


def _cgroup_available() -> int | None:
    """limit - usage + inactive file cache of this process's memory cgroup (v2, else v1); None without a limit."""
    for limit_file, usage_file, stat_key in (("memory.max", "memory.current", "inactive_file"),
                                            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                             "total_inactive_file")):
        root = Path("/sys/fs/cgroup")
        try:
            raw = (root / limit_file).read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:  # no limit (v1 writes a huge number)
                return None
            limit, usage = int(raw), int((root / usage_file).read_text().strip())
            stat = (root / limit_file).with_name("memory.stat").read_text()
            inactive = next((int(v) for k, v in (ln.split() for ln in stat.splitlines() if ln.strip()) if k == stat_key), 0)
            return max(limit - usage + inactive, 0)
        except (OSError, ValueError):
            continue
    return None


def memory_budget() -> tuple[int, str]:
    """(bytes, where they come from): `HIVE_AOT_MEMORY_BUDGET`, else what this host has available."""
    raw = os.environ.get(BUDGET_ENV)
    if raw is not None and raw.strip():
        return parse_size(raw), BUDGET_ENV
    return host_available_memory(), "memory available on this host"


def _existing(path: Path) -> Path:
    """The path, or its nearest existing ancestor (a store root not created yet lives on its parent's file system)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _device(path: Path) -> int:
    try:
        return _existing(path).stat().st_dev
    except OSError:
        return -1


def free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(_existing(path)).free
    except OSError:
        return 0


def filesystem_of(path: Path) -> tuple[str, str]:
    """(mount point, file system type) of the file system holding `path`."""
    p = _existing(path)
    while not os.path.ismount(p) and p.parent != p:
        p = p.parent
    fstype = "unknown"
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[1].replace("\\040", " ") == str(p):
                fstype = parts[2]  # the last mount on a point is the visible one
    except OSError:
        pass
    return str(p), fstype


# --- Disk full ---------------------------------------------------------------------------------------------

DISK_FULL_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                    # A process's RLIMIT_FSIZE: the write fails with EFBIG (SIGXFSZ ignored). For the build it is
                    # the same as a full disk: no room for the file.
                    errno.EFBIG: "file size limit exceeded (EFBIG: this process's RLIMIT_FSIZE, or the file system's)"}


# Free space below this after a failed write means the write failed for lack of it (for writers that do not
# say why: numpy's tofile raises "N requested and M written" without an errno, llama.cpp "iostream error").
DISK_FULL_SLACK = 16 * MIB


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS


def out_of_space(where: Path) -> int | None:
    """Why a write under `where` that failed without an errno stopped: EFBIG when a file there reached this
    process's RLIMIT_FSIZE, ENOSPC when the file system is (nearly) full, else EFBIG while a file size limit
    is in force (the writer may have removed its partial file already); None when nothing explains it."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    limited = soft != resource.RLIM_INFINITY
    try:
        if limited and Path(where).is_dir():
            for dirpath, _dirs, files in os.walk(where):
                if any(os.path.getsize(os.path.join(dirpath, f)) >= soft for f in files):
                    return errno.EFBIG
    except OSError:
        pass
    if free_bytes(Path(where)) < DISK_FULL_SLACK:
        return errno.ENOSPC
    return errno.EFBIG if limited else None


def disk_full_cause(e: BaseException, where: Path | None) -> int | None:
    """The errno that makes `e` a full disk (ENOSPC, EDQUOT, EFBIG), also for a short write without one."""
    if is_disk_full(e):
        return e.errno  # type: ignore[union-attr]
    if isinstance(e, OSError) and e.errno is None and where is not None:
        return out_of_space(where)
    return None


def disk_full_error(errno_code: int | None, path: Path | str, *, subject: str, step: str | None = None,
                    outcome: str = "partial files removed, nothing was published") -> DiskFull:
    """One line: what filled up, during which step, on which file system, and how much is free there now."""
    mount, fstype = filesystem_of(Path(path))
    reason = DISK_FULL_ERRNOS.get(errno_code or errno.ENOSPC, os.strerror(errno_code or errno.ENOSPC))
    during = f" during step '{step}'" if step else ""
    return DiskFull(f"{subject}: disk full{during} ({reason}) writing under {path} ({fstype} file system at {mount}, "
                    f"{human_bytes(free_bytes(Path(path)))} free); {outcome}", path=str(path), errno_code=errno_code)


# --- Formatting ----------------------------------------------------------------------------------------------

def human_bytes(n: int) -> str:
    """1.5 GiB, 800.0 MiB; exact integer arithmetic for sizes no float can hold (an absurd header's)."""
    n = int(n)
    if n < 0:
        return f"-{human_bytes(-n)}"
    if n < KIB:
        return f"{n} B"
    units = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    for i, unit in enumerate(units, start=1):
        if n < 1 << (10 * (i + 1)) or unit == units[-1]:
            whole = n >> (10 * i)
            if whole >= 1 << 40:  # beyond exbibytes by far: say how far, without a float
                return f"about 2^{n.bit_length() - 1} B"
            tenths = ((n * 10) >> (10 * i)) % 10
            return f"{whole}.{tenths} {unit}"
    raise AssertionError("unreachable")


def plan_text(plan: MemoryPlan) -> str:
    """The plan as a few lines for people (`hive-aot plan`)."""
    f = plan.facts
    verdict = "fits" if plan.fits() else "does NOT fit"
    lines = [f"{plan.recipe} of {plan.model_id}: {verdict} (budget {human_bytes(plan.budget)}, {plan.budget_source})"]
    if f is not None:
        lines.append(f"  model: {f.parameters:,} parameters, {human_bytes(f.source_bytes)} on disk, fp32 "
                     f"{human_bytes(f.fp32_bytes)}; largest tensor {f.largest_tensor_name} {human_bytes(f.largest_tensor * FP32)} "
                     f"fp32, largest layer {human_bytes(f.largest_layer * FP32)} fp32, vocab {f.vocab_size:,}")
    lines.append(f"  {'step':10} {'memory':>11} {'mapped':>11} {'disk':>11}  where")
    for s, need in plan.disk_needs():
        lines.append(f"  {s.step:10} {human_bytes(s.memory):>11} {human_bytes(s.mapped) if s.mapped else '-':>11} "
                     f"{human_bytes(need) if need else '-':>11}  {s.where if need else ''}")
        if s.detail:
            lines.append(f"  {'':10} {s.detail}")
    lines += [f"  refused: {p}" for p in plan.problems()]
    return "\n".join(lines)
