"""AI 100 Whisper (pipelines/targets/qaic/whisper.py, issue 25 item 2): one retained-state graph for the Encoder and
Decode specializations, exported from a tiny random WhisperForConditionalGeneration and run in onnxruntime on a
synthetic log-mel: the Encoder step, then Decode steps feeding the retained self- and cross-attention KV back,
against transformers fp32 on the same ids, and greedy end to end."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from pipelines.targets.qaic import whisper
from pipelines.targets.qaic.whisper import (
    OPSET,
    engine_args,
    export_whisper,
    past_names,
    run_ort_whisper,
    specializations,
    whisper_parity,
)

CTX = 32
START = [1, 5]  # a start token and a second forced token (the task / language tokens of a real prompt)


def tiny_whisper(**kw):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    cfg = WhisperConfig(vocab_size=96, num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, max_source_positions=24, max_target_positions=48, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, init_std=0.2, **kw)
    cfg._attn_implementation = "eager"
    return WhisperForConditionalGeneration(cfg).eval()


def log_mel(model, seed: int = 0) -> np.ndarray:
    """A synthetic log-mel [1, mels, 2 x max_source_positions] (numpy), in Whisper's normalized range."""
    cfg = model.config
    rng = np.random.default_rng(seed)
    return np.clip(rng.standard_normal((1, cfg.num_mel_bins, 2 * cfg.max_source_positions)), -1.5, 1.5).astype(np.float32)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = tiny_whisper()
    report = export_whisper(model, tmp_path_factory.mktemp("whisper") / "model.onnx", ctx_len=CTX)
    return model, report


def test_ort_parity_encoder_then_decode_steps_and_greedy_end_to_end(exported):
    model, report = exported
    for seed in (0, 1):
        r = whisper_parity(model, report.path, log_mel(model, seed), START, decode_steps=8, ctx_len=CTX)
        assert r["finite"] and r["steps"] == 9
        assert r["top1_agreement"] == 1.0 and r["max_abs_logit_delta"] < 1e-4, r
        assert r["tokens_equal"], r
    a = run_ort_whisper(report.path, log_mel(model, 0), START, 4, CTX)["tokens"]
    b = run_ort_whisper(report.path, log_mel(model, 1), START, 4, CTX)["tokens"]
    assert a != b  # the decode steps read the audio (the retained cross KV), not only the tokens


def test_the_graph_contract(exported):
    model, report = exported
    graph = onnx.load(report.path, load_external_data=False)
    assert [o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")] == [OPSET]
    assert {n.domain for n in graph.graph.node} == {""} and not {"If", "Loop"} & {n.op_type for n in graph.graph.node}
    names = [i.name for i in graph.graph.input if i.name not in {t.name for t in graph.graph.initializer}]
    assert names == ["input_features", "input_ids", "position_ids"] + past_names(2)
    assert [o.name for o in graph.graph.output] == ["logits"] + [f"{p}_RetainedState" for p in past_names(2)]
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.graph.input}
    assert dims["input_features"] == ["batch_size", 16, "feature_len"]
    assert dims["past_key_self.1"] == ["batch_size", 4, "decoder_ctx_len", 8]
    assert dims["past_value_cross.0"] == ["batch_size", 4, "encoder_ctx_len", 8]
    assert report.files == ["model.onnx", "model.onnx.data"] and not any(
        t.HasField("raw_data") for t in graph.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL)
    spec = specializations(model.config, ctx_len=CTX)
    assert [(s["name"], s["feature_len"], s["encoder_ctx_len"], s["seq_len"]) for s in spec] == [
        ("Encoder", 48, 24, 1), ("Decode", 1, 24, 1)]


def test_the_decode_specialization_keeps_the_cross_kv_and_the_encoder_one_replaces_it(exported):
    _model, report = exported
    from pipelines.targets.qaic.ort import session

    sess = session(report.path)
    rng = np.random.default_rng(3)
    past = {i.name: rng.standard_normal((1, 4, CTX if "_self" in i.name else 24, 8)).astype(np.float32)
            for i in sess.get_inputs() if i.name.startswith("past_")}
    ids = {"input_ids": np.asarray([[3]]), "position_ids": np.asarray([[2]])}
    outs = [o.name for o in sess.get_outputs()]
    decode = dict(zip(outs, sess.run(outs, {"input_features": np.zeros((1, 16, 1), np.float32), **ids, **past})))
    encode = dict(zip(outs, sess.run(outs, {"input_features": np.ones((1, 16, 48), np.float32), **ids, **past})))
    for name in past:
        kept = np.array_equal(decode[f"{name}_RetainedState"], past[name])
        assert kept == ("_cross" in name), name  # self KV: position 2 written
        assert not np.array_equal(encode[f"{name}_RetainedState"], past[name])
        if "_self" in name:
            new = decode[f"{name}_RetainedState"]
            assert np.array_equal(np.delete(new, 2, axis=2), np.delete(past[name], 2, axis=2))


def test_serving_binding_for_speech_to_text():
    args = engine_args(tiny_whisper().config, "openai/whisper-tiny", ctx_len=150)
    assert args == {"served_model_name": "openai/whisper-tiny", "max_model_len": 150, "max_num_batched_tokens": 24,
                    "max_num_seqs": 1, "hf_overrides": {"max_source_positions": 24},
                    "limit_mm_per_prompt": {"audio": 1}, "enable_prefix_caching": False}
    assert whisper.ARCHITECTURES == {"WhisperForConditionalGeneration"}
