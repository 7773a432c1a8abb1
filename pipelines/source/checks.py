"""What every converter refuses in a source checkpoint before it writes anything, whatever its target.

A converter that reads weights through its own mapping can lose or misread what does not fit that mapping,
silently: a tensor stored in an 8-bit or packed dtype with no quantization config (nobody can tell how to
dequantize it), an index that names tensors its shards do not hold (or shards holding tensors it does not
name), a checkpoint tensor the model has no parameter for (another architecture's weights, a renamed module),
and NaN/Inf values that a validation measuring only deltas can let through. Each is one ModelFormatError line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import ModelFormatError
from .safetensors_io import TensorSource

# Packed or 8-bit forms only make sense with a quantization_config: without one nobody can tell how to
# dequantize them.
QUANTIZED_DTYPES = {"I8", "U8", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "U16", "U32", "U64"}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
INDEX = "model.safetensors.index.json"
# Buffers some checkpoints carry that no converter needs (rotary caches, GPT-2's causal masks).
IGNORED_TENSORS = re.compile(r".*\.(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)")
SCAN_BYTES = 64 << 20  # float32 bytes of rows checked at a time


def _listed(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def refuse_quantized_without_config(src: TensorSource, config: dict[str, Any]) -> None:
    if config.get("quantization_config"):
        return
    for name in src.names():
        dt = src.info(name).dtype
        if dt in QUANTIZED_DTYPES:
            raise ModelFormatError(f"tensor {name} is stored as {dt} but config.json declares no quantization: "
                                   "cannot tell how to dequantize it (mixed-precision checkpoint)")


def refuse_index_mismatch(model_dir: Path, src: TensorSource) -> None:
    """The shard index must name exactly the tensors the shards hold, each in the shard that holds it."""
    path = Path(model_dir) / INDEX
    if not path.is_file():
        return
    try:
        weight_map = json.loads(path.read_bytes())["weight_map"]
        assert isinstance(weight_map, dict)
    except Exception:  # noqa: BLE001 - any parse failure of the index is one malformed-input line
        raise ModelFormatError(f"{INDEX} is malformed (no weight_map object)") from None
    absent = [n for n in weight_map if n not in src]
    if absent:
        raise ModelFormatError(f"{INDEX} names tensor(s) no shard holds: {_listed(absent)}")
    elsewhere = [n for n, shard in weight_map.items() if src.where[n].path.name != shard]
    if elsewhere:
        raise ModelFormatError(f"{INDEX} places tensor(s) in another shard than holds them: {_listed(elsewhere)}")
    unnamed = [n for n in src.names() if n not in weight_map]
    if unnamed:
        raise ModelFormatError(f"shards hold tensor(s) {INDEX} does not name: {_listed(unnamed)}")


def refuse_unused_tensors(checkpoint: Iterable[str], used: Iterable[str]) -> None:
    """Every checkpoint tensor goes somewhere: one the model has no parameter for would be dropped silently."""
    taken = set(used)
    stray = [n for n in checkpoint if n not in taken and not IGNORED_TENSORS.fullmatch(n)]
    if stray:
        raise ModelFormatError(f"the checkpoint holds tensor(s) the model has no parameter for: {_listed(stray)} "
                               f"(another architecture's weights?): refusing to drop them silently")


def refuse_non_finite(src: TensorSource) -> None:
    """Every floating-point tensor finite, read a slice of rows at a time (memory stays a slice)."""
    for name in src.names():
        info = src.info(name)
        if info.dtype not in FLOAT_DTYPES:
            continue
        rows = info.shape[0] if info.shape else 1
        step = max(1, SCAN_BYTES // max(4, (info.numel // max(rows, 1)) * 4))
        for lo in range(0, rows, step):
            data = src.rows(name, lo, min(rows, lo + step)) if info.shape else src.float32(name)
            if not np.isfinite(data).all():
                raise ModelFormatError(f"tensor {name} holds NaN/Inf values: refusing to convert a broken model")
            src.release(name)
