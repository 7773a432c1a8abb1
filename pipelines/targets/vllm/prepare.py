"""The portable vLLM directory: HF layout, bf16 (or FP8 W8A8) safetensors shards with an index, the
config normalized, tokenizer and chat template carried, nothing vLLM does not read.

Streaming: tensors are read through mmap a chunk of rows at a time (CHUNK_BYTES of float32) and written
into the output shard at offsets planned from the headers, so memory stays a few chunks whatever the
model's size (a 70B model's 4 GiB fp32 embedding is never whole in memory). A source whose shards are
already bf16 (and small enough) keeps its shard files byte for byte: they are linked, not rewritten, and
their digests come from the snapshot.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...core.errors import ModelFormatError
from ...source.checks import FLOAT_DTYPES, refuse_quantized_without_config
from ...source.safetensors_io import TensorSource, to_float32
from ...source.snapshot import CARRIED_FILES

INDEX = "model.safetensors.index.json"
KEPT_DTYPES = {"I64", "I32", "I16", "BOOL"}  # buffers (position ids, masks): carried as stored
BF16_MAX = 3.3895313892515355e38
ALIGN = 8  # safetensors pads its header so the data section starts 8-byte aligned
CHUNK_BYTES = 64 << 20  # float32 bytes of rows converted at a time (plan.PREPARE_CHUNK_BYTES)


@dataclass
class OutTensor:
    """One tensor of the output: its dtype/shape and how to produce its bytes from the source, in order, a
    chunk of rows at a time."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: Callable[[], Iterator[np.ndarray]]
    source: str | None = None  # source tensor name (for release after writing)


