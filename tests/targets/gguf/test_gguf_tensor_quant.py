"""k-quants written straight from the safetensors (pipelines/targets/gguf/tensor_quant.py) against libllama's
own quantizer run on the lossless intermediate: the same file, byte for byte, without the intermediate.

test_gguf_quant_types.py holds every k-quant type of a model with whole 256-blocks to the same oracle (through
f16); here: a bf16 source (rounding to the intermediate's type is a no-op only for exact transforms), eight
layers (llama.cpp gives some attn_v / ffn_down layers more bits), and rows of 64 that fall back to other types.
"""

from __future__ import annotations

import filecmp
import json
from dataclasses import replace
from pathlib import Path

import gguf
import pytest
from gguf_reader import FastGGUFReader

from pipelines.core.errors import EngineCrashed
from pipelines.model.synthetic import generate, preset
from pipelines.targets.gguf import tensor_quant
from pipelines.targets.gguf.convert import convert
from pipelines.targets.gguf.quantize import quantize

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory) -> Path:
    shape = replace(preset("tiny"), num_hidden_layers=8, vocab_size=2048)
    return Path(generate(tmp_path_factory.mktemp("tq") / "tiny-8", shape, tokenizer_vocab=1000).path)


def _both(model: Path, out: Path, lossless: str, ftype: str) -> tuple[Path, Path, dict, dict]:
    """(libllama's file, the direct file, libllama's summary, the direct report's summary)."""
    cfg = json.loads((model / "config.json").read_text())
    files = sorted(model.glob("*.safetensors"))
    inter, via, direct = out / f"inter-{lossless}.gguf", out / f"{ftype}.gguf", out / f"{ftype}-direct.gguf"
    if not inter.exists():
        convert(model, cfg, files, inter, lossless, name="test/tq")
    summary = quantize(inter, via, ftype)
    report = convert(model, cfg, files, direct, lossless, name="test/tq", ftype=ftype)
    return via, direct, summary, report.quantization


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q3_K_L", "Q5_K_M"])
def test_a_bf16_source_quantized_as_it_streams_is_libllamas_file(bf16_llama, tmp_path_factory, ftype):
    out = tmp_path_factory.getbasetemp() / "tq-bf16"
    out.mkdir(exist_ok=True)
    via, direct, _, _ = _both(bf16_llama, out, "bf16", ftype)
    assert filecmp.cmp(via, direct, shallow=False)
    kinds = {t.tensor_type for t in FastGGUFReader(str(direct)).tensors}
    assert len(kinds - {Q.F32}) >= 2, kinds  # a mix: the layers and the output get more bits than the rest


def test_rows_that_are_not_whole_blocks_fall_back_as_libllama_does(tiny_llama, tmp_path):
    """hidden 64: every k-quant tensor falls back to a 32-block type; the fp32 source needs no rounding."""
    via, direct, summary, mine = _both(tiny_llama, tmp_path, "f32", "Q4_K_M")
    assert filecmp.cmp(via, direct, shallow=False)
    theirs = {f["to"].upper() for f in summary["fallbacks"]}
    assert theirs and {f["to"] for f in mine["fallbacks"]} == theirs, (summary, mine)
    assert all(f["from"] == "a 256-block type" for f in mine["fallbacks"])


def test_the_direct_path_is_taken_where_it_can_be():
    assert tensor_quant.unavailable() is None  # this llama-cpp-python exports llama-ext.h's functions
    assert tensor_quant.direct({"ftype": "Q4_K_M"})
    assert not tensor_quant.direct({"ftype": "IQ2_XS", "imatrix": "calibration"})  # libllama maps the imatrix
    assert not tensor_quant.direct({"outtype": "f16"})


def test_an_architecture_libllama_does_not_know_is_one_line_not_a_dead_build():
    shape = {"architecture": "no-such-arch", "n_embd": 64, "n_ff": 128, "n_layer": 2, "n_head": 4, "n_head_kv": 4,
             "n_expert": 0, "n_embd_head_k": 16, "n_embd_head_v": 16}
    with pytest.raises(EngineCrashed) as e:
        tensor_quant.assign_types(shape, [("blk.0.attn_q.weight", (64, 64), int(Q.F32))], 15, step="Q4_K_M type choice")
    assert "\n" not in str(e.value) and "during Q4_K_M type choice" in str(e.value)


def test_quantize_rows_refuses_rows_that_are_not_whole_blocks():
    import numpy as np

    with pytest.raises(ValueError, match="not whole Q4_K blocks of 256"):
        tensor_quant.quantize_rows(np.zeros((2, 64), np.float32), Q.Q4_K)
    rows = tensor_quant.quantize_rows(np.ones((3, 256), np.float32), Q.Q4_K)
    assert rows.shape == (3, gguf.GGML_QUANT_SIZES[Q.Q4_K][1])


def test_a_type_that_needs_an_importance_matrix_is_refused_before_ggml_would_abort(monkeypatch, tiny_llama, tmp_path):
    from pipelines.core.errors import HiveError

    monkeypatch.setattr(tensor_quant, "assign_types", lambda shape, tensors, ftype, step: [
        int(Q.IQ2_XXS) if len(s) == 2 else None for _, s, _ in tensors])  # as if llama.cpp chose IQ2_XXS
    cfg = json.loads((tiny_llama / "config.json").read_text())
    out = tmp_path / "refused.gguf"
    with pytest.raises(HiveError, match=r"type IQ2_XXS in Q4_K_M, which needs an importance matrix"):
        convert(tiny_llama, cfg, sorted(tiny_llama.glob("*.safetensors")), out, "f32", name="test/tq", ftype="Q4_K_M")
    assert not out.exists()

