"""Slices stored without a float32 pass: a tensor copied as its source stores it (bf16 -> f16, bf16 -> bf16,
f16 -> f32, ...) is cast straight from the source's bytes, one pass where the general path makes four (widen,
check, encode, check again), so a conversion runs near the speed of a copy of its bytes.

The bytes are the general path's: a bfloat16 or float16 value is exact in float32, so casting it straight to the
output type rounds as casting its float32 widening does (checked for every one of the 65,536 bfloat16 values in
the tests). A slice holding a NaN, an Inf or a value beyond float16's range is handed back (None): the general
path then converts it and raises its own one-line error, with its own counts.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import ml_dtypes  # bfloat16 for numpy, with C casts that release the GIL; the build extra has it through onnx
import numpy as np

Q = gguf.GGMLQuantizationType

# A value's bits with the sign cleared: at or above this, it is Inf or NaN.
_NONFINITE_FROM = {"F16": (np.uint16, 0x7FFF, 0x7C00), "BF16": (np.uint16, 0x7FFF, 0x7F80),
                   "F32": (np.uint32, 0x7FFFFFFF, 0x7F800000)}
_NUMPY = {"F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32}
_GGUF_NAME = {Q.F16: "F16", Q.BF16: "BF16", Q.F32: "F32"}


def all_finite(raw: np.ndarray, dtype: str) -> bool:
    """Whether every value of a little-endian buffer of `dtype` (F16, BF16, F32) is finite, read from its bits."""
    unsigned, magnitude, nonfinite = _NONFINITE_FROM[dtype]
    bits = raw.view(unsigned)
    return bits.size == 0 or int(np.bitwise_and(bits, magnitude).max()) < nonfinite


def encoder(source_dtype: str, qtype: Q) -> Callable[[np.ndarray], np.ndarray | None] | None:
    """A function from a slice's raw source bytes (uint8) to its encoded GGUF bytes, or None when such a slice
    needs the general path; None when this pair of types has no direct cast. bf16 from a wider float rounds
    in gguf-py's own way, so it stays with the general path."""
    out = _GGUF_NAME.get(qtype)
    if out is None or source_dtype not in _NUMPY or (out == "BF16" and source_dtype != "BF16"):
        return None
    source_type, out_type = _NUMPY[source_dtype], _NUMPY[out]
    keeps_every_value = out in (source_dtype, "F32")  # float16's range is narrower than bfloat16's

    def encode(raw: np.ndarray) -> np.ndarray | None:
        if keeps_every_value:  # every finite source value is finite there: checked on the source
            if not all_finite(raw, source_dtype):
                return None
            return raw if out == source_dtype else raw.view(source_type).astype(out_type)
        with np.errstate(over="ignore"):  # a value beyond the range becomes Inf: refused below
            encoded = raw.view(source_type).astype(out_type)
        return encoded if all_finite(encoded.view(np.uint8), out) else None  # a NaN or Inf source stays one too

    return encode
