"""The GGUF writer whose arrays are packed whole (pipelines/targets/gguf/kv_writer.py): the same bytes as gguf-py's
own writer for every kind of array a conversion writes, and gguf-py's own error where it refuses one."""

from __future__ import annotations

import gguf
import pytest

from pipelines.targets.gguf.kv_writer import GGUFWriter

V = gguf.GGUFValueType
T = gguf.TokenType

ARRAYS = {
    "pieces": ["<s>", "▁the", "é", "日本", "", "\x00", b"raw bytes", bytearray(b"ba")],
    "scores": [0.0, -1000.0, 1e-30, 3.4028234663852886e38, -2.5, 1 / 3],
    "types": [T.NORMAL, T.CONTROL, T.BYTE, T.UNUSED, 1, 6],
    "window_pattern": [True, False, True],
    "ints": [0, -(2 ** 31), 2 ** 31 - 1],
    "big floats": [1.0, float("inf")],  # an Inf: left to gguf-py, which packs it
}


def kv_bytes(cls, arrays: dict, tmp_path, sub_types: dict | None = None) -> bytes:
    path = tmp_path / f"{cls.__module__}.gguf"
    writer = cls(str(path), "llama")
    for key, values in arrays.items():
        writer.add_array(key, values) if key not in (sub_types or {}) else writer.add_key_value(
            key, values, V.ARRAY, sub_type=sub_types[key])
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.close()
    return path.read_bytes()


def test_arrays_are_the_bytes_gguf_py_writes(tmp_path):
    assert kv_bytes(GGUFWriter, ARRAYS, tmp_path) == kv_bytes(gguf.GGUFWriter, ARRAYS, tmp_path)
    typed = {"u8": [0, 255], "u64": [2 ** 64 - 1, 3], "f64": [0.1, -2.0], "i16": [T.BYTE, -7]}
    sub_types = {"u8": V.UINT8, "u64": V.UINT64, "f64": V.FLOAT64, "i16": V.INT16}
    assert kv_bytes(GGUFWriter, typed, tmp_path, sub_types) == kv_bytes(gguf.GGUFWriter, typed, tmp_path, sub_types)


@pytest.mark.parametrize("values, sub_type", [([1, "a"], None), ([2 ** 31], None), ([1e39], None), ([256], V.UINT8),
                                              ([1.5], V.INT32)])
def test_what_gguf_py_refuses_it_refuses_the_same_way(tmp_path, values, sub_type):
    arrays, sub_types = {"bad": values}, ({"bad": sub_type} if sub_type is not None else None)
    with pytest.raises(Exception) as theirs:
        kv_bytes(gguf.GGUFWriter, arrays, tmp_path, sub_types)
    with pytest.raises(type(theirs.value)) as ours:
        kv_bytes(GGUFWriter, arrays, tmp_path, sub_types)
    assert str(ours.value) == str(theirs.value)


def test_a_vocabulary_is_packed_without_a_call_per_token(tmp_path, monkeypatch):
    calls = []
    base = gguf.GGUFWriter._pack_val
    monkeypatch.setattr(gguf.GGUFWriter, "_pack_val", lambda self, *a, **k: calls.append(a[1]) or base(self, *a, **k))
    vocab = {"tokenizer.ggml.tokens": [f"t{i}" for i in range(5000)], "tokenizer.ggml.scores": [-float(i) for i in range(5000)],
             "tokenizer.ggml.token_type": [T.NORMAL] * 5000}
    kv_bytes(GGUFWriter, vocab, tmp_path)
    assert len(calls) < 50, len(calls)  # gguf-py's own writer makes 15,000 and more
