"""The memory and disk plan of a build: each step's peak need, estimated before any work, against what the
host has.

A build that cannot fit must say so in one line before it spends an hour, not die from the kernel's OOM
killer (which leaves no message of its own) or fill the disk halfway. So every recipe's steps estimate, from
the safetensors headers and config.json only (no weight is read):

- `memory`: peak resident anonymous memory of the step, all its processes together (a native engine's child
  and the parent waiting for it): what the kernel cannot drop. Checked against the budget (host.py:
  `HIVE_AOT_MEMORY_BUDGET`, else the memory this host has available).
- `mapped`: file pages the step maps read-only (llama.cpp reads GGUFs through mmap). The page cache can drop
  them and read them again, so they are reported and never counted against the budget.
- `disk`: bytes the step holds at once on the file system of `where` (the work root, the reference cache or a
  local store); `kept`: what of it stays after the step (the blobs in the store). A local store on the work
  root's file system receives the build's files as hard links, so publishing costs no second copy; an S3
  store costs only the work root.

Each target owns the estimate of its own steps (`Target.plan_steps`, in `targets/<kind>/plan.py`): this module
holds what they share: the model's facts (parameters, the largest tensor, the largest decoder layer, the
embedding and lm_head, the vocabulary), the reference and publish steps, and the plan itself. Every constant
is named with what it stands for, so measured peaks (`meter.py`, recorded beside the plan in every build) can
recalibrate them. They err on the large side.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import ResourceError
from ..core.host import device_of, free_bytes, memory_budget
from ..core.paths import cache_root, work_root
from ..core.units import GIB, KIB, MIB, human_bytes
from .expert_stream import ExpertTally
from .slicing import LAYER_TENSOR

if TYPE_CHECKING:
    from ..source.fetch import Snapshot
    from ..source.safetensors_io import TensorInfo

__all__ = ["GIB", "KIB", "MIB", "human_bytes"]  # re-exported for the targets' estimates

FP32 = 4  # bytes per float32 value

# --- Calibration constants (bytes or multipliers). Measured peaks should land just below the estimates. ---
# Resident size of a process before it holds any tensor:
BASE_PYTHON = 128 * MIB  # interpreter + numpy + gguf: the streaming GGUF converter's process (measured 0.18 GiB in all)
BASE_TORCH = 450 * MIB  # + torch and transformers: the reference, the validations, the ONNX export (measured 0.37-0.45 GiB)
BASE_STEP = 512 * MIB  # the CLI's process between heavy steps (publish, bundle): torch imported, heap trimmed

# The reference streams the model one unit at a time (the input embedding, each decoder layer, the final norm, the
# lm_head): a unit is read when the previous one is gone; a quarter more for the allocator and its file pages.
REFERENCE_UNIT_COPIES = 1.25
ACTIVATION_COPIES = 16  # hidden states, residuals, attention and MLP intermediates per token, fp32
REFERENCE_LOGIT_COPIES = 2  # the batch's logits and each sequence's copy written out, [tokens x vocab] fp32
# The parity texts evaluated in one batch (right-padded: sequences x the longest one), what a streamed
# artifact's pass over the weights computes at once.
BATCH_TOKENS = 1024
SMALL_FILES = 64 * MIB  # tokenizer, config, reports, a validation's result files
# Row lengths the facts count tensors by (block-quantized formats need whole blocks per row: GGUF's k-quants
# 256-element superblocks, its legacy types and MX formats 32-element blocks).
KQUANT_BLOCK = 256
Q8_0_BLOCK = 32

# Config sizes beyond these are not a model (compat.sanity.PLAUSIBLE refuses the same before any build; the plan
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
_LAYER = LAYER_TENSOR
_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "tok_embeddings.weight",
                       "embed_in.weight", "embedding.weight")
_LM_HEAD_SUFFIXES = ("lm_head.weight", "embed_out.weight", "output.weight")
# a vision-language checkpoint's vision side, in the layouts of transformers 4 and 5 (and InternVL's remote one,
# whose projector is the top-level `mlp1`)
_VISION = re.compile(r"(?:^|\.)(?:vision_tower|vision_model|visual|multi_modal_projector|image_newline)(?:\.|$)|^mlp1\.")


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
    largest_layer_tensor: int = 0  # the largest tensor inside a decoder layer (what layer-wise conversions hold)
    widest_row: int = 0  # the longest last dimension of a matrix (a row of the widest weight)
    vision_parameters: int = 0  # a vision-language model's vision side (tower, projector): held whole when streamed
    largest_streamed_layer: int = 0  # the largest layer with large expert stacks read an expert at a time (0: whole)
    largest_stacked_expert: int = 0  # one expert's share of a fused expert tensor [E, ...], the largest (0: none)

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
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


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
    parameters = source = vectors = kquant = q8 = vision = 0
    by_dtype: dict[str, int] = {}
    largest, largest_name = 0, ""
    largest_in_layer = widest = 0
    per_layer: dict[str, int] = {}
    experts = ExpertTally()
    embedding = lm_head = 0
    embedding_shape: tuple[int, ...] = ()
    floats = set()
    sizes: list[int] = []
    for t in tensors:
        n = t.numel * 2 if t.dtype == "U8" and t.name.endswith("_blocks") else t.numel  # MXFP4: two a byte
        sizes.append(n)
        parameters += n
        source += t.nbytes
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
        if t.dtype in ("F32", "F16", "BF16"):
            floats.add(t.dtype)
        if n > largest:
            largest, largest_name = n, t.name
        if len(t.shape) >= 2:
            widest = max(widest, t.shape[-1])
        if len(t.shape) <= 1:
            vectors += n
        elif t.shape[-1] % KQUANT_BLOCK == 0:
            kquant += n
        elif t.shape[-1] % Q8_0_BLOCK == 0:
            q8 += n
        if _VISION.search(t.name):
            vision += n
        layer = _LAYER.match(t.name)
        if layer:
            per_layer[layer.group(1)] = per_layer.get(layer.group(1), 0) + n
            largest_in_layer = max(largest_in_layer, n)
            experts.add(layer.group(1), t.name, tuple(t.shape), n)
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
        float_dtypes=tuple(sorted(floats)), tensor_sizes=tuple(sizes), largest_layer_tensor=largest_in_layer,
        widest_row=widest, vision_parameters=vision, largest_streamed_layer=experts.streamed_layer(per_layer),
        largest_stacked_expert=experts.largest_stacked(),
    )


def model_facts(snapshot: Snapshot) -> ModelFacts:
    """Facts from the snapshot's safetensors headers (a few KB read per file) and config.json."""
    # Imported here: it needs numpy, and the pull client imports this module for the disk-full helpers.
    from ..source.safetensors_io import read_header
    from .native import native_dict

    tensors = [t for path in snapshot.safetensors_files() for t in read_header(path).tensors.values()]
    # a remote-code layout with a native equivalent (InternVL's llm_config) is read as transformers' own
    return facts_from_tensors(tensors, native_dict(snapshot.config()), snapshot.model_id)


