"""AI 100 ONNX export (pipelines/targets/qaic/export.py): the retained-state contract, run in onnxruntime
against transformers fp32 on the same ids (prefill + 8 decode steps, state fed back)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch
from factories import make_llama

from pipelines import reference
from pipelines.targets.qaic.export import OPSET, export, ort_parity

PROMPT = "The capital of France is"


def _qwen2(dest: Path, tokenizer_dir: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         tie_word_embeddings=False))
    model.save_pretrained(str(dest))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (dest / f).write_bytes((tokenizer_dir / f).read_bytes())
    return dest


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "demo"])
def test_export_runs_in_onnxruntime_with_transformers_parity(family, smollm2_dir, tiny_llama, tmp_path):
    model_dir = {
        "llama": lambda: tiny_llama,  # grouped-query attention (4 heads, 2 KV heads), tied embeddings
        "mistral": lambda: make_llama(tmp_path / "mistral", smollm2_dir, arch="MistralForCausalLM", tie=False),
        "qwen2": lambda: _qwen2(tmp_path / "qwen2", smollm2_dir),  # q/k/v biases
        "demo": lambda: smollm2_dir,  # the real SmolLM2-135M-Instruct
    }[family]()
    out = tmp_path / "onnx" / "model.onnx"
    rep = export(model_dir, out, ctx_len=64)
    ids = list(reference.load_tokenizer(model_dir)(PROMPT).input_ids)
    # ctx_len is a dynamic axis: run with a longer cache than the export sample had
    parity = ort_parity(model_dir, out, ids, decode_steps=8, ctx_len=96)
    print(family, parity)
    assert parity["steps"] == 9 and parity["top1_agreement"] == 1.0
    assert parity["max_abs_logit_delta"] < 1e-3
    if family == "demo":  # the same continuation vLLM and llama.cpp give
        assert reference.load_tokenizer(model_dir).decode(parity["tokens"][:2]) == " Paris."
    assert rep.layers == 2 or family == "demo"


def test_onnx_follows_the_compile_contract(tiny_llama, tmp_path):
    out = tmp_path / "model.onnx"
    rep = export(tiny_llama, out, ctx_len=32)
    m = onnx.load(str(out))
    assert m.opset_import[0].version == OPSET == 17
    assert all(op.domain in ("", "ai.onnx") for op in m.opset_import)  # standard ops only: runs in onnxruntime
    inputs = [i.name for i in m.graph.input]
    outputs = [o.name for o in m.graph.output]
    assert inputs == ["input_ids", "position_ids", "past_key.0", "past_value.0", "past_key.1", "past_value.1"]
    assert outputs == ["logits", "past_key.0_RetainedState", "past_value.0_RetainedState",
                       "past_key.1_RetainedState", "past_value.1_RetainedState"]

    def dims(value_info):
        return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]

    by_name = {v.name: v for v in list(m.graph.input) + list(m.graph.output)}
    assert dims(by_name["input_ids"]) == ["batch_size", "seq_len"]
    assert dims(by_name["past_key.0"]) == ["batch_size", rep.kv_heads, "ctx_len", rep.head_dim]
    assert dims(by_name["past_value.1_RetainedState"]) == ["batch_size", rep.kv_heads, "ctx_len", rep.head_dim]
    assert dims(by_name["logits"])[0] == "batch_size" and dims(by_name["logits"])[1:] == [1, rep.vocab]
    assert by_name["input_ids"].type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert by_name["past_key.0"].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    ops = {n.op_type for n in m.graph.node}
    assert "ScatterElements" in ops and "attention_mask" not in inputs  # KV scattered at position_ids; mask in-graph
    # weights are constant initializers (MXFP6 only compresses constant MatMul weights)
    weights = {i.name for i in m.graph.initializer}
    assert sum(1 for i in m.graph.initializer if len(i.dims) == 2) >= 2 * 7  # 7 matrices per layer, at least
    assert not any(n in weights for n in inputs)
