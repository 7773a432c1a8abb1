"""Qwen3-VL and Qwen3-VL-MoE on AI 100 (pipelines/targets/qaic/vision/qwen3_vl.py, qwen3_vl_moe.py): tiny random
models (a full-attention vision tower with interpolated position embeddings and two DeepStack levels; a Qwen3 or
Qwen3-MoE language model with interleaved multimodal RoPE) exported as the dual QPC's two graphs - the vision
graph giving `vision_embeds` and `deepstack_features`, the language graph taking both (QEfficient's Qwen3-VL
contract) - and run in onnxruntime on a synthetic image against transformers fp32; the M-RoPE positions, an image
split over two prefill chunks, the compile inputs, the predicted quality, and the whole path with the STAND-IN
compiler."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from test_qaic_vision import TEXT, assert_end_to_end

from pipelines.targets.qaic.compile import CompileOptions, compile_files
from pipelines.targets.qaic.vision import vision_family
from pipelines.targets.qaic.vision.export import export_vlm, load_vlm, round_language
from pipelines.targets.qaic.vision.parity import image_prompt, vlm_parity
from pipelines.targets.qaic.vision.qwen3_vl import IMAGE_GRID_THW
from pipelines.targets.qaic.vision.runs import image_state, run_language

MERGED_ROWS = IMAGE_GRID_THW[0] * (IMAGE_GRID_THW[1] // 2) * (IMAGE_GRID_THW[2] // 2)  # spatial_merge_size 2
LEVELS = 2  # deepstack_visual_indexes of the tiny tower
CASES = ["Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"]


def tiny_qwen3_vl(model_dir: Path, arch: str = CASES[0], vocab: int = 256, image_token: int = 255,
                  **text_sizes) -> Path:
    """`text_sizes`: the language model's config beyond these (test_qaic_vision_gates.py: SmolLM2's sizes)."""
    import transformers

    torch.manual_seed(0)
    moe = arch == CASES[1]
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, head_dim=16,
                num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096, initializer_range=0.1,
                bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    text.update(text_sizes)
    if moe:  # layer 1 keeps a dense MLP
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=text["hidden_size"],
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0, 1], initializer_range=0.1)
    prefix = "Qwen3VLMoe" if moe else "Qwen3VL"
    cfg = getattr(transformers, f"{prefix}Config")(
        text_config=text, vision_config=vision, image_token_id=image_token, video_token_id=image_token - 1,
        vision_start_token_id=image_token - 2, vision_end_token_id=image_token - 3)
    getattr(transformers, f"{prefix}ForConditionalGeneration")(cfg).save_pretrained(str(model_dir))
    return model_dir


@pytest.fixture(scope="module", params=CASES)
def exported(request, tmp_path_factory):
    model_dir = tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl") / "model", request.param)
    _arch, family = vision_family(json.loads((model_dir / "config.json").read_text()))
    model = load_vlm(model_dir)
    round_language(family, model, "float16")
    root = tmp_path_factory.mktemp("qwen3_vl-onnx")
    report, vision = export_vlm(family, model_dir, root, batch_index=True)  # streamed from the checkpoint
    return request.param, family, model, root, report, vision, model_dir


def test_both_graphs_match_transformers_end_to_end_on_a_synthetic_image(exported):
    """vision_max_abs_delta covers vision_embeds and every DeepStack level; the logits, the DeepStack additions."""
    arch, family, model, root, _report, vision, _dir = exported
    assert vision.architecture == arch and vision.outputs == ["vision_embeds", "deepstack_features"]
    r = vlm_parity(family, model, root / "onnx" / "model.onnx", root / vision.path, TEXT, decode_steps=8)
    assert MERGED_ROWS == vision.vision_size
    assert_end_to_end(r, MERGED_ROWS)


def test_the_positions_are_transformers_own(exported):
    _arch, family, model, _root, _report, _vision, _dir = exported
    prompt = image_prompt(family, model.config, TEXT)
    ours = family.positions(model.config, prompt, family.vision_inputs(model.config, 0))
    ids = torch.tensor([prompt])
    kwargs = {"input_ids": ids, "image_grid_thw": torch.tensor([IMAGE_GRID_THW]),
              **{k: torch.from_numpy(v) for k, v in family.reference_token_kwargs(model.config, ids.numpy()).items()}}
    assert np.array_equal(ours, model._prepare_position_ids_for_generation(ids, kwargs).numpy())


def test_an_image_split_over_two_prefill_chunks_gives_the_same_logits(exported):
    """The DeepStack rows follow image_idx into the next chunk as the vision_embeds rows do."""
    from pipelines.targets.qaic.ort import _empty_state, session

    _arch, family, model, root, _report, vision, _dir = exported
    inputs = family.vision_inputs(model.config, 0)
    state_in = image_state(root / vision.path, inputs)
    prompt = image_prompt(family, model.config, TEXT)
    positions = family.positions(model.config, prompt, inputs)
    onnx_path = root / "onnx" / "model.onnx"
    whole = run_language(onnx_path, state_in, prompt, 0, len(prompt) + 4, positions)["logits"][0]
    sess = session(onnx_path)
    state = _empty_state(sess, 1, len(prompt) + 4)
    names = [o.name for o in sess.get_outputs()]
    image = {**state_in, "image_idx": np.zeros((1, 1), np.int64)}
    for lo, hi in ((0, 100), (100, len(prompt))):  # the split falls inside the image rows
        feed = {"input_ids": np.asarray([prompt[lo:hi]]), "position_ids": positions[..., lo:hi],
                "batch_index": np.zeros((1, 1), np.int64), **image, **state}
        res = dict(zip(names, sess.run(names, feed)))
        state = {k: res[f"{k}_RetainedState"] for k in state}
        image = {k: res[f"{k}_RetainedState"] for k in state_in} | {"image_idx": res["image_idx_output"]}
    assert int(image["image_idx"][0, 0]) == MERGED_ROWS
    assert np.abs(res["logits"][0, 0] - whole).max() < 1e-4


def test_the_graph_contract_and_compile_inputs(exported):
    _arch, _family, _model, root, report, vision, _dir = exported
    lang = onnx.load(str(root / "onnx" / "model.onnx"), load_external_data=False).graph
    inits = {t.name for t in lang.initializer}
    names = [i.name for i in lang.input if i.name not in inits]
    assert names[:5] == ["input_ids", "vision_embeds", "deepstack_features", "position_ids", "image_idx"]
    assert [o.name for o in lang.output][:4] == ["logits", "vision_embeds_RetainedState",
                                                 "deepstack_features_RetainedState", "image_idx_output"]
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in lang.input}
    assert dims["deepstack_features"] == [LEVELS, "vision_batch_size", "vision_size", 64]
    assert dims["position_ids"] == [4, "batch_size", "seq_len"]
    vis = onnx.load(str(root / vision.path), load_external_data=False).graph
    assert [o.name for o in vis.output] == ["vision_embeds", "deepstack_features"]
    info = vision.to_json()
    files = compile_files(report.layers, CompileOptions.parse({"num_cores": 4, "ctx_len": 512}), "1.22", vision=info)
    io = files["compile/custom_io.yaml"].decode()
    for name in ("vision_embeds", "deepstack_features"):
        for suffix in ("", "_RetainedState"):
            assert f"- IOName: {name}{suffix}\n  Precision: float16" in io
    assert files["compile/vision/custom_io.yaml"].decode().split()[-4:] == [
        "IOName:", "deepstack_features", "Precision:", "float16"]
    specs = json.loads(files["compile/specializations.json"])["specializations"]
    assert all(s["symbols"]["vision_size"] == str(MERGED_ROWS) for s in specs)


def test_the_predicted_quality_feeds_the_deepstack_features(exported):
    from pipelines.targets.qaic.vision.quality import predict_vlm

    _arch, family, _model, _root, _report, _vision, model_dir = exported
    q = predict_vlm(family, model_dir, sorted(model_dir.glob("*.safetensors")), TEXT, mxfp6=False, mxint8=False)
    assert q["finite"] and q["positions"] == len(TEXT) - 1
    assert q["top1"] == 1.0 and q["max_abs_logit_delta"] < 0.05, q  # fp16 weights and KV only


def test_qwen3_vl_goes_through_check_export_bundle_and_standin_compile(smollm2_dir, tmp_path):
    """The whole path with the DeepStack state: both graphs exported and ORT-parity gated, the dual bundle, the
    STAND-IN compile of both programs (deepstack_features in both custom IO lists)."""
    from qaic_flow import run_flow
    from qaic_standin import LABEL

    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    model_dir = tiny_qwen3_vl(tmp_path / "qwen3_vl", vocab=vocab + 4, image_token=vocab + 3)
    flow = run_flow(tmp_path, model_dir, smollm2_dir, "test-org/tiny-qwen3_vl", "qaic-mxfp6", "qaic-vlm-tiny",
                    {"num_cores": 2, "ctx_len": 512, "prefill_seq_len": 32}, validation={"min_predicted_top1": 0.3})
    export, m = flow.export, flow.export["validation"]["metrics"]
    assert export["build"]["export"]["vision"]["outputs"] == ["vision_embeds", "deepstack_features"]
    assert m["ort_top1_agreement"] == 1.0 and m["ort_max_abs_delta"] < 1e-3 and m["ort_vision_max_abs_delta"] < 1e-4, m
    language = json.loads((flow.served / "qpc" / "programqpc.bin").read_bytes()[len(LABEL):])
    vision = json.loads((flow.served / "qpc-vision" / "programqpc.bin").read_bytes()[len(LABEL):])
    assert language["custom_io"]["deepstack_features_RetainedState"] == "float16"
    assert vision["custom_io"]["deepstack_features"] == "float16"
    assert flow.pulled["serve_refused"] is None, flow.pulled["serve_refused"]


def test_the_single_qpc_graph_keeps_the_deepstack_features(exported, tmp_path):
    """kv_offload: false on Qwen3-VL: the composed graph feeds the tower's DeepStack features to the language
    layers too (QEfficient's single form drops them), against transformers; the MoE is dual only."""
    from test_qaic_vision import single_qpc_parity

    from pipelines.targets.qaic.compile import CompileOptions
    from pipelines.targets.qaic.vision.compile import form_problem

    case, family, model, root, _report, vision, _dir = exported
    opts = CompileOptions.parse({"full_batch_size": None, "kv_offload": False})
    if not family.single_qpc:
        assert "dual QPC only" in form_problem(vision.to_json(), opts)
        return
    r = single_qpc_parity(family, model, root, vision, tmp_path)
    assert "deepstack_features" not in r["inputs"] + r["outputs"] and "pixel_values_RetainedState" in r["outputs"]
    assert r["tokens"] == r["reference_tokens"] and r["max_abs_logit_delta"] < 1e-3, r