# --- Memory of the shared steps ------------------------------------------------------------------------------

def largest_unit(facts: ModelFacts) -> tuple[str, int]:
    """(name, parameters) of the largest unit a streamed model holds at once: embedding, decoder layer, lm_head."""
    layer = facts.largest_streamed_layer or facts.largest_layer
    units = {"the embedding": facts.embedding,
             f"a decoder layer{' (an expert at a time)' * (layer < facts.largest_layer)}": layer,
             "the lm_head": facts.lm_head or facts.embedding}  # tied: the embedding serves as the lm_head again
    return max(units.items(), key=lambda kv: kv[1])


def unit_text(facts: ModelFacts) -> str:
    name, n = largest_unit(facts)
    return f"{name}, {human_bytes(n * FP32)} in fp32"


def reference_memory(facts: ModelFacts, parent: int = BASE_TORCH) -> tuple[int, str]:
    """The fp32 reference streamed one unit at a time: the base process, two units resident, the activations of
    the parity texts (BATCH_TOKENS, padded) and their logits; `parent`: the building process meanwhile (torch
    imported, unless its kind's build never needs it there)."""
    unit_name, unit = largest_unit(facts)
    activations = BATCH_TOKENS * facts.hidden_size * FP32 * ACTIVATION_COPIES  # the parity texts in one batch
    logits = BATCH_TOKENS * facts.vocab_size * FP32 * REFERENCE_LOGIT_COPIES
    total = BASE_TORCH + int(REFERENCE_UNIT_COPIES * unit * FP32) + activations + logits + parent
    detail = (f"a child: torch {human_bytes(BASE_TORCH)} + {REFERENCE_UNIT_COPIES:g} x {unit_name} {human_bytes(unit * FP32)} "
              f"fp32 + activations {human_bytes(activations)} + logits {human_bytes(logits)}; the parent waiting "
              f"{human_bytes(parent)}")
    return total, detail


