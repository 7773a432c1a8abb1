"""FP8 W8A8 "dynamic" in the compressed-tensors format vLLM loads (`quant_method: compressed-tensors`).

Weights: float8 e4m3fn with one float32 scale per output channel (scale = max|w_row| / 448, so the
largest weight of each row maps to e4m3's largest finite value). Activations: quantized per token at
run time by vLLM, so nothing is calibrated and no data is needed. Made on the CPU, tensor by tensor.

Which weights: the nn.Linear layers of the transformers model class (found on the meta device, so
nothing is allocated), except lm_head, MoE routers and vision towers, which stay bf16 and are listed
in `ignore`. The e4m3fn bytes are stored as they are on every platform: ROCm converts them to e4m3fnuz
at load time, and storing fnuz would break CUDA and XPU.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

E4M3_MAX = 448.0
# Linear layers that stay in bf16: the output head, MoE routers (their logits pick experts: small and
# sensitive), vision towers and projectors.
KEEP_HIGH_PRECISION = re.compile(
    r"(^|\.)(lm_head|gate|router|shared_expert_gate)$|(^|\.)(vision_tower|visual|vision_model|multi_modal_projector)(\.|$)")
COMPRESSED_TENSORS_VERSION = "0.17.0"  # the format version vLLM 0.33 pins; recorded in the config


def linear_layers(model) -> tuple[list[str], list[str]]:
    """(quantized, kept) module names of a (meta-device) transformers model's nn.Linear layers."""
    import torch

    quantized, kept = [], []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            (kept if KEEP_HIGH_PRECISION.search(name) else quantized).append(name)
    return quantized, kept


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, float, float]:
    """float32 rows [out, in] -> (e4m3fn bytes as uint8 [out, in], float32 scales [out, 1], the squared L2 norm
    of the quantization error, the squared L2 norm of the rows). Rows are independent: a tensor is quantized
    a chunk of rows at a time and its relative error is sqrt(sum of errors / sum of norms)."""
    import torch

    t = torch.from_numpy(np.array(w, dtype=np.float32))  # a copy: w may be a read-only view of an mmap
    amax = t.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (t / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    deq = q.to(torch.float32) * scale
    err = float(torch.sum((t - deq) ** 2))
    norm = float(torch.sum(t ** 2))
    return q.view(torch.uint8).numpy(), scale.numpy().astype(np.float32), err, norm


def dequantize(q_bytes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    import torch

    q = torch.from_numpy(np.ascontiguousarray(q_bytes)).view(torch.float8_e4m3fn)
    return (q.to(torch.float32) * torch.from_numpy(np.asarray(scale, dtype=np.float32))).numpy()


def quantization_config(ignore: list[str]) -> dict[str, Any]:
    """config.json's quantization_config for FP8 W8A8 dynamic (per-channel weights, per-token activations)."""
    def args(strategy: str, dynamic: bool, observer: str | None) -> dict[str, Any]:
        return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": dynamic,
                "group_size": None, "block_structure": None, "actorder": None, "observer": observer,
                "observer_kwargs": {}}

    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "version": COMPRESSED_TENSORS_VERSION,
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
                                      "weights": args("channel", False, "minmax"),
                                      "input_activations": args("token", True, None),
                                      "output_activations": None}},
        "ignore": sorted(set(ignore)),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
    }
