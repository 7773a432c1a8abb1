"""Direct casts (pipelines/targets/gguf/direct.py): every value a direct cast writes is the byte the general path
(widen to float32, encode) writes, over every 16-bit pattern; a slice with a NaN, an Inf or a value beyond
float16's range goes back to the general path (None), which raises its own error line."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pipelines.source.safetensors_io import to_float32
from pipelines.targets.gguf.convert import _encode
from pipelines.targets.gguf.direct import all_finite, encoder

Q = gguf.GGMLQuantizationType
EVERY_16_BIT = np.arange(1 << 16, dtype=np.uint16)


def general(raw: np.ndarray, dtype: str, qtype: Q) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return _encode(to_float32(raw, dtype), qtype)


@pytest.mark.parametrize("dtype, qtype", [("BF16", Q.F16), ("BF16", Q.BF16), ("BF16", Q.F32), ("F16", Q.F16),
                                          ("F16", Q.F32)])
def test_every_16_bit_value_is_cast_as_the_general_path_casts_it(dtype, qtype):
    encode = encoder(dtype, qtype)
    expected = general(EVERY_16_BIT.view(np.uint8), dtype, qtype)
    finite_in = to_float32(EVERY_16_BIT.view(np.uint8), dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        finite_out = np.isfinite(np.asarray(expected, dtype=np.float32)) if qtype != Q.BF16 else np.isfinite(finite_in)
    ok = np.isfinite(finite_in) & finite_out
    assert 30_000 < ok.sum() < 1 << 16  # both kinds of value are there
    got = encode(EVERY_16_BIT[ok].view(np.uint8))
    assert got is not None
    per_value = np.asarray(expected).view(np.uint8).reshape(1 << 16, -1)
    assert got.view(np.uint8).tobytes() == per_value[ok].tobytes()
    for bad in EVERY_16_BIT[~ok][:: max(1, (~ok).sum() // 200)]:  # a NaN, an Inf or an overflow anywhere: None
        slice_ = EVERY_16_BIT[ok][:1000].copy()
        slice_[517] = bad
        assert encode(slice_.view(np.uint8)) is None, hex(int(bad))


def test_float32_to_float16_rounds_as_numpy_does_and_refuses_what_overflows():
    rng = np.random.default_rng(0)
    spread = rng.standard_normal(100_000) * 10.0 ** rng.integers(-9, 5, 100_000)
    values = np.concatenate([spread, [65504.0, 65519.99, -65519.99, 6.1e-5, 5.96e-8, 2.98e-8, 0.0, -0.0]]).astype(np.float32)
    encode = encoder("F32", Q.F16)
    finite = np.abs(values) < 65520  # what float16 holds after rounding
    got = encode(values[finite].view(np.uint8))
    assert got is not None and got.tobytes() == general(values[finite].view(np.uint8), "F32", Q.F16).tobytes()
    assert encode(np.float32([1.0, 65520.0]).view(np.uint8)) is None
    assert encoder("F32", Q.F32)(np.float32([1.0, np.nan]).view(np.uint8)) is None


def test_pairs_without_a_direct_cast_take_the_general_path():
    assert encoder("F32", Q.BF16) is None and encoder("F16", Q.BF16) is None  # gguf-py rounds these its own way
    assert encoder("BF16", Q.Q8_0) is None and encoder("I64", Q.F16) is None


def test_all_finite_reads_the_bits():
    assert all_finite(np.float32([1, -2, 3e38]).view(np.uint8), "F32")
    assert not all_finite(np.float32([1, -np.inf]).view(np.uint8), "F32")
    assert all_finite(np.zeros(0, np.uint8), "BF16")
    assert not all_finite(np.uint16([0x3F80, 0xFFC1]).view(np.uint8), "BF16")  # a negative NaN
