"""FP8 W8A8 "dynamic" in the compressed-tensors format vLLM loads (`quant_method: compressed-tensors`).

Weights: float8 e4m3fn with one float32 scale per output channel (scale = max|w_row| / 448, so the
largest weight of each row maps to e4m3's largest finite value). Activations: quantized per token at
run time by vLLM, so nothing is calibrated and no data is needed. Made on the CPU, tensor by tensor.

Which weights: the nn.Linear layers of the transformers model class (found on the meta device, so
nothing is allocated) and MoE experts stored one tensor per expert, under their stored names, except
lm_head, MoE routers and vision towers, which stay bf16 and are listed in `ignore` (`fp8_selection`). The
e4m3fn bytes are stored as they are on every platform: ROCm converts them to e4m3fnuz at load time, and
storing fnuz would break CUDA and XPU.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np

from .moe_activations import is_experts

if TYPE_CHECKING:
    from ...source.safetensors_io import TensorSource
    from .checkpoint_names import CheckpointMap

E4M3_MAX = 448.0
# Linear layers that stay in bf16: the output head, MoE routers (their logits pick experts: small and
# sensitive), vision towers and projectors (Idefics3's is its `connector`).
KEEP_HIGH_PRECISION = re.compile(
    r"(^|\.)(lm_head|gate|router|shared_expert_gate)$|(^|\.)(vision_tower|visual|vision_model|multi_modal_projector|connector)(\.|$)")


def fp8_selection(cmap: CheckpointMap, src: TensorSource) -> tuple[set[str], list[str]]:
    """(stored weights to quantize, module names vLLM keeps in bf16: the config's `ignore`). Quantized: the
    stored 2-D weight of each nn.Linear of the transformers class (found on the meta device), and MoE experts
    stored one tensor per expert (compressed-tensors' FP8 MoE scheme quantizes each expert's projections
    per output channel, under their released names). Kept: lm_head, routers, vision towers and projectors,
    and experts stored fused (one 3-D tensor: no per-expert scales to give it), under their stored names,
    which is how vLLM names its modules."""
    import torch

    quantized: set[str] = set()
    kept = {"lm_head"}
    modules = dict(cmap.model.named_modules())
    for param, rule in cmap.rules.items():
        module_name, _, leaf = param.rpartition(".")
        module = modules.get(module_name)
        stored_2d = all(len(src.info(s).shape) == 2 for s in rule.sources)
        if is_experts(module) and leaf in EXPERT_PROJECTIONS:
            if stored_2d and len(rule.sources) > 1 and not KEEP_HIGH_PRECISION.search(module_name):
                quantized.update(rule.sources)
            else:
                kept.add(_module_of(rule.sources[0]).rpartition(".experts")[0] + ".experts")
        elif leaf == "weight" and KEEP_HIGH_PRECISION.search(module_name) and stored_2d:
            kept.add(_stored_module(module_name, rule.sources[0]))  # a router need not be an nn.Linear (Qwen3-MoE's)
        elif isinstance(module, torch.nn.Linear) and leaf == "weight":
            if stored_2d and len(rule.sources) == 1:
                quantized.add(rule.sources[0])
            else:
                kept.add(_stored_module(module_name, rule.sources[0]))
    return quantized, sorted(kept)


# The stacked projections of a transformers 5 experts module (their per-expert checkpoint tensors are quantized).
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")


def _module_of(stored: str) -> str:
    return stored[: -len(".weight")] if stored.endswith(".weight") else stored


def _stored_module(module_name: str, stored: str) -> str:
    """The module's name as the checkpoint stores it; its own name where the weight is another module's (a
    head tied to the input embedding is still `lm_head` to vLLM)."""
    own = _module_of(stored)
    return own if own.rpartition(".")[2] == module_name.rpartition(".")[2] else module_name


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
    from .pack import compressed_tensors_config, quantization_args

    return compressed_tensors_config("float-quantized", quantization_args(8, "float", "channel"),
                                     quantization_args(8, "float", "token", dynamic=True, observer=None), ignore)
