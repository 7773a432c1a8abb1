"""Safetensors headers, checked strictly, and tensors read one at a time through mmap.

We parse the format ourselves (8-byte little-endian header length, JSON header, raw data) so that a
truncated file or a header whose offsets do not fit the file is refused with a clear message before
anything reads the data, and so the header-only remote check can reuse the same parser on a byte
range. Reading returns numpy arrays (no torch): bf16 is widened to float32 exactly.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

from ..core.errors import ModelFormatError

MAX_HEADER_BYTES = 100 * 1024 * 1024

# bits per element; F4/F6 packs are counted in bits so sizes stay exact
DTYPE_BITS = {
    "F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U8": 8,
    "U16": 16, "U32": 32, "U64": 64, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F4": 4,
    "F6_E2M3": 6, "F6_E3M2": 6,
}
_NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "U16": np.uint16, "U32": np.uint32,
          "U64": np.uint64, "BOOL": np.bool_}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # offset inside the data section
    end: int

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    header_len: int

    @property
    def data_offset(self) -> int:
        return 8 + self.header_len

    @property
    def parameters(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    def bytes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.dtype] = out.get(t.dtype, 0) + t.nbytes
        return out


def header_length(first8: bytes, name: str, file_size: int | None = None) -> int:
    if len(first8) < 8:
        raise ModelFormatError(f"{name}: truncated safetensors file (no header length)")
    (n,) = struct.unpack("<Q", first8[:8])
    if n == 0 or n > MAX_HEADER_BYTES:
        raise ModelFormatError(f"{name}: safetensors header length {n} is not plausible")
    if file_size is not None and 8 + n > file_size:
        raise ModelFormatError(f"{name}: truncated safetensors file (header claims {n} bytes, file has {file_size})")
    return n


def parse_header(raw: bytes, header_len: int, file_size: int, name: str) -> Header:
    """Validate a header against the size of the file it came from."""
    try:
        doc = json.loads(raw[:header_len].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{name}: safetensors header is not valid JSON ({e})") from None
    except RecursionError:  # a hostile header nested deeper than the parser's stack; no real header nests
        raise ModelFormatError(f"{name}: safetensors header is nested too deeply to be a safetensors header") from None
    if not isinstance(doc, dict):
        raise ModelFormatError(f"{name}: safetensors header is not a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise ModelFormatError(f"{name}: __metadata__ is not an object")
    data_len = file_size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    for tname, spec in doc.items():
        try:
            dtype, shape, (start, end) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelFormatError(f"{name}: tensor {tname!r} has a malformed header entry") from None
        if dtype not in DTYPE_BITS:
            raise ModelFormatError(f"{name}: tensor {tname!r} has unknown dtype {dtype!r}")
        if not all(isinstance(d, int) and d >= 0 for d in shape) or not (isinstance(start, int) and isinstance(end, int)):
            raise ModelFormatError(f"{name}: tensor {tname!r} has a malformed shape or offsets")
        expected = (prod(shape) * DTYPE_BITS[dtype] + 7) // 8
        if start < 0 or end < start or end - start != expected:
            raise ModelFormatError(
                f"{name}: tensor {tname!r} offsets [{start}, {end}) do not match its shape {list(shape)} {dtype}"
            )
        if end > data_len:
            raise ModelFormatError(
                f"{name}: truncated safetensors file (tensor {tname!r} ends at {end}, data section has {data_len} bytes)"
            )
        tensors[tname] = TensorInfo(tname, dtype, shape, start, end)
    spans = sorted((t.start, t.end, t.name) for t in tensors.values() if t.end > t.start)
    for (_s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ModelFormatError(f"{name}: tensors {n0!r} and {n1!r} overlap in the data section")
    return Header(tensors=tensors, metadata={str(k): str(v) for k, v in meta.items()}, header_len=header_len)


def read_header(path: Path) -> Header:
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = header_length(f.read(8), path.name, size)
        raw = f.read(n)
    return parse_header(raw, n, size, path.name)


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Widen a raw little-endian tensor buffer (uint8 view) to float32."""
    if dtype == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype in ("F32", "F16", "F64"):
        return raw.view(_NUMPY[dtype]).astype(np.float32, copy=False)
    raise ModelFormatError(f"tensor dtype {dtype} cannot be converted to float")


class SafetensorsFile:
    """One safetensors file, memory-mapped; `raw()` returns a zero-copy view of one tensor."""

    def __init__(self, path: Path):
        self.path = path
        self.header = read_header(path)
        self._file = open(path, "rb")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size else None

    def raw(self, name: str) -> np.ndarray:
        t = self.header.tensors[name]
        off = self.header.data_offset
        return np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=off + t.start)

    def float32(self, name: str) -> np.ndarray:
        t = self.header.tensors[name]
        return to_float32(self.raw(name), t.dtype).reshape(t.shape)

    def rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) of a tensor (along its first axis) in float32: only those bytes are read and widened."""
        t = self.header.tensors[name]
        return to_float32(self.raw_rows(name, lo, hi), t.dtype).reshape((hi - lo, *t.shape[1:]))

    def raw_rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) of a tensor as stored (a zero-copy uint8 view of the map)."""
        t = self.header.tensors[name]
        row = t.nbytes // t.shape[0] if t.shape and t.shape[0] else 0
        return np.frombuffer(self._map, dtype=np.uint8, count=(hi - lo) * row,
                             offset=self.header.data_offset + t.start + lo * row)

    def release(self, name: str, lo: int = 0, hi: int | None = None) -> None:
        """Drop a finished tensor's pages (or those of its bytes [lo, hi)) from this process's resident set
        (the page cache keeps them; a page read again is mapped again, so dropping is always safe).

        Pages read through the mmap stay resident until the file is closed: without this, a
        streaming conversion's peak RSS grows to the size of the whole model.
        """
        if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        t = self.header.tensors[name]
        start = self.header.data_offset + t.start + lo
        end = self.header.data_offset + (t.end if hi is None else min(t.end, t.start + hi))
        lo = start - start % mmap.PAGESIZE
        hi = min(len(self._map), end + (-end) % mmap.PAGESIZE)
        if hi > lo:
            self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                # A view is still alive (e.g. in the traceback of the error that is closing us): the map is
                # unmapped when that view goes; closing must not replace the original error with this one.
                pass
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TensorSource:
    """All tensors of a snapshot (single file or sharded with an index), opened lazily."""

    def __init__(self, files: list[Path]):
        self.files = [SafetensorsFile(p) for p in files]
        self.where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.header.tensors:
                if name in self.where:
                    raise ModelFormatError(f"tensor {name!r} appears in both {self.where[name].path.name} and {f.path.name}")
                self.where[name] = f

    def names(self) -> list[str]:
        return list(self.where)

    def info(self, name: str) -> TensorInfo:
        return self.where[name].header.tensors[name]

    def float32(self, name: str) -> np.ndarray:
        return self.where[name].float32(name)

    def rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        return self.where[name].rows(name, lo, hi)

    def raw_rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        return self.where[name].raw_rows(name, lo, hi)

    def release(self, name: str, lo: int = 0, hi: int | None = None) -> None:
        self.where[name].release(name, lo, hi)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    @property
    def parameters(self) -> int:
        return sum(f.header.parameters for f in self.files)

    def bytes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.files:
            for k, v in f.header.bytes_by_dtype().items():
                out[k] = out.get(k, 0) + v
        return out

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
