"""tests/gguf_reader.FastGGUFReader reads a GGUF file exactly as gguf-py's GGUFReader does."""

from __future__ import annotations

import json
import time

import gguf
import numpy as np
from gguf_reader import FastGGUFReader

from pipelines.targets.gguf.convert import convert


def test_fast_reader_equals_gguf_py(tiny_llama, tmp_path):
    path = tmp_path / "tiny.gguf"  # SmolLM2's vocabulary and merges, f32 norms, q8_0 matrices
    convert(tiny_llama, json.loads((tiny_llama / "config.json").read_text()),
            sorted(tiny_llama.glob("*.safetensors")), path, "q8_0", name="test/tiny-llama")
    t0 = time.perf_counter()
    slow = gguf.GGUFReader(str(path))
    t1 = time.perf_counter()
    fast = FastGGUFReader(str(path))
    t2 = time.perf_counter()
    print(f"gguf-py {t1 - t0:.2f}s, fast {t2 - t1:.2f}s")
    assert list(fast.fields) == list(slow.fields)
    assert {t.tensor_type for t in slow.tensors} == {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0}
    assert "tokenizer.ggml.tokens" in fast.fields and "tokenizer.ggml.token_type" in fast.fields
    for key, want in slow.fields.items():
        got = fast.fields[key]
        assert (got.offset, got.name, got.data, got.types) == (want.offset, want.name, want.data, want.types), key
        assert len(got.parts) == len(want.parts), key
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(got.parts, want.parts)), key
        assert got.contents() == want.contents(), key
    assert fast.data_offset == slow.data_offset and fast.alignment == slow.alignment
    assert len(fast.tensors) == len(slow.tensors) > 0
    for got, want in zip(fast.tensors, slow.tensors):
        assert (got.name, got.tensor_type, got.n_elements, got.n_bytes, got.data_offset) == \
               (want.name, want.tensor_type, want.n_elements, want.n_bytes, want.data_offset)
        assert np.array_equal(got.shape, want.shape)
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
        assert np.array_equal(got.data, want.data)
