"""Our direct q8_0 GGUF must hold exactly the bytes llama.cpp's own quantizer writes.

Reference path: our converter -> f32 GGUF -> libllama `llama_model_quantize(Q8_0)`. Direct path: our
converter -> q8_0 (gguf-py's numpy Q8_0). Every tensor is compared byte for byte.

What libllama does for LLAMA_FTYPE_MOSTLY_Q8_0 (llama-quant.cpp in the llama.cpp vendored by
llama-cpp-python 0.3.36), and so what our converter must do too:
- only tensors with >= 2 dims whose name ends in "weight" (and not "_norm.weight") are quantized;
  1-D tensors (norms, biases, rope_freqs) keep their type: F32;
- every quantized tensor, output.weight and token_embd.weight included, becomes Q8_0 (the
  output/tied-embedding rule only changes the type when it is not Q8_0 already);
- a tensor whose row length (ne[0]) is not a multiple of the 32-wide Q8_0 block falls back to F16.
So no tensor type may differ between the two files.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from factories import make_llama
from gguf_reader import FastGGUFReader

from pipelines.source.fetch import fetch
from pipelines.targets.gguf.convert import convert
from pipelines.targets.gguf.quantize import quantize

Q = gguf.GGMLQuantizationType
QK8_0 = gguf.GGML_QUANT_SIZES[Q.Q8_0][0]


def build_pair(model_dir: Path, tmp: Path) -> tuple[Path, Path]:
    snap = fetch(str(model_dir), f"test/{model_dir.name}")
    args = (snap.dir, snap.config(), snap.safetensors_files())
    f32 = tmp / "f32.gguf"
    convert(*args, f32, "f32", name=snap.model_id)
    reference = tmp / "llama-cpp-q8_0.gguf"
    quantize(f32, reference, "Q8_0")
    f32.unlink()
    ours = tmp / "hive-aot-q8_0.gguf"
    convert(*args, ours, "q8_0", name=snap.model_id)
    return reference, ours


def kv(reader: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def compare(reference: Path, ours: Path) -> dict[str, list[str]]:
    ref_reader, our_reader = FastGGUFReader(str(reference)), FastGGUFReader(str(ours))
    ref = {t.name: t for t in ref_reader.tensors}
    got = {t.name: t for t in our_reader.tensors}
    assert set(ref) == set(got)

    type_differs = sorted(n for n in ref if ref[n].tensor_type != got[n].tensor_type)
    assert type_differs == [], {n: (ref[n].tensor_type.name, got[n].tensor_type.name) for n in type_differs}

    q8 = sorted(n for n in ref if ref[n].tensor_type == Q.Q8_0 == got[n].tensor_type)
    assert q8, "no tensor is Q8_0 in both files"
    by_type: dict[str, list[str]] = {}
    for name in sorted(ref):
        a, b = ref[name], got[name]
        assert list(a.shape) == list(b.shape), name
        assert a.n_bytes == b.n_bytes, name
        assert np.asarray(a.data).view(np.uint8).tobytes() == np.asarray(b.data).view(np.uint8).tobytes(), \
            f"{name} ({a.tensor_type.name}) differs from llama.cpp's bytes"
        by_type.setdefault(a.tensor_type.name, []).append(name)

    # libllama's rules, applied to the shapes: which tensors must be Q8_0, F16 (fallback) or F32
    for name, t in ref.items():
        ne0 = int(t.shape[0])
        if len(t.shape) == 1:
            assert t.tensor_type == Q.F32, name
        elif ne0 % QK8_0:
            assert t.tensor_type == Q.F16, name
        else:
            assert t.tensor_type == Q.Q8_0, name

    ref_kv, our_kv = kv(ref_reader), kv(our_reader)
    assert ref_kv["general.file_type"] == our_kv["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    assert ref_kv == our_kv  # libllama copies our metadata and sets file_type and quantization_version
    return by_type


def test_tiny_model_q8_0_is_byte_identical_to_llama_cpp(smollm2_dir, tmp_path):
    # untied (output.weight), biases and rope_freqs (1-D, stay F32), and ffn_down rows of 80 values:
    # not whole 32-blocks, so both sides must fall back to F16 for them
    d = make_llama(tmp_path / "q8-tiny", smollm2_dir, tie=False, attention_bias=True, intermediate_size=80,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64})
    reference, ours = build_pair(d, tmp_path)
    by_type = compare(reference, ours)
    print({k: len(v) for k, v in by_type.items()})
    assert {"output.weight", "token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_up.weight"} <= set(by_type["Q8_0"])
    assert by_type["F16"] == ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight"]
    assert {"rope_freqs.weight", "blk.0.attn_q.bias", "output_norm.weight"} <= set(by_type["F32"])


@pytest.mark.slow
def test_smollm2_q8_0_is_byte_identical_to_llama_cpp(smollm2_dir, tmp_path):
    reference, ours = build_pair(smollm2_dir, tmp_path)
    by_type = compare(reference, ours)
    print({k: len(v) for k, v in by_type.items()})
    assert len(by_type["Q8_0"]) == 30 * 7 + 1  # 30 layers x 7 matrices + the tied token_embd
    assert "F16" not in by_type  # 576 and 1536 are whole 32-blocks
    assert len(by_type["F32"]) == 30 * 2 + 1
