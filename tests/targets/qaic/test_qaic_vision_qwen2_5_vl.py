"""Qwen2.5-VL on AI 100 (pipelines/targets/qaic/vision/qwen2_5_vl.py): a tiny random Qwen2.5-VL (window-attention
vision tower with one full-attention block, patch merger, a Qwen2 language model with multimodal RoPE) exported as
the dual QPC's two graphs and run in onnxruntime on a synthetic image against transformers fp32: the vision rows,
the M-RoPE positions of the prompt and of decode (transformers' get_rope_index and rope_deltas), the language
graph's [4, batch, seq] position_ids, the compile inputs, the predicted quality, and the whole path check ->
export -> bundle -> STAND-IN compile -> pull."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from test_qaic_vision import TEXT, assert_end_to_end, language_io

from pipelines.targets.qaic.compile import CompileOptions, compile_files, vision_command
from pipelines.targets.qaic.vision import VISION_FAMILIES, vision_family
from pipelines.targets.qaic.vision.export import export_vlm, load_vlm, round_language
from pipelines.targets.qaic.vision.parity import image_prompt, vlm_parity
from pipelines.targets.qaic.vision.qwen2_5_vl import IMAGE_GRID_THW
from pipelines.targets.qaic.vision.runs import next_positions, run_language, run_vision

MERGED_ROWS = IMAGE_GRID_THW[0] * (IMAGE_GRID_THW[1] // 2) * (IMAGE_GRID_THW[2] // 2)  # spatial_merge_size 2


def tiny_qwen2_5_vl(model_dir: Path, vocab: int = 256, image_token: int = 255, **text_sizes) -> Path:
    """`text_sizes`: the language model's config beyond these (test_qaic_vision_gates.py: SmolLM2's sizes)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096, initializer_range=0.1,
                bos_token_id=None, eos_token_id=None,  # a random model's ids, not Qwen's vocabulary
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    text.update(text_sizes)
    # window_size 112 (8 patches of 14): the image holds several windows; block 1 attends over the whole image
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1],
                  initializer_range=0.1, out_hidden_size=text["hidden_size"])
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=image_token,
                           video_token_id=image_token - 1, vision_start_token_id=image_token - 2,
                           vision_end_token_id=image_token - 3)
    Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(str(model_dir))
    return model_dir


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model_dir = tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl") / "model")
    _arch, family = vision_family(json.loads((model_dir / "config.json").read_text()))
    model = load_vlm(model_dir)
    round_language(family, model, "float16")
    root = tmp_path_factory.mktemp("qwen2_5_vl-onnx")
    report, vision = export_vlm(family, model_dir, root, batch_index=True)  # streamed from the checkpoint
    return family, model, root, report, vision, model_dir


@pytest.mark.parametrize("case", ["Qwen2_5_VLForConditionalGeneration"])
def test_both_graphs_match_transformers_end_to_end_on_a_synthetic_image(case, exported):
    family, model, root, _report, vision, _dir = exported
    assert vision.architecture == case
    r = vlm_parity(family, model, root / "onnx" / "model.onnx", root / vision.path, TEXT, decode_steps=8)
    assert MERGED_ROWS == vision.vision_size
    assert_end_to_end(r, MERGED_ROWS)
    other = family.vision_inputs(model.config, 1)  # a second image changes what the model says
    prompt = image_prompt(family, model.config, TEXT)
    positions = family.positions(model.config, prompt, other)
    logits = [run_language(root / "onnx" / "model.onnx", run_vision(root / vision.path, image), prompt, 0,
                           len(prompt) + 4, positions)["logits"][0]
              for image in (family.vision_inputs(model.config, 0), other)]
    assert np.abs(logits[0] - logits[1]).max() > 1e-3


def test_the_positions_are_transformers_own_for_the_prompt_and_for_decode(exported):
    """The prompt's [4, 1, seq] rows are what transformers' generate builds (text row, then get_rope_index's
    t/h/w), and decode continues them as generate does (cache position + rope_deltas); the image rows carry the
    grid (h and w differ here, so a transposed grid would show)."""
    family, model, _root, _report, _vision, _dir = exported
    prompt = image_prompt(family, model.config, TEXT)
    ours = family.positions(model.config, prompt, family.vision_inputs(model.config, 0))
    ids = torch.tensor([prompt])
    kwargs = {"input_ids": ids, "image_grid_thw": torch.tensor([IMAGE_GRID_THW]),
              **{k: torch.from_numpy(v) for k, v in family.reference_token_kwargs(model.config, ids.numpy()).items()}}
    theirs = model._prepare_position_ids_for_generation(ids, kwargs).numpy()
    assert ours.shape == (4, 1, len(prompt)) and np.array_equal(ours, theirs)
    _t, h, w = IMAGE_GRID_THW
    image = ours[1:, 0, 1:1 + MERGED_ROWS]
    assert image[1].max() - image[1].min() == h // 2 - 1 and image[2].max() - image[2].min() == w // 2 - 1
    deltas = model.model.rope_deltas.numpy()  # generate's: max + 1 - prompt length
    step = next_positions(ours)
    assert step.shape == (4, 1, 1) and step[0, 0, 0] == len(prompt)
    assert (step[1:, 0, 0] == len(prompt) + deltas[0, 0]).all()
    assert np.array_equal(next_positions(step)[:, 0, 0], step[:, 0, 0] + 1)


