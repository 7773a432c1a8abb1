"""Reading an integer-tier artifact back in transformers: what vLLM computes from its bytes.

- `pack-quantized` (W4A16): a layer's `weight_packed`, `weight_scale` and `weight_shape` stand for one weight.
  `PackedSource` presents them under the weight's own name (`x.weight`, float32, the stored shape), so the
  streamed model maps it onto its parameter like any weight; `dequantize` makes its value: the nibbles unpacked,
  minus 8, times the group scales.
- `int-quantized` (W8A8): `x.weight` is int8 with a float32 scale per row; `dequantize` multiplies them out,
  and `fake_quant_int8` is vLLM's dynamic per-token activation quantization (scale = max|x| / 127, values
  rounded half to even and clamped to [-128, 127]), put in front of every such layer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...source.safetensors_io import TensorInfo, TensorSource
from .pack import unpack_int4

PACKED, SCALE, SHAPE = ".weight_packed", ".weight_scale", ".weight_shape"
INT8 = "I8"
ROWS_AT_ONCE = 4096  # rows dequantized at a time


class PackedSource(TensorSource):
    """An artifact's tensors, each pack-quantized weight under its plain name in place of its three parts."""

    def __init__(self, files: list[Path]):
        super().__init__(files)
        self.packed: dict[str, TensorInfo] = {}
        for name in list(self.where):
            if name.endswith(PACKED):
                weight = name[: -len(PACKED)] + ".weight"
                rows, cols = _shape(self, name[: -len(PACKED)] + SHAPE)
                self.packed[weight] = TensorInfo(weight, "F32", (rows, cols), 0, rows * cols * 4)

    def names(self) -> list[str]:
        parts = {w[: -len(".weight")] + s for w in self.packed for s in (PACKED, SCALE, SHAPE)}
        return [n for n in self.where if n not in parts] + list(self.packed)

    def info(self, name: str) -> TensorInfo:
        return self.packed[name] if name in self.packed else super().info(name)

    def __contains__(self, name: str) -> bool:
        return name in self.packed or super().__contains__(name)


def _shape(src: TensorSource, name: str) -> tuple[int, int]:
    """A `weight_shape` tensor's two int64 values (the shape before packing)."""
    rows, cols = np.array(src.where[name].raw(name)).view(np.int64)
    return int(rows), int(cols)


def stored_int(src: TensorSource, name: str) -> bool:
    """The weight `name` is stored as integers (packed INT4, or INT8)."""
    return name in getattr(src, "packed", {}) or (name in src and src.info(name).dtype == INT8)


def dequantize(src: TensorSource, name: str):
    """An integer weight of the artifact as a float32 torch tensor, a block of rows at a time."""
    import torch

    prefix = name[: -len(".weight")]
    rows, cols = src.info(name).shape
    scale = torch.from_numpy(np.array(src.float32(prefix + SCALE), dtype=np.float32)).reshape(rows, -1)
    group = cols // scale.shape[1]
    out = torch.empty(rows, cols, dtype=torch.float32)
    packed = name in getattr(src, "packed", {})
    stored = prefix + PACKED if packed else name
    raw = src.where[stored].raw(stored)
    width = (cols // 8) * 4 if packed else cols  # bytes a row
    for lo in range(0, rows, ROWS_AT_ONCE):
        hi = min(rows, lo + ROWS_AT_ONCE)
        part = np.array(raw[lo * width:hi * width])
        values = unpack_int4(part.view(np.int32).reshape(hi - lo, cols // 8)) if packed \
            else part.view(np.int8).reshape(hi - lo, cols)
        out[lo:hi] = torch.from_numpy(values.astype(np.float32)) * scale[lo:hi].repeat_interleave(group, dim=1)
        src.release(stored, lo * width, hi * width)
    return out


def fake_quant_int8(x):
    """x quantized to INT8 per token (its last dimension) and back, as vLLM's dynamic W8A8 does before its GEMM."""
    import torch

    scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-12)
    return torch.clamp(torch.round(x / scale), -128, 127) * scale
