"""AI 100 Whisper (pipelines/targets/qaic/whisper.py, issue 25 item 2): one retained-state graph for the Encoder and
Decode specializations, exported from a tiny random WhisperForConditionalGeneration and run in onnxruntime on a
synthetic log-mel: the Encoder step, then Decode steps feeding the retained self- and cross-attention KV back,
against transformers fp32 on the same ids, and greedy end to end."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from pipelines.targets.qaic import whisper
from pipelines.targets.qaic.whisper import (
    OPSET,
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
    return whisper.log_mel(model.config, seed)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = tiny_whisper()
    report = export_whisper(model, tmp_path_factory.mktemp("whisper") / "model.onnx", ctx_len=CTX)
    return model, report


@pytest.mark.parametrize("case", ["WhisperForConditionalGeneration"])
def test_ort_parity_encoder_then_decode_steps_and_greedy_end_to_end(case, exported):
    model, report = exported
    assert report.architecture == case
    for seed in (0, 1):
        r = whisper_parity(model, report.path, log_mel(model, seed), START, decode_steps=8, ctx_len=CTX)
        assert r["finite"] and r["steps"] == 9
        assert r["top1_agreement"] == 1.0 and r["max_abs_logit_delta"] < 1e-4, r
        assert r["tokens_equal"], r
    a = run_ort_whisper(report.path, log_mel(model, 0), START, 4, CTX)["tokens"]
    b = run_ort_whisper(report.path, log_mel(model, 1), START, 4, CTX)["tokens"]
    assert a != b  # the decode steps read the audio (the retained cross KV), not only the tokens


def test_the_parity_prompt_is_the_one_generate_builds():
    """start, language (English), task (transcribe), no timestamps for a multilingual model; an English-only
    model has no language or task token; a config naming none starts with the start token alone."""
    from transformers import GenerationConfig

    model = tiny_whisper()
    model.generation_config = GenerationConfig(is_multilingual=True, lang_to_id={"<|en|>": 10, "<|de|>": 11},
                                               task_to_id={"transcribe": 20, "translate": 21}, no_timestamps_token_id=30)
    assert whisper.start_tokens(model) == [1, 10, 20, 30]
    model.generation_config = GenerationConfig(is_multilingual=False, no_timestamps_token_id=30)
    assert whisper.start_tokens(model) == [1, 30]
    model.generation_config = GenerationConfig()
    assert whisper.start_tokens(model) == [1]


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
    spec = specializations(1, CTX, encoder_ctx=24)["specializations"]
    assert [(s["name"], s["symbols"]["feature_len"], s["symbols"]["encoder_ctx_len"]) for s in spec] == [
        ("Encoder", "48", "24"), ("Decode", "1", "24")]
    symbols = {d.dim_param for v in list(graph.graph.input) + list(graph.graph.output)
               for d in v.type.tensor_type.shape.dim if d.dim_param}
    assert all(set(s["symbols"]) <= symbols for s in spec)


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


def test_compile_inputs_and_serving_binding_for_speech_to_text():
    """The transcribe compile (recipes/qaic-whisper-fp16.yaml): QEfficient's specializations and retained IO, the
    -retained-state command, and vllm-qaic's speech-to-text arguments."""
    import yaml

    from pipelines.targets.qaic.compile import CompileOptions, command, compile_files
    from pipelines.targets.qaic.serving import describe

    recipe = yaml.safe_load(open("recipes/qaic-whisper-fp16.yaml"))
    opts = CompileOptions.parse(recipe["options"])
    files = compile_files(2, opts)
    assert json.loads(files["compile/specializations.json"]) == {"specializations": [
        {"name": "Encoder", "symbols": {"batch_size": "1", "seq_len": "1", "encoder_ctx_len": "1500",
                                        "decoder_ctx_len": "150", "feature_len": "3000"}},
        {"name": "Decode", "symbols": {"batch_size": "1", "seq_len": "1", "encoder_ctx_len": "1500",
                                       "decoder_ctx_len": "150", "feature_len": "1"}}]}
    io = files["compile/custom_io.yaml"].decode()
    assert io.count("- IOName: ") == 17 and "- IOName: past_value_cross.1_RetainedState\n  Precision: float16" in io
    assert io.startswith("- IOName: input_features\n  Precision: float16\n")  # QEfficient: the log-mel in fp16 too
    argv = command(opts, "onnx/model.onnx")
    assert "-retained-state" in argv and "-convert-to-fp16" in argv and "-mxfp6-matmul" not in argv
    d = describe(opts, {"id": "vllm-qaic"}, "openai/whisper-tiny", False, {})
    assert d["engine_args"] == {"served_model_name": "openai/whisper-tiny", "max_model_len": 150, "max_num_seqs": 1,
                                "device_group": "0", "max_num_batched_tokens": 1500,
                                "hf_overrides": '{"max_source_positions": 1500}',
                                "limit_mm_per_prompt": '{"audio": 1}', "no_enable_prefix_caching": True}
    assert d["env"]["VLLM_QAIC_QPC_PATH"].endswith("/qpc") and "--no-enable-prefix-caching" in d["command"]
    for bad, why in (({"full_batch_size": 4}, "full_batch_size null"), ({"prefill_seq_len": 32}, "prefill_seq_len must be 1")):
        assert any(why in p for p in CompileOptions.problems({**recipe["options"], **bad}))


def test_whisper_goes_through_check_export_bundle_and_standin_compile(smollm2_dir, tmp_path):
    """A tiny random Whisper of the real encoder length (1500 positions, 3000 frames): `check --hardware qaic-ai100`
    routes it to qaic-whisper-fp16, whose build exports the one graph (ORT parity gated), writes the Encoder/Decode
    bundle (fp16 quality predicted), and the STAND-IN compile binds vllm-qaic's speech-to-text arguments."""
    from qaic_flow import run_flow
    from qaic_standin import LABEL
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    cfg = WhisperConfig(vocab_size=vocab, num_mel_bins=16, d_model=32, encoder_layers=1, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_source_positions=1500, max_target_positions=448, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, decoder_start_token_id=1, init_std=0.2)
    model_dir = tmp_path / "whisper"
    WhisperForConditionalGeneration(cfg).save_pretrained(str(model_dir))
    flow = run_flow(tmp_path, model_dir, smollm2_dir, "test-org/tiny-whisper", "qaic-whisper-fp16", "qaic-whisper-tiny",
                    {"num_cores": 2})
    assert sorted(flow.check["recipes"]) == ["qaic-export", "qaic-whisper-fp16", "qaic-whisper-tiny"]
    m = flow.export["validation"]["metrics"]
    assert flow.export["build"]["export"]["speech"] is True and m["ort_top1_agreement"] == 1.0 and m["ort_max_abs_delta"] < 1e-3
    assert flow.bundle["validation"]["metrics"]["predicted_top1"] == 1.0
    pulled = flow.pulled
    argv = pulled["serve_argv"]
    assert argv[argv.index("--max-model-len") + 1] == "150" and argv[argv.index("--max-num-seqs") + 1] == "1"
    assert argv[argv.index("--limit-mm-per-prompt") + 1] == '{"audio": 1}' and "--no-enable-prefix-caching" in argv
    assert pulled["serve_refused"] is None, pulled["serve_refused"]  # the serve policy runs what the kind wrote
    checked = json.loads((tmp_path / "served" / "qpc" / "programqpc.bin").read_bytes()[len(LABEL):])
    assert [s["name"] for s in checked["specializations"]] == ["Encoder", "Decode"]
