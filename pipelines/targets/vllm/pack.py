"""Symmetric integer grids and their compressed-tensors layouts (the checkpoints llm-compressor writes).

- **INT4 weight-only, groups of 128** (`pack-quantized`): each run of `GROUP_SIZE` input columns of a row
  has one scale, `max|w| / 7.5` (compressed-tensors' symmetric rule: the 15 steps of [-8, 7] spread over
  [-max, max]), rounded to bf16 before anything is quantized with it, so the grid the artifact stores is
  the grid every engine dtype reproduces exactly (vLLM widens it to fp32 or casts it to the serving
  dtype). Values are round(w / scale) clamped to [-8, 7], stored offset by 8 as unsigned nibbles, eight
  to an int32 along the input dimension, the first column in the lowest bits: `weight_packed` int32
  [out, in / 8], `weight_scale` bf16 [out, in / 128], `weight_shape` int64 [2]. vLLM reads the same
  bytes as uint4b8 (CPUWNA16, Marlin, Machete).
- **INT8 per output channel** (`int-quantized`, W8A8 with dynamic per-token activations): `weight` int8
  [out, in], `weight_scale` float32 [out, 1], scale = max|w_row| / 127.5, values clamped to [-128, 127].
"""

from __future__ import annotations

from typing import Any

import numpy as np

GROUP_SIZE = 128
# Narrower groups for a layer whose input width is not a multiple of 128 (SmolLM2's 576): vLLM needs whole groups
# per row and Marlin takes 32, 64 and 128; a width none of them divides is quantized per channel.
NARROWER_GROUPS = (64, 32)
INT4_MIN, INT4_MAX = -8, 7
INT8_MIN, INT8_MAX = -128, 127
NIBBLES_PER_WORD = 8  # 32 bits / 4
ACTORDER = "weight"  # GPTQ's static act-order (gptq.py): recorded, changes nothing in the stored layout
COMPRESSED_TENSORS_VERSION = "0.17.0"  # the format version vLLM 0.32-0.33 pin, recorded in every config


def group_size_for(cols: int) -> int | None:
    """The group size of a layer with `cols` input columns: 128, else the widest narrower one that divides it,
    else None (one scale per output channel)."""
    return next((g for g in (GROUP_SIZE, *NARROWER_GROUPS) if cols % g == 0), None)


def bf16_rounded(t):
    """A float32 torch tensor rounded to bf16 and widened back (the values a bf16 scale can hold)."""
    import torch

    return t.to(torch.bfloat16).to(torch.float32)


