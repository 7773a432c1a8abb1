"""A prepared vLLM directory run in transformers, fp32, unit by unit (or resident when it fits).

What vLLM computes from the artifact, in transformers' own modules: bf16 weights widened to fp32; FP8
W8A8 weights dequantized from the stored e4m3 bytes and their per-channel scales, with the activations
in front of every quantized layer quantized per token to e4m3 (vLLM's dynamic W8A8; `quantize_activations
= False` computes W8A16, what platforms without FP8 kernels run); the integer tiers' weights dequantized from
their stored integers and scales (int_artifact.py: INT8 with per-token INT8 activations, W4A16's packed
nibbles with activations as they are). Each artifact weight is compared with
the source's tensor of the same name as it streams (relative L2 error, in row chunks), so rounding and
quantization are measured weight by weight without a second copy of the model.

`evaluate_into` is the child-process side (pipelines.process.isolation): teacher-forced logits of every parity
sequence in one pass over the weights, optionally W8A16 too, greedy continuations, the weight errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ...core.progress import unit_runs
from ...model import flops
from ...model.streamed_model import StreamedCausalLM
from ...source.safetensors_io import TensorSource
from .fp8 import EXPERT_PROJECTIONS
from .int_artifact import INT8, PackedSource, dequantize, fake_quant_int8, stored_int
from .moe_activations import is_experts, quantize_expert_inputs

FP8 = "F8_E4M3"
ERROR_ROWS = 4096  # rows compared with the source at a time (bounded memory whatever the tensor's size)


def _scale_name(weight: str) -> str:
    return weight[: -len(".weight")] + ".weight_scale" if weight.endswith(".weight") else weight + "_scale"


def dequantized(src: TensorSource, name: str):
    """An FP8 weight of a compressed-tensors checkpoint as float32: e4m3 bytes times the per-row scale."""
    import torch

    info = src.info(name)
    scale = torch.from_numpy(np.array(src.float32(_scale_name(name)), dtype=np.float32)).reshape(info.shape[0], -1)
    raw = src.where[name].raw(name)
    out = torch.empty(info.shape, dtype=torch.float32)
    cols = info.shape[-1]
    for lo in range(0, info.shape[0], ERROR_ROWS):
        hi = min(info.shape[0], lo + ERROR_ROWS)
        q = torch.from_numpy(np.array(raw[lo * cols:hi * cols])).view(torch.float8_e4m3fn).reshape(hi - lo, cols)
        out[lo:hi] = q.to(torch.float32) * scale[lo:hi]
        src.release(name, lo * cols, hi * cols)
    return out


class ArtifactReader:
    """The reader the streamed model uses for an artifact: FP8 weights dequantized, every weight compared with
    the source's tensor of the same name (relative L2 error recorded per tensor)."""

    def __init__(self, source_files: list[Path] | None):
        self.original = TensorSource(source_files) if source_files else None
        self.errors: dict[str, float] = {}

    def __call__(self, src: TensorSource, name: str):
        import torch

        from ...model.streamed_model import read_float32

        if src.info(name).dtype == FP8:
            value = dequantized(src, name)
        else:  # an integer tier's weight (int_artifact.py), or a float one
            value = dequantize(src, name) if stored_int(src, name) else read_float32(src, name)
        if self.original is not None and name in self.original and name not in self.errors:
            self.errors[name] = self._error(name, value)
        return value if isinstance(value, torch.Tensor) else torch.from_numpy(value)

    def _error(self, name: str, value) -> float:
        import torch

        info = self.original.info(name)
        if tuple(info.shape) != tuple(value.shape) or not info.shape:
            return float("inf")  # a tensor that changed shape is not a rounding of the source's
        diff = norm = 0.0
        flat = value.reshape(info.shape[0], -1)
        for lo in range(0, info.shape[0], ERROR_ROWS):
            hi = min(info.shape[0], lo + ERROR_ROWS)
            ref = torch.from_numpy(np.ascontiguousarray(self.original.rows(name, lo, hi))).reshape(-1)
            delta = flat[lo:hi].reshape(-1) - ref
            diff += float(torch.dot(delta, delta))  # a BLAS dot: ten times a squared sum's speed
            norm += float(torch.dot(ref, ref))
            self.original.release(name)
        return (diff ** 0.5) / (norm ** 0.5) if norm > 0 else (0.0 if diff == 0 else float("inf"))

    def close(self) -> None:
        if self.original is not None:
            self.original.close()


