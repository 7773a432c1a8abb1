"""Our strict safetensors reader: real files parse like the reference library; broken ones are refused clearly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import raw_safetensors
from safetensors import safe_open
from safetensors.torch import save_file

from pipelines.core.errors import HiveError, ModelFormatError
from pipelines.source.safetensors_io import SafetensorsFile, TensorSource, read_header


def _real_file(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(5, generator=g).to(torch.float16),
        "c.f32": torch.randn(2, 3, 4, generator=g),
        "d.ids": torch.arange(6, dtype=torch.int64),
        "e.empty": torch.zeros(0, 3, dtype=torch.float32),
        "f.scalar": torch.tensor(3.5, dtype=torch.float32),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "test"})
    return path, tensors


def test_header_of_a_real_file_matches_the_reference_library(tmp_path):
    path, tensors = _real_file(tmp_path)
    h = read_header(path)
    assert h.metadata == {"format": "pt", "note": "test"}
    assert set(h.tensors) == set(tensors)
    dt = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64"}
    with safe_open(str(path), framework="pt") as f:
        for name, t in tensors.items():
            info = h.tensors[name]
            assert info.dtype == dt[t.dtype]
            assert info.shape == tuple(t.shape) == tuple(f.get_slice(name).get_shape())
            assert info.numel == t.numel()
            assert info.nbytes == t.numel() * t.element_size()
    assert h.parameters == sum(t.numel() for t in tensors.values())
    assert h.bytes_by_dtype()["BF16"] == 7 * 5 * 2
    assert h.data_offset + sum(t.nbytes for t in h.tensors.values()) == path.stat().st_size

    with SafetensorsFile(path) as sf:
        for name in ("a.weight", "b.bias", "c.f32", "f.scalar"):
            np.testing.assert_array_equal(sf.float32(name), tensors[name].float().numpy())
        assert sf.float32("e.empty").shape == (0, 3)
        assert sf.raw("d.ids").view(np.int64).tolist() == list(range(6))


def test_bf16_widening_is_exact(tmp_path):
    g = torch.Generator().manual_seed(1)
    values = torch.cat([
        torch.randn(4096, generator=g) * 10.0 ** torch.randint(-30, 30, (4096,), generator=g).float(),
        torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), 3.3895e38, -3.3895e38, 1e-40, -9.2e-41,
                      torch.finfo(torch.bfloat16).tiny, torch.finfo(torch.bfloat16).eps]),
    ]).to(torch.bfloat16)
    # every bf16 bit pattern that is not a NaN, too
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    bits = bits[~torch.isnan(bits)]
    path = tmp_path / "bf16.safetensors"
    save_file({"x": values.reshape(64, -1) if values.numel() % 64 == 0 else values, "all": bits}, str(path))
    with SafetensorsFile(path) as sf:
        for name, t in (("x", values), ("all", bits)):
            ours = sf.float32(name)
            ref = t.float().numpy().reshape(ours.shape)
            assert ours.dtype == np.float32
            # bit-exact, signed zeros and infinities included
            np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_bf16_nan_stays_nan(tmp_path):
    t = torch.tensor([float("nan"), 1.0], dtype=torch.bfloat16)
    path = tmp_path / "nan.safetensors"
    save_file({"t": t}, str(path))
    with SafetensorsFile(path) as sf:
        out = sf.float32("t")
    assert np.isnan(out[0]) and out[1] == 1.0


def _expect(path: Path, *fragments: str) -> str:
    with pytest.raises(ModelFormatError) as ei:
        read_header(path)
    msg = str(ei.value)
    assert isinstance(ei.value, HiveError) and "\n" not in msg
    assert msg.startswith(f"{path.name}: "), msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


def test_truncated_file(tmp_path):
    path, _ = _real_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    _expect(path, "truncated safetensors file", "data section has")


def test_file_shorter_than_length_prefix(tmp_path):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x10\x00\x00")
    _expect(path, "truncated safetensors file (no header length)")
    path.write_bytes(b"")
    _expect(path, "truncated safetensors file (no header length)")


def test_header_length_beyond_file(tmp_path):
    path = raw_safetensors(tmp_path / "m.safetensors", {"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                           b"\0" * 4, header_len=10_000)
    _expect(path, "truncated safetensors file (header claims 10000 bytes")


def test_implausible_header_length(tmp_path):
    path = raw_safetensors(tmp_path / "m.safetensors", b"{}", header_len=1 << 40)
    _expect(path, "header length", "not plausible")
    path = raw_safetensors(tmp_path / "m.safetensors", b"", header_len=0)
    _expect(path, "header length 0 is not plausible")


def test_offsets_not_matching_shape_and_dtype(tmp_path):
    path = raw_safetensors(tmp_path / "m.safetensors",
                           {"w": {"dtype": "F16", "shape": [4, 4], "data_offsets": [0, 64]}}, b"\0" * 64)
    _expect(path, "tensor 'w' offsets [0, 64) do not match its shape [4, 4] F16")
    path = raw_safetensors(tmp_path / "m.safetensors",
                           {"w": {"dtype": "BF16", "shape": [3], "data_offsets": [4, 2]}}, b"\0" * 8)
    _expect(path, "tensor 'w' offsets [4, 2) do not match")


def test_overlapping_tensors(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
              "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
    path = raw_safetensors(tmp_path / "m.safetensors", header, b"\0" * 24)
    _expect(path, "tensors 'a' and 'b' overlap in the data section")


def test_offsets_past_the_end(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
              "b": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}
    path = raw_safetensors(tmp_path / "m.safetensors", header, b"\0" * 20)
    _expect(path, "tensor 'b' ends at 32, data section has 20 bytes")


def test_non_json_header(tmp_path):
    path = raw_safetensors(tmp_path / "m.safetensors", b"{not json at all" + b" " * 8, b"")
    _expect(path, "safetensors header is not valid JSON")
    path = raw_safetensors(tmp_path / "m.safetensors", b"\xff\xfe\x00garbage", b"")
    _expect(path, "safetensors header is not valid JSON")
    path = raw_safetensors(tmp_path / "m.safetensors", b"[1, 2, 3]", b"")
    _expect(path, "safetensors header is not a JSON object")


def test_deeply_nested_header_is_one_line(tmp_path):
    """Issue 7 item 9a: json.loads raised RecursionError (a traceback) on a hostile header."""
    nested = b'{"__metadata__": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    path = raw_safetensors(tmp_path / "m.safetensors", nested, b"")
    _expect(path, "safetensors header is nested too deeply")
    path = raw_safetensors(tmp_path / "m.safetensors", b'{"w": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001, b"")
    _expect(path, "safetensors header is nested too deeply")


def test_malformed_entries(tmp_path):
    cases = [
        ({"w": {"dtype": "F32", "shape": [1]}}, "tensor 'w' has a malformed header entry"),
        ({"w": "nope"}, "tensor 'w' has a malformed header entry"),
        ({"w": {"dtype": "F12", "shape": [1], "data_offsets": [0, 4]}}, "tensor 'w' has unknown dtype 'F12'"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, "tensor 'w' has a malformed shape or offsets"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4.0]}}, "malformed shape or offsets"),
        ({"__metadata__": ["x"], "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, "__metadata__ is not an object"),
    ]
    for header, frag in cases:
        _expect(raw_safetensors(tmp_path / "m.safetensors", header, b"\0" * 4), frag)


def test_tensor_source_refuses_duplicate_names_across_shards(tmp_path):
    save_file({"x": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    save_file({"x": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(ModelFormatError, match="tensor 'x' appears in both a.safetensors and b.safetensors"):
        TensorSource([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])


def test_tensor_source_over_shards(tmp_path):
    save_file({"x": torch.arange(4, dtype=torch.float32)}, str(tmp_path / "a.safetensors"))
    save_file({"y": torch.ones(2, 3, dtype=torch.bfloat16)}, str(tmp_path / "b.safetensors"))
    with TensorSource([tmp_path / "a.safetensors", tmp_path / "b.safetensors"]) as ts:
        assert sorted(ts) == ["x", "y"] and "y" in ts
        assert ts.parameters == 10
        assert ts.bytes_by_dtype() == {"F32": 16, "BF16": 12}
        assert ts.float32("y").tolist() == [[1.0] * 3] * 2
        assert ts.info("x").shape == (4,)


def test_header_json_matches_raw_bytes(tmp_path):
    """Our parser reads exactly the header the file declares (padding spaces included)."""
    path, _ = _real_file(tmp_path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    doc = json.loads(raw[8:8 + n])
    h = read_header(path)
    assert h.header_len == n
    assert {k: [v["dtype"], v["shape"], v["data_offsets"]] for k, v in doc.items() if k != "__metadata__"} == {
        k: [t.dtype, list(t.shape), [t.start, t.end]] for k, t in h.tensors.items()}