def group_scales(w, group: int = GROUP_SIZE):
    """bf16-representable scales [rows, cols / group] of float32 torch rows [rows, cols]; an all-zero group
    gets scale 1 (its values quantize to 0 whatever the scale)."""
    import torch

    rows, cols = w.shape
    amax = w.reshape(rows, cols // group, group).abs().amax(dim=2)
    scale = bf16_rounded(amax / ((INT4_MAX - INT4_MIN) / 2))
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_to_grid(w, scale, lo: int, hi: int):
    """round(w / scale) clamped to [lo, hi] as int8 (`scale` broadcasts over `w`: a column, or per row)."""
    import torch

    return torch.clamp(torch.round(w / scale), lo, hi).to(torch.int8)


def round_to_nearest_int4(w, group: int = GROUP_SIZE):
    """(int8 values in [-8, 7], float32 group scales) of float32 torch rows: the grid without calibration."""
    scale = group_scales(w, group)
    expanded = scale.repeat_interleave(group, dim=1)
    return quantize_to_grid(w, expanded, INT4_MIN, INT4_MAX), scale


def dequantize_groups(q, scale, group: int = GROUP_SIZE):
    """float32 [rows, cols] from int values [rows, cols] and group scales [rows, cols / group]."""
    import torch

    return q.to(torch.float32) * scale.to(torch.float32).repeat_interleave(group, dim=1)


def pack_int4(q) -> np.ndarray:
    """int8 torch values in [-8, 7], [rows, cols] (cols a multiple of 8) -> int32 numpy [rows, cols / 8]:
    value + 8 as a nibble, column 8k + j at bits 4j of word k."""
    nibbles = (q.numpy().astype(np.int64) + 8).astype(np.uint32)
    rows, cols = nibbles.shape
    words = nibbles.reshape(rows, cols // NIBBLES_PER_WORD, NIBBLES_PER_WORD)
    shifts = np.arange(NIBBLES_PER_WORD, dtype=np.uint32) * 4
    return np.bitwise_or.reduce(words << shifts, axis=2).view(np.int32)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """int32 [rows, cols / 8] -> int8 values in [-8, 7], [rows, cols] (pack_int4's inverse)."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = np.arange(NIBBLES_PER_WORD, dtype=np.uint32) * 4
    nibbles = (words[:, :, None] >> shifts) & np.uint32(0xF)
    return (nibbles.reshape(words.shape[0], -1).astype(np.int16) - 8).astype(np.int8)


def quantize_rows_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, float, float]:
    """float32 rows [out, in] -> (int8 [out, in], float32 scales [out, 1], squared L2 norm of the error, squared
    L2 norm of the rows): rows are independent, so a tensor is quantized a chunk of rows at a time."""
    import torch

    t = torch.from_numpy(np.array(w, dtype=np.float32))  # a copy: w may be a read-only view of an mmap
    amax = t.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / ((INT8_MAX - INT8_MIN) / 2), torch.ones_like(amax))
    q = quantize_to_grid(t, scale, INT8_MIN, INT8_MAX)
    deq = q.to(torch.float32) * scale
    return (q.numpy(), scale.numpy().astype(np.float32), float(torch.sum((t - deq) ** 2)), float(torch.sum(t ** 2)))


def quantization_args(num_bits: int, kind: str, strategy: str, *, dynamic: bool = False, group_size: int | None = None,
                      observer: str | None = "minmax", actorder: str | None = None) -> dict[str, Any]:
    """One compressed-tensors QuantizationArgs as config.json holds it."""
    return {"num_bits": num_bits, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": dynamic,
            "group_size": group_size, "block_structure": None, "actorder": actorder, "observer": observer,
            "observer_kwargs": {}}


def compressed_tensors_config(fmt: str, weights: dict[str, Any], activations: dict[str, Any] | None,
                              ignore: list[str]) -> dict[str, Any]:
    """config.json's quantization_config: one group of every Linear layer but those in `ignore`."""
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "version": COMPRESSED_TENSORS_VERSION,
        "config_groups": {"group_0": {"targets": ["Linear"], "format": fmt, "weights": weights,
                                      "input_activations": activations, "output_activations": None}},
        "ignore": sorted(set(ignore)),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
    }


def w4a16_config(ignore: list[str], narrower: dict[int | None, list[str]] | None = None) -> dict[str, Any]:
    """INT4 weight-only, symmetric, groups of 128, GPTQ-made with static act-order (llm-compressor's W4A16 scheme
    with `actorder: weight`, alias "static": the stored order and groups, no g_idx).
    `narrower`: group size (None: per channel) -> the layers quantized so, each group of them named exactly in
    a config group of its own (vLLM matches a layer's name before its class)."""
    cfg = compressed_tensors_config("pack-quantized", quantization_args(4, "int", "group", group_size=GROUP_SIZE,
                                                                        actorder=ACTORDER), None, ignore)
    for i, (group, layers) in enumerate(sorted((narrower or {}).items(), key=lambda kv: -(kv[0] or 0)), 1):
        args = (quantization_args(4, "int", "group", group_size=group, actorder=ACTORDER) if group
                else quantization_args(4, "int", "channel", actorder=ACTORDER))
        cfg["config_groups"][f"group_{i}"] = {"targets": sorted(layers), "format": "pack-quantized", "weights": args,
                                              "input_activations": None, "output_activations": None}
    return cfg


def int8_config(ignore: list[str]) -> dict[str, Any]:
    """INT8 W8A8: per-channel weights, activations quantized per token at run time (llm-compressor's W8A8)."""
    return compressed_tensors_config("int-quantized", quantization_args(8, "int", "channel"),
                                     quantization_args(8, "int", "token", dynamic=True, observer=None), ignore)