def open_artifact(model_dir: Path, files: list[Path], source_files: list[Path] | None = None, *,
                  resident: bool = False, layers: int | None = None) -> tuple[StreamedCausalLM, ArtifactReader]:
    """The artifact as a streamed transformers model. Its FP8 and INT8 layers (found from the stored dtypes) get the
    per-token activation quantization vLLM's W8A8 applies; `lm.model.quantize_activations` switches it. W4A16's
    packed weights are read dequantized (int_artifact.py), their activations left as they are."""
    reader = ArtifactReader(source_files)
    # pack-quantized weights (W4A16) under their plain names, so they map onto parameters like any weight
    lm = StreamedCausalLM(model_dir, files, resident=resident, layers=layers, reader=reader,
                          source=PackedSource(files))
    quantizers = {}
    for param, rule in lm.rules.items():
        dtypes = {lm.source.info(s).dtype for s in rule.sources}
        if dtypes & {FP8, INT8} and (param.endswith(".weight") or param.endswith(EXPERT_PROJECTIONS)):
            # W8A8: activations quantized too (an experts module's: its projections' inputs, moe_activations.py)
            quantizers[param.rpartition(".")[0]] = fake_quant_e4m3 if FP8 in dtypes else fake_quant_int8
    install_activation_quantization(lm.model, quantizers)
    return lm, reader


def fake_quant_e4m3(x):
    """x quantized to e4m3 per token and back (vLLM's FP8 W8A8 dynamic)."""
    import torch

    from .fp8 import E4M3_MAX

    scale = (x.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale


def install_activation_quantization(model, quantizers: dict) -> None:
    """Module name -> the per-token dynamic quantization of its input (vLLM's W8A8 dynamic, FP8 or INT8)."""
    def hook(quantize):
        def fake_quant(_module, args):
            if not model.quantize_activations:
                return None
            return (quantize(args[0]),) + tuple(args[1:])
        return fake_quant

    for name, module in model.named_modules():
        if name in quantizers and is_experts(module):
            quantize_expert_inputs(module, lambda x, q=quantizers[name]: q(x) if model.quantize_activations else x)
        elif name in quantizers:
            module.register_forward_pre_hook(hook(quantizers[name]))
    model.quantize_activations = True


def evaluate_into(model_dir: str, files: list[str], source_files: list[str] | None, sequences: list[list[int]],
                  greedy_prompts: list[list[int]], greedy_tokens: int, out_dir: str, resident: bool,
                  layers: int | None = None, weight_only: bool = False) -> dict[str, Any]:
    """Teacher-forced logits of `sequences` (`l{i}.npy`; W8A16 ones `w{i}.npy` with `weight_only`), greedy
    continuations of `greedy_prompts` without stopping at EOS (as vLLM with ignore_eos), and the weights'
    relative errors against the source."""
    from ...process.isolation import peak_memory

    out = Path(out_dir)
    lm, reader = open_artifact(Path(model_dir), [Path(f) for f in files],
                               [Path(f) for f in source_files] if source_files else None,
                               resident=resident, layers=layers)
    batch = len(sequences) if resident else min(len(sequences), 1)  # the passes of one logits_batch
    passes = batch * (2 if weight_only else 1) + len(greedy_prompts) * greedy_tokens
    try:
        with unit_runs([module for _name, module, _r in lm.units], passes, "artifact in transformers"), \
                flops.counted(lm.model) as work:
            for i, logits in enumerate(lm.logits_batch(sequences)):
                np.save(out / f"l{i}.npy", logits)
            if weight_only:
                lm.model.quantize_activations = False
                for i, logits in enumerate(lm.logits_batch(sequences)):
                    np.save(out / f"w{i}.npy", logits)
                lm.model.quantize_activations = True
            greedy = []
            for prompt in greedy_prompts:
                scored = lm.greedy_scored(prompt, greedy_tokens)
                greedy.append({"ids": [t for t, _, _ in scored], "logprobs": [lp for _, lp, _ in scored],
                               "gaps": [g for _, _, g in scored]})
        result = {"greedy": greedy, "weight_errors": reader.errors, "unit_loads": lm.loads, "flop": work.flop}
    finally:
        lm.close()
        reader.close()
    result["usage"] = peak_memory() if not resident else {}
    (out / "done.json").write_text(json.dumps(result))
    return {"unit_loads": result["unit_loads"]}