def row_chunks(src: TensorSource, name: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, int]]:
    """[lo, hi) row ranges of a tensor (along its first axis) of about `chunk_bytes` in float32."""
    info = src.info(name)
    rows = info.shape[0] if info.shape else 1
    per_row = max(1, info.numel // max(rows, 1)) * 4
    step = max(1, chunk_bytes // per_row)
    for lo in range(0, rows, step):
        yield lo, min(rows, lo + step)


def raw_chunks(src: TensorSource, name: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[np.ndarray]:
    """A tensor's stored bytes, a chunk at a time, each chunk's mmap pages dropped once written."""
    raw = src.where[name].raw(name)
    for lo in range(0, len(raw), chunk_bytes):
        yield raw[lo:lo + chunk_bytes]
        src.release(name, lo, lo + chunk_bytes)


@dataclass
class PrepareReport:
    shards: list[str] = field(default_factory=list)
    reused_shards: list[str] = field(default_factory=list)
    tensors: int = 0
    converted_dtypes: dict[str, int] = field(default_factory=dict)
    quantized: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    weight_errors: dict[str, float] = field(default_factory=dict)  # FP8: relative error per quantized weight


def to_bf16(data: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), rounding to nearest even, as torch does."""
    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def check_finite(name: str, data: np.ndarray, limit: float | None = None) -> None:
    if not np.isfinite(data).all():
        bad = int(data.size - np.count_nonzero(np.isfinite(data)))
        raise ModelFormatError(f"tensor {name} holds {bad} NaN/Inf value(s): refusing to publish a broken model")
    if limit is not None and data.size and float(np.abs(data).max()) > limit:
        raise ModelFormatError(f"tensor {name} holds values beyond bfloat16's range")


def tensor_order(src: TensorSource) -> list[str]:
    """Source order: file by file, tensors by data offset (keeps reads sequential)."""
    out = []
    for f in src.files:
        out += [t.name for t in sorted(f.header.tensors.values(), key=lambda t: t.start)]
    return out


def check_dtypes(src: TensorSource) -> None:
    """The compatibility check already refuses quantization configs for this target: no 8-bit or packed tensor."""
    refuse_quantized_without_config(src, {})


def bf16_tensor(src: TensorSource, name: str) -> OutTensor:
    info = src.info(name)
    if info.dtype == "BF16":
        def checked() -> Iterator[np.ndarray]:  # carried as stored, never with NaN/Inf in it
            for part in raw_chunks(src, name):
                check_finite(name, to_float32(part, "BF16"))
                yield part
        return OutTensor(name, "BF16", info.shape, info.nbytes, checked, source=name)
    if info.dtype in FLOAT_DTYPES:
        def converted() -> Iterator[np.ndarray]:
            for lo, hi in row_chunks(src, name):
                data = src.rows(name, lo, hi)
                check_finite(name, data, BF16_MAX)
                yield to_bf16(data)
                src.release(name)
        return OutTensor(name, "BF16", info.shape, info.numel * 2, converted, source=name)
    return OutTensor(name, info.dtype, info.shape, info.nbytes, lambda: raw_chunks(src, name), source=name)


def row_quantized(src: TensorSource, name: str, errors: dict[str, float], quantize_rows: Callable, dtype: str) -> list[OutTensor]:
    """A 2-D weight stored one byte a value (FP8, INT8) and its per-row scale: `quantize_rows` (float32 rows ->
    (bytes, float32 scales [rows, 1], squared error, squared norm)) runs a chunk of rows at a time as the weight
    is written, the scales gathered meanwhile and written after it; `errors[name]` gets the relative L2 error."""
    rows, cols = src.info(name).shape
    scales: list[np.ndarray] = []

    def weight() -> Iterator[np.ndarray]:
        err = norm = 0.0
        for lo, hi in row_chunks(src, name):
            data = src.rows(name, lo, hi)
            check_finite(name, data)
            q, scale, e, n = quantize_rows(data)
            scales.append(scale)
            err, norm = err + e, norm + n
            yield q
            src.release(name)
        errors[name] = (err / norm) ** 0.5 if norm > 0 else 0.0

    def scale() -> Iterator[np.ndarray]:
        yield np.concatenate(scales, axis=0) if scales else np.zeros((0, 1), dtype=np.float32)
        scales.clear()

    prefix = name[: -len(".weight")]
    return [OutTensor(name, dtype, (rows, cols), rows * cols, weight, source=name),
            OutTensor(f"{prefix}.weight_scale", "F32", (rows, 1), rows * 4, scale)]


def plan_shards(tensors: list[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def write_shard(path: Path, tensors: list[OutTensor], src: TensorSource, metadata: dict[str, str]) -> None:
    """Header from the planned sizes, then each tensor's bytes in order (a chunk in memory at a time)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % ALIGN)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors:
            written = 0
            for part in t.chunks():
                buf = memoryview(np.ascontiguousarray(part)).cast("B")
                f.write(buf)
                written += len(buf)
                del part, buf
            if written != t.nbytes:  # a checkpoint whose tensor shapes disagree with its config.json
                raise ModelFormatError(f"{t.name}: its source gives {written} bytes where the plan from config.json "
                                       f"needs {t.nbytes}: the checkpoint does not match its config.json")
            if t.source is not None and t.source in src:
                src.release(t.source)


def shard_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def write_index(out_dir: Path, weight_map: dict[str, str], total_size: int) -> None:
    doc = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX).write_text(json.dumps(doc, indent=2) + "\n")


def reusable_source_shards(src: TensorSource, max_bytes: int) -> bool:
    """The source's shards are already what we would write: bf16 (or kept buffers) only, each within
    the shard limit, with standard names. Then they are carried unchanged."""
    for f in src.files:
        if f.path.stat().st_size > max_bytes or not f.path.name.startswith("model"):
            return False
        if any(t.dtype not in {"BF16"} | KEPT_DTYPES for t in f.header.tensors.values()):
            return False
    return True


# Config keys vLLM's model code reads that transformers' config class neither defines nor derives, per model_type:
# key -> the key whose value it takes. LFM2 (vLLM 0.32's lfm2.py): `conv_dim` (the short convolution's width) and
# `block_dim` (the MLP's), keys of LiquidAI's released configs that transformers 5 keeps when present but never
# writes itself; its Lfm2ShortConv and Lfm2MLP are hidden_size wide, so a checkpoint transformers runs has both.
ENGINE_CONFIG_KEYS: dict[str, dict[str, str]] = {"lfm2": {"conv_dim": "hidden_size", "block_dim": "hidden_size"}}


def with_engine_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with the ENGINE_CONFIG_KEYS of its model_type that it lacks (a present value is kept)."""
    keys = ENGINE_CONFIG_KEYS.get(cfg.get("model_type", ""), {})
    return {**{k: cfg[src] for k, src in keys.items() if k not in cfg and src in cfg}, **cfg}


def normalize_config(cfg: dict[str, Any], dtype: str, quantization_config: dict[str, Any] | None) -> dict[str, Any]:
    """dtype recorded under both spellings (transformers 5 reads `dtype`, 4.x and older vLLM `torch_dtype`);
    a stale quantization_config never survives; ours is added for quantized tiers; keys vLLM reads that the
    checkpoint's config lacks are derived (ENGINE_CONFIG_KEYS)."""
    out = {k: v for k, v in with_engine_keys(cfg).items() if k not in ("quantization_config", "torch_dtype", "dtype")}
    out["torch_dtype"] = dtype
    out["dtype"] = dtype
    text = out.get("text_config")
    if isinstance(text, dict):
        out["text_config"] = {k: v for k, v in with_engine_keys(text).items()
                              if k not in ("torch_dtype", "dtype", "quantization_config")}
        out["text_config"]["dtype"] = dtype
    if quantization_config is not None:
        out["quantization_config"] = quantization_config
    return out


def carry_files(snapshot_dir: Path, files: list[str], out_dir: Path, cfg: dict[str, Any]) -> list[str]:
    """Config (normalized) and the tokenizer / chat template / licence files, all 0644."""
    written = []
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    written.append("config.json")
    for name in CARRIED_FILES:
        if name == "config.json" or name not in files:
            continue
        shutil.copyfile(snapshot_dir / name, out_dir / name)
        written.append(name)
    return written