def reference_in_process(fp32_bytes: int, budget: int) -> bool:
    """The reference keeps every block after its first use, in the building process (torch imported there),
    only when the fp32 model fits the budget with a wide margin; otherwise it streams in a child."""
    return fp32_bytes * 3 // 2 + GIB < budget


def reference_need(snapshot: Snapshot) -> int:
    """Peak memory of the transformers fp32 reference of `snapshot`, streamed one unit at a time."""
    return reference_memory(model_facts(snapshot))[0]


def whole_model(facts: ModelFacts, factor: float, what: str) -> tuple[int, str]:
    """A step that holds the whole model in fp32 (times `factor` for its own copies)."""
    need = BASE_TORCH + int(facts.fp32_bytes * factor)
    return need, f"torch {human_bytes(BASE_TORCH)} + {factor:g} x fp32 model {human_bytes(facts.fp32_bytes)} ({what})"


def reference_cache_bytes(facts: ModelFacts) -> int:
    """The cached reference logits (BATCH_TOKENS x vocab fp32 at most) beside the reference cache."""
    return BATCH_TOKENS * facts.vocab_size * FP32 + MIB


@dataclass
class StepNeed:
    step: str
    memory: int  # peak resident anonymous memory, all the step's processes together (bytes)
    mapped: int = 0  # file pages mapped read-only: reclaimable page cache, reported, not counted
    disk: int = 0  # bytes held at once on the file system of `where` during the step
    where: str = ""  # a directory on that file system
    kept: int = 0  # bytes of `disk` that stay after the step (blobs in the store)
    detail: str = ""  # the estimate's terms, for people
    unit: str = ""  # what the step holds at once that no budget below its need can hold (named in a refusal)

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
                       + (f" (its largest unit: {over[0].unit})" if over[0].unit else "")
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


