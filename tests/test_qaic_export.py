"""AI 100 ONNX export (pipelines/targets/qaic/export.py): the retained-state contract, run in onnxruntime
against transformers fp32 on the same ids (prefill + 8 decode steps, state fed back)."""

from __future__ import annotations

import random
from pathlib import Path

import onnx
import pytest
import torch
from factories import TINY_CAUSAL_LMS, edit_config, make_llama, make_tiny_causal_lm

from pipelines import reference
from pipelines.errors import NotApplicableError
from pipelines.targets.qaic.export import (FAMILIES, OPSET, compare, export, ort_parity, reference_logits,
                                           run_ort_continuous)

PROMPT = "The capital of France is"


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


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

    by_name = {v.name: v for v in list(m.graph.input) + list(m.graph.output)}
    assert _dims(by_name["input_ids"]) == ["batch_size", "seq_len"]
    assert _dims(by_name["past_key.0"]) == ["batch_size", rep.kv_heads, "ctx_len", rep.head_dim]
    assert _dims(by_name["past_value.1_RetainedState"]) == ["batch_size", rep.kv_heads, "ctx_len", rep.head_dim]
    assert _dims(by_name["logits"])[0] == "batch_size" and _dims(by_name["logits"])[1:] == [1, rep.vocab]
    assert by_name["input_ids"].type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert by_name["past_key.0"].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    ops = {n.op_type for n in m.graph.node}
    assert "ScatterElements" in ops and "attention_mask" not in inputs  # KV scattered at position_ids; mask in-graph
    # weights are constant initializers (MXFP6 only compresses constant MatMul weights)
    weights = {i.name for i in m.graph.initializer}
    assert sum(1 for i in m.graph.initializer if len(i.dims) == 2) >= 2 * 7  # 7 matrices per layer, at least
    assert not any(n in weights for n in inputs)


# --- every AI 100 text family: tiny random models (tests/factories.py TINY_CAUSAL_LMS) -------------------

def _ids(n: int, seed: int = 0) -> list[int]:
    return random.Random(seed).sample(range(512), n)


# name -> KV heads the export must keep (multi-query families keep one, not one per query head)
TINY_KV_HEADS = {"qwen3": 2, "gemma": 2, "gemma2": 2, "phi3": 2, "gpt2": 4, "gptj": 4, "gpt_bigcode": 1,
                 "gpt_bigcode_mha": 4, "granite": 2, "falcon": 2, "falcon_mqa": 1, "olmo2": 2, "mixtral": 2,
                 "qwen3_moe": 2, "gpt_oss": 2}


def test_every_tiny_family_is_declared():
    assert set(TINY_KV_HEADS) == set(TINY_CAUSAL_LMS)
    assert {TINY_CAUSAL_LMS[n][1] for n in TINY_CAUSAL_LMS} | {"LlamaForCausalLM", "MistralForCausalLM",
                                                               "Qwen2ForCausalLM"} == FAMILIES


