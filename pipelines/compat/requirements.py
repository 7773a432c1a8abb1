"""What serving a model takes: its weights summarized from safetensors headers (local files or HTTP ranges
alike), and the accelerator memory it needs on a given hardware at the recommended context and batch, with the
configuration that fits (tensor parallelism on GPUs, devices on AI 100).

VRAM = weights + KV cache at the recommended context and batch + overhead (docs/compatibility.md: the formula).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..core.units import human_bytes
from ..source.safetensors_io import Header, TensorSource
from .hardware import Hardware
from .results import Check
from .sanity import text_cfg

GIB = 1024**3
LM_TASKS = {"causal-lm", "vision-language", "seq2seq", "speculative-draft"}


@dataclass
class WeightsSummary:
    """What the check needs from safetensors headers (local files or HTTP ranges alike)."""

    parameters: int
    bytes_by_dtype: dict[str, int]
    shapes: dict[str, tuple[int, ...]]
    files: int
    tensors: int = field(default=0)

    @classmethod
    def from_headers(cls, headers: Iterable[Header]) -> WeightsSummary:
        params, by_dtype, shapes, n = 0, {}, {}, 0
        for h in headers:
            n += 1
            params += h.parameters
            for k, v in h.bytes_by_dtype().items():
                by_dtype[k] = by_dtype.get(k, 0) + v
            shapes.update({t.name: t.shape for t in h.tensors.values()})
        return cls(params, by_dtype, shapes, n, len(shapes))

    @classmethod
    def from_source(cls, src: TensorSource) -> WeightsSummary:
        return cls.from_headers(f.header for f in src.files)



def serving_requirements(cfg: dict[str, Any], weights: WeightsSummary, task: str,
                         hw: Hardware) -> tuple[dict[str, Any], Check | None]:
    """VRAM = weights + KV cache at the recommended context and batch + overhead (docs/compatibility.md)."""
    tc = text_cfg(cfg)
    quantized = isinstance(cfg.get("quantization_config"), dict)
    dtype = "float16" if set(weights.bytes_by_dtype) <= {"F16"} else "bfloat16"
    serving_weights = sum(weights.bytes_by_dtype.values()) if quantized else weights.parameters * 2
    reqs: dict[str, Any] = {"parameters": weights.parameters, "weights_bytes": sum(weights.bytes_by_dtype.values()),
                            "weights_bytes_by_dtype": weights.bytes_by_dtype, "serving_weights_bytes": serving_weights}
    layers, heads = tc.get("num_hidden_layers"), tc.get("num_attention_heads")
    kv_per_token = 0
    if task in LM_TASKS and isinstance(layers, int) and isinstance(heads, int) and isinstance(tc.get("hidden_size"), int):
        head_dim = tc.get("head_dim") or tc["hidden_size"] // heads
        kv_heads = tc.get("num_key_value_heads") or heads
        kv_per_token = 2 * layers * kv_heads * head_dim * 2  # K and V, 16-bit cache
    ctx = min(int(tc.get("max_position_embeddings") or 4096), 8192)
    seqs = 16
    overhead = GIB + serving_weights // 10  # activations, CUDA graphs, allocator slack

    def total(c: int, s: int) -> int:
        return serving_weights + kv_per_token * c * s + overhead

    reqs.update(kv_cache_bytes_per_token=kv_per_token, overhead_bytes=overhead)
    if hw.vendor == "qaic":
        mxfp6 = math.ceil(weights.parameters * 6.25 / 8)  # 6-bit E2M3 + one E8M0 scale per 32 weights
        ctx = min(ctx, 2048)
        # MXINT8 KV: ~1 byte per value; the slack scales with what the device holds (MXFP6), not bf16 weights
        reqs["vram_bytes"] = need = mxfp6 + kv_per_token * ctx * 8 // 2 + GIB + mxfp6 // 10
        per_device = hw.memory_gb * GIB * 0.9 if hw.memory_gb else 0
        devices = max(1, math.ceil(need / per_device)) if per_device else 1
        reqs["recommended_config"] = {"num_cores": 16, "ctx_len": ctx, "prefill_seq_len": 128, "batch_size": 1,
                                      "full_batch_size": 8, "mxfp6": True, "mxint8": True, "num_devices": devices}
        return reqs, Check(name="fits_hardware", status="pass",
                           detail=f"~{human_bytes(need)} with MXFP6 weights / MXINT8 KV on {devices} device(s) of "
                                  f"{hw.memory_gb:g} GB ({human_bytes(int(devices * per_device))} usable)")
    if hw.vendor == "cpu":
        reqs["recommended_config"] = {"dtype": dtype, "max_model_len": ctx, "max_num_seqs": 1}
        reqs["vram_bytes"] = total(ctx, 1)
        return reqs, None
    mem = (hw.memory_gb or 0) * GIB * 0.9  # vLLM's default gpu_memory_utilization
    for tp in (1, 2, 4, 8):
        fit = next(((c, s) for c, s in ((ctx, seqs), (ctx, 4), (ctx, 1), (min(ctx, 2048), 1)) if total(c, s) <= mem * tp), None)
        if fit:
            break
    if fit is None:
        reqs["vram_bytes"] = total(ctx, 1)
        reqs["recommended_config"] = None
        return reqs, Check(name="fits_hardware", status="fail",
                           detail=f"needs ~{total(ctx, 1) / GIB:.0f} GiB even at batch 1: more than 8 x {hw.memory_gb:g} GB"
                                  + ("" if quantized else _fp8_alternative(weights.parameters, kv_per_token * ctx, mem)))
    c, s = fit
    reqs["vram_bytes"] = total(c, s)  # what the recommended configuration needs, as the summary says
    reqs["recommended_config"] = {"dtype": dtype, "max_model_len": c, "max_num_seqs": s, "tensor_parallel_size": tp,
                                  "gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto",
                                  "quantization": ((cfg.get("quantization_config") or {}).get("quant_method")
                                                   if quantized else None)}
    return reqs, Check(name="fits_hardware", status="pass",
                       detail=f"~{human_bytes(total(c, s))} at max_model_len {c}, {s} seqs: "
                              f"tensor_parallel_size {tp} x {hw.memory_gb:g} GB")


def _fp8_alternative(parameters: int, kv_bytes: int, per_device: float) -> str:
    """What the vllm-fp8 recipe (8-bit weights, half of bf16) would need, where bf16 does not fit."""
    need = parameters + kv_bytes + GIB + parameters // 10
    tp = next((tp for tp in (1, 2, 4, 8) if need <= per_device * tp), None)
    if tp is None:
        return f"; with vllm-fp8 (8-bit weights) still ~{need / GIB:.0f} GiB"
    return f"; vllm-fp8 (8-bit weights, half of bf16) needs ~{need / GIB:.0f} GiB: tensor_parallel_size {tp}"