@dataclass
class PlanEnv:
    """What a target's estimate may use: the model's facts, the recipe's options, where things go, the budget
    (a step may choose a smaller way to run, such as an engine check on a layer slice, when the whole does not
    fit), and the steps every kind shares."""

    facts: ModelFacts
    options: dict[str, Any]
    config: dict[str, Any]
    work: str
    store: str | None  # a local store's root; None for S3
    refs: str  # the reference cache
    linkable: bool  # the local store is on the work root's file system (hard links)
    budget: int
    input_options: dict[str, Any] | None = None  # a derived recipe's input recipe's options

    @property
    def largest(self) -> int:
        """The largest tensor in fp32 bytes."""
        return self.facts.largest_tensor * FP32

    def streamed(self, copies: int, base: int, base_name: str, tensor: int | None = None) -> tuple[int, str]:
        """A step that holds one tensor at a time in `copies` fp32 working copies (the largest, unless given)."""
        size = self.largest if tensor is None else tensor * FP32
        name = self.facts.largest_tensor_name if tensor is None else "the largest it converts"
        return base + copies * size, (f"{base_name} {human_bytes(base)} + {copies} x tensor {human_bytes(size)} fp32 "
                                      f"({name})")

    def reference(self, parent: int = BASE_TORCH) -> StepNeed:
        mem, detail = reference_memory(self.facts, parent)
        return StepNeed("reference", mem, disk=reference_cache_bytes(self.facts), where=self.refs, detail=detail,
                        unit=unit_text(self.facts))

    def publish(self, size: int, new_blobs: bool = True, base: int = BASE_STEP) -> StepNeed:
        """`base`: the building process by then (torch imported, unless its kind's build never needs it there)."""
        # Hard links on the work root's file system; a copy on another one; nothing local for S3.
        if self.store is None:
            return StepNeed("publish", base, disk=0, where=self.work, detail="uploaded to S3 from the work root")
        if not new_blobs:
            return StepNeed("publish", base, disk=0, where=self.store, detail="its files are blobs of the input already")
        return StepNeed("publish", base, disk=0 if self.linkable else size, where=self.store, kept=size,
                        detail=("hard links into the store (same file system)" if self.linkable
                                else f"a copy of {human_bytes(size)} into the store"))

    def placed(self, size: int) -> int:
        """Disk for placing a published artifact in a work dir: links from a local store on the same file system."""
        return 0 if self.linkable else size


def plan_build(p: Any, store: Any = None) -> MemoryPlan:
    """The memory and disk plan of one recipe's build (its input's build is planned on its own). `p`: a
    build.Plan (its snapshot, recipe, target and parent plan); `store`: a store (a local one has a `root`)."""
    facts = model_facts(p.snapshot)
    budget, source = memory_budget()
    work = work_root()
    store_root = getattr(store, "root", None)  # a local store; S3 costs only the work root
    refs = cache_root()
    places = [str(work), str(refs)] + ([str(store_root)] if store_root is not None else [])
    devices = {w: device_of(Path(w)) for w in places}
    linkable = store_root is not None and devices[str(store_root)] == devices[str(work)]
    env = PlanEnv(facts=facts, options=p.recipe.options, config=p.snapshot.config(), work=str(work),
                  store=str(store_root) if store_root is not None else None, refs=str(refs), linkable=linkable,
                  budget=budget, input_options=p.parent.recipe.options if p.parent is not None else None)
    steps = p.target.plan_steps(env)
    return MemoryPlan(model_id=p.model_id, recipe=p.recipe.id, steps=steps, budget=budget, budget_source=source,
                      disk_free={w: free_bytes(Path(w)) for w in places}, facts=facts, devices=devices)


def plan_text(plan: MemoryPlan) -> str:
    """The plan as a few lines for people (`hive-aot plan`)."""
    f = plan.facts
    verdict = "fits" if plan.fits() else "does NOT fit"
    lines = [f"{plan.recipe} of {plan.model_id}: {verdict} (budget {human_bytes(plan.budget)}, {plan.budget_source})"]
    if f is not None:
        lines.append(f"  model: {f.parameters:,} parameters, {human_bytes(f.source_bytes)} on disk, fp32 "
                     f"{human_bytes(f.fp32_bytes)}; largest tensor {f.largest_tensor_name} "
                     f"{human_bytes(f.largest_tensor * FP32)} fp32, largest layer {human_bytes(f.largest_layer * FP32)} fp32, "
                     f"vocab {f.vocab_size:,}")
    lines.append(f"  {'step':10} {'memory':>11} {'mapped':>11} {'disk':>11}  where")
    for s, need in plan.disk_needs():
        lines.append(f"  {s.step:10} {human_bytes(s.memory):>11} {human_bytes(s.mapped) if s.mapped else '-':>11} "
                     f"{human_bytes(need) if need else '-':>11}  {s.where if need else ''}")
        if s.detail:
            lines.append(f"  {'':10} {s.detail}")
    lines += [f"  refused: {p}" for p in plan.problems()]
    return "\n".join(lines)