@pytest.mark.parametrize("name", sorted(TINY_CAUSAL_LMS))
def test_family_runs_in_onnxruntime_with_transformers_parity(name, tmp_path):
    """Prefill 12 random ids + 8 greedy decode steps in ORT, retained state fed back, against transformers fp32.
    gpt_oss: its sliding layers (window 16) are masked as transformers does; these 20 positions pass the window."""
    model_dir = make_tiny_causal_lm(name, tmp_path / name)
    out = tmp_path / "onnx" / "model.onnx"
    rep = export(model_dir, out, ctx_len=32)
    parity = ort_parity(model_dir, out, _ids(12), decode_steps=8, ctx_len=48)  # ctx_len is dynamic
    print(f"{name}: max |delta logit| {parity['max_abs_logit_delta']:.3g} top-1 {parity['top1_agreement']}")
    assert parity["steps"] == 9 and parity["top1_agreement"] == 1.0
    assert parity["max_abs_logit_delta"] < 1e-3
    assert len(set(parity["tokens"])) > 1  # logits are not degenerate
    assert (rep.layers, rep.kv_heads, rep.vocab, rep.max_positions) == (2, TINY_KV_HEADS[name], 512, 256)
    assert rep.architecture == TINY_CAUSAL_LMS[name][1] and rep.files == ["model.onnx"] and not rep.external_data


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt2"])  # GQA + RoPE + MoE routing; learned positions + Conv1D
def test_continuous_batching_scatters_and_reads_cache_rows(name, tmp_path):
    """Two sequences prefilled one at a time into rows 2 and 0 of a full_batch_size=3 cache, then decoded
    together as a batch of 2: each must match transformers on its own."""
    model_dir = make_tiny_causal_lm(name, tmp_path / name)
    out = tmp_path / "onnx" / "model.onnx"
    rep = export(model_dir, out, ctx_len=32, batch_index=True)
    assert rep.batch_index
    m = onnx.load(str(out))
    by_name = {v.name: v for v in list(m.graph.input) + list(m.graph.output)}
    assert [i.name for i in m.graph.input][-1] == "batch_index"
    assert _dims(by_name["batch_index"]) == ["batch_size", 1]
    assert by_name["batch_index"].type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert _dims(by_name["past_key.0"]) == ["full_batch_size", rep.kv_heads, "ctx_len", rep.head_dim]
    assert _dims(by_name["past_value.1_RetainedState"]) == ["full_batch_size", rep.kv_heads, "ctx_len", rep.head_dim]
    assert _dims(by_name["logits"]) == ["batch_size", 1, 512]
    assert "ScatterND" in {n.op_type for n in m.graph.node}
    prompts = [_ids(7, seed=1), _ids(11, seed=2)]
    runs = run_ort_continuous(out, prompts, slots=[2, 0], decode_steps=8, ctx_len=48, full_batch_size=3)
    model = reference.load_model(model_dir)
    for prompt, run in zip(prompts, runs):
        got = compare(reference_logits(model, prompt, run["tokens"]), run["logits"])
        print(name, "continuous batching", got)
        assert got["steps"] == 9 and got["top1_agreement"] == 1.0 and got["max_abs_logit_delta"] < 1e-3
    assert runs[0]["tokens"] != runs[1]["tokens"]


def test_external_data_beside_the_model(tmp_path):
    model_dir = make_tiny_causal_lm("gpt2", tmp_path / "gpt2")
    out = tmp_path / "onnx" / "model.onnx"
    rep = export(model_dir, out, ctx_len=32, external_data_threshold=64 * 1024)  # the tiny model is ~0.7 MB
    assert rep.external_data and rep.files == ["model.onnx", "model.onnx.data"]
    assert sorted(p.name for p in out.parent.iterdir()) == rep.files  # nothing else left behind
    assert out.stat().st_size < 200_000 < (out.parent / "model.onnx.data").stat().st_size
    m = onnx.load(str(out), load_external_data=False)
    assert all(i.data_location == onnx.TensorProto.EXTERNAL for i in m.graph.initializer)
    parity = ort_parity(model_dir, out, _ids(12), decode_steps=8, ctx_len=48)
    assert parity["top1_agreement"] == 1.0 and parity["max_abs_logit_delta"] < 1e-3
    export(model_dir, out, ctx_len=32)  # back under the threshold: the stale data file goes
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.onnx"]


def test_unsupported_architecture_is_refused_in_one_line(tmp_path):
    model_dir = make_tiny_causal_lm("gpt2", tmp_path / "m")
    edit_config(model_dir, architectures=["PhiForCausalLM"])
    with pytest.raises(NotApplicableError) as e:
        export(model_dir, tmp_path / "out" / "model.onnx")
    msg = str(e.value)
    assert "PhiForCausalLM" in msg and "GptOssForCausalLM" in msg and "LlamaForCausalLM" in msg and "\n" not in msg
    assert not (tmp_path / "out" / "model.onnx").exists()
    alibi = make_tiny_causal_lm("falcon_mqa", tmp_path / "alibi", alibi=True)
    with pytest.raises(NotApplicableError, match="ALiBi"):
        export(alibi, tmp_path / "out" / "model.onnx")