def test_the_graph_contract(exported):
    _family, _model, root, report, vision, _dir = exported
    names, outputs, dims = language_io(root)
    assert names[:4] == ["input_ids", "vision_embeds", "position_ids", "image_idx"] and names[-1] == "batch_index"
    assert outputs[:3] == ["logits", "vision_embeds_RetainedState", "image_idx_output"]
    assert dims["position_ids"] == [4, "batch_size", "seq_len"]  # row 0 text, rows 1-3 t/h/w (QEfficient's)
    assert dims["input_ids"] == ["batch_size", "seq_len"]
    assert dims["vision_embeds"] == ["vision_batch_size", "vision_size", 64]
    vis = onnx.load(str(root / vision.path), load_external_data=False).graph
    assert [i.name for i in vis.input if i.name not in {t.name for t in vis.initializer}] == ["pixel_values"]
    assert [o.name for o in vis.output] == ["vision_embeds"]
    patches = IMAGE_GRID_THW[0] * IMAGE_GRID_THW[1] * IMAGE_GRID_THW[2]
    assert vision.symbols == {"batch_size": "1", "grid_height": str(patches), "grid_width": str(3 * 2 * 14 * 14)}
    assert vision.float_inputs == ["pixel_values"] and report.layers == 2


def test_the_compile_inputs_of_the_dual_qpc(exported):
    _family, _model, _root, report, vision, _dir = exported
    info = vision.to_json()
    opts = CompileOptions.parse({"num_cores": 4, "ctx_len": 512, "prefill_seq_len": 32})
    files = compile_files(report.layers, opts, "1.22", vision=info)
    specs = json.loads(files["compile/specializations.json"])["specializations"]
    assert [s["name"] for s in specs] == ["Prefill", "Decode"]
    assert [s["symbols"]["seq_len"] for s in specs] == ["32", "1"]  # position_ids [4, batch_size, seq_len]
    assert all(s["symbols"]["vision_size"] == str(MERGED_ROWS) and s["symbols"]["ctx_len"] == "512" for s in specs)
    assert json.loads(files["compile/vision/specializations.json"]) == {
        "specializations": [{"name": "Vision", "symbols": vision.symbols}]}
    assert files["compile/vision/custom_io.yaml"].decode().split() == [
        "-", "IOName:", "pixel_values", "Precision:", "float16", "-", "IOName:", "vision_embeds", "Precision:", "float16"]
    assert "-mxfp6-matmul" not in vision_command(opts, info)


def test_the_predicted_quality_runs_the_language_model_at_its_mrope_positions(exported):
    from pipelines.targets.qaic.vision.quality import predict_vlm

    family, _model, _root, _report, _vision, model_dir = exported
    q = predict_vlm(family, model_dir, sorted(model_dir.glob("*.safetensors")), TEXT, mxfp6=False, mxint8=False)
    assert q["finite"] and q["positions"] == len(TEXT) - 1
    assert q["top1"] == 1.0 and q["max_abs_logit_delta"] < 0.05, q  # fp16 weights and KV only


def test_the_family_is_declared():
    assert VISION_FAMILIES["Qwen2_5_VLForConditionalGeneration"].positions is not None


def test_qwen2_5_vl_goes_through_check_export_bundle_and_standin_compile(smollm2_dir, tmp_path):
    """check routes a tiny Qwen2.5-VL to the qaic recipes; the build exports both graphs (ORT parity gated, at the
    M-RoPE positions), writes the dual bundle (quality predicted on both QPCs), and the STAND-IN compile builds both
    programs and binds vllm-qaic to `<vision_qpc>:<language_qpc>`."""
    from qaic_flow import run_flow
    from qaic_standin import LABEL

    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    model_dir = tiny_qwen2_5_vl(tmp_path / "qwen2_5_vl", vocab=vocab + 4, image_token=vocab + 3)
    flow = run_flow(tmp_path, model_dir, smollm2_dir, "test-org/tiny-qwen2_5_vl", "qaic-mxfp6", "qaic-vlm-tiny",
                    {"num_cores": 2, "ctx_len": 512, "prefill_seq_len": 32}, validation={"min_predicted_top1": 0.3})
    assert {"qaic-export", "qaic-mxfp6", "qaic-vlm-tiny"} <= set(flow.check["recipes"]), flow.check
    export, m = flow.export, flow.export["validation"]["metrics"]
    assert export["build"]["export"]["vision"]["vision_size"] == MERGED_ROWS
    assert m["ort_top1_agreement"] == 1.0 and m["ort_max_abs_delta"] < 1e-3 and m["ort_vision_max_abs_delta"] < 1e-4, m
    q = flow.bundle["validation"]["mxfp6"]
    assert q["emulated"] == ["fp16 vision weights", "mxfp6 language weights", "mxint8 kv cache"] and q["positions"] > 20
    language = json.loads((flow.served / "qpc" / "programqpc.bin").read_bytes()[len(LABEL):])
    vision = json.loads((flow.served / "qpc-vision" / "programqpc.bin").read_bytes()[len(LABEL):])
    assert [s["name"] for s in vision["specializations"]] == ["Vision"] and "-mxfp6-matmul" not in vision["flags"]
    assert language["specializations"][0]["symbols"]["vision_size"] == str(MERGED_ROWS)
    assert flow.pulled["serve_refused"] is None, flow.pulled["serve_refused"]


def test_the_single_qpc_graph_runs_at_the_mrope_positions(exported, tmp_path):
    """kv_offload: false: the composed graph (vision/single.py) with position_ids [4, batch, seq], against
    transformers."""
    from test_qaic_vision import single_qpc_parity

    family, model, root, _report, vision, _dir = exported
    r = single_qpc_parity(family, model, root, vision, tmp_path)
    assert r["inputs"][:2] == ["input_ids", "pixel_values"] and r["outputs"][1] == "pixel_values_RetainedState"
    assert r["tokens"] == r["reference_tokens"] and r["max_abs_logit_delta"] < 1e-3, r
