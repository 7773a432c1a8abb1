"""Llama 3.2 Vision (MllamaForConditionalGeneration) on AI 100 in QEfficient's dual-QPC form (vision/mllama.py,
families/mllama.py): a tiny random Mllama (gates set non-zero, so the cross-attention layer counts) exported as a
vision graph that outputs the cross layer's K/V and a language graph that reads them as retained state beside a
per-token cross_attention_mask; run in onnxruntime on a synthetic image (numpy) against transformers fp32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from test_qaic_vision import dual_compile_inputs

from pipelines.targets.qaic.compile import CompileOptions, vision_command
from pipelines.targets.qaic.vision import vision_family
from pipelines.targets.qaic.vision.export import VISION_DIR, export_vlm, load_vlm, round_language
from pipelines.targets.qaic.vision.parity import _reference, image_prompt, vlm_parity
from pipelines.targets.qaic.vision.runs import image_state

TEXT = [1, 17, 33, 90, 5, 6, 7, 40]
IMAGE_TOKEN = 255
ROWS = 2 * ((28 // 14) ** 2 + 1)  # 2 tiles of (28 / 14)^2 patches + the class row


def tiny_mllama(model_dir: Path, vocab: int = 256, image_token: int = IMAGE_TOKEN) -> Path:
    from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaTextConfig, MllamaVisionConfig

    torch.manual_seed(0)
    vision = MllamaVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                                attention_heads=4, image_size=28, patch_size=14, max_num_tiles=2,
                                intermediate_layers_indices=[0], vision_output_dim=64,
                                supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
    text = MllamaTextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=vocab, cross_attention_layers=[1],
                            max_position_embeddings=4096, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2)
    model = MllamaForConditionalGeneration(MllamaConfig(vision_config=vision, text_config=text,
                                                        image_token_index=image_token))
    with torch.no_grad():  # transformers initializes the gates at 0 (tanh 0: the image would change nothing)
        model.model.language_model.layers[1].cross_attn_attn_gate.fill_(0.8)
        model.model.language_model.layers[1].cross_attn_mlp_gate.fill_(-0.6)
    model.save_pretrained(str(model_dir))
    return model_dir


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model_dir = tiny_mllama(tmp_path_factory.mktemp("mllama") / "model")
    _arch, family = vision_family(json.loads((model_dir / "config.json").read_text()))
    model = load_vlm(model_dir)
    round_language(family, model, "float16")
    root = tmp_path_factory.mktemp("mllama-onnx")
    report, vision = export_vlm(family, model_dir, root, batch_index=True)  # streamed from the checkpoint
    return family, model, root, report, vision


def test_the_vision_graph_gives_the_cross_layers_kv_as_transformers_computes_them(exported):
    family, model, root, _report, vision = exported
    inputs = family.vision_inputs(model.config, 0)
    got = image_state(root / vision.path, inputs)
    assert list(got) == ["past_key.1", "past_value.1"] and got["past_key.1"].shape == (1, 2, ROWS, 16)
    # transformers' own path: the projected vision states through the cross layer's k_proj / k_norm / v_proj
    with torch.no_grad():
        states = model.model.vision_model(**{k: torch.from_numpy(v) for k, v in inputs.items()}).last_hidden_state
        states = model.model.multi_modal_projector(states).reshape(1, -1, 64)
        attn = model.model.language_model.layers[1].cross_attn
        k = attn.k_norm(attn.k_proj(states).view(1, -1, 2, 16).transpose(1, 2)).numpy()
        v = attn.v_proj(states).view(1, -1, 2, 16).transpose(1, 2).numpy()
    assert np.abs(got["past_key.1"] - k).max() < 1e-4 and np.abs(got["past_value.1"] - v).max() < 1e-4
    other = image_state(root / vision.path, family.vision_inputs(model.config, 1))
    assert np.abs(other["past_value.1"] - got["past_value.1"]).max() > 1e-3  # the image matters


@pytest.mark.parametrize("case", ["MllamaForConditionalGeneration"])  # the matrix's covered row (test_qaic_matrix)
def test_both_graphs_match_transformers_end_to_end(case, exported):
    family, model, root, _report, vision = exported
    assert vision.architecture == case
    r = vlm_parity(family, model, root / "onnx" / "model.onnx", root / vision.path, TEXT, decode_steps=8)
    assert r["finite"] and r["steps"] == 9 and r["vision_rows"] == ROWS == vision.vision_size
    assert r["prompt_tokens"] == len(TEXT) + 1  # ONE image token, not one per row
    assert r["vision_max_abs_delta"] < 1e-4, r
    assert r["top1_agreement"] == 1.0 and r["max_abs_logit_delta"] < 1e-3, r
    assert r["tokens_equal"], r
    second = vlm_parity(family, model, root / "onnx" / "model.onnx", root / vision.path, TEXT, decode_steps=0, seed=1)
    assert second["top1_agreement"] == 1.0 and second["max_abs_logit_delta"] < 1e-3, second


def test_a_one_tile_image_masks_the_padding_tile(exported):
    """aspect ratio 1x1: the second tile is padding (aspect_ratio_mask 0), in the vision encoder and in the
    cross-attention mask of every token after the image."""
    family, model, root, _report, vision = exported
    inputs = family.vision_inputs(model.config, 2)
    inputs["aspect_ratio_ids"][:] = 1
    inputs["aspect_ratio_mask"][0, 0] = [1, 0]
    r = vlm_parity(family, model, root / "onnx" / "model.onnx", root / vision.path, TEXT, decode_steps=4,
                   inputs=inputs)
    assert r["vision_max_abs_delta"] < 1e-4 and r["top1_agreement"] == 1.0 and r["tokens_equal"], r
    assert r["max_abs_logit_delta"] < 1e-3, r
    # the same K/V with the padding tile unmasked give other logits: the language graph reads the tile mask
    image = image_state(root / vision.path, inputs)
    prompt = image_prompt(family, model.config, TEXT)
    unmasked = {**inputs, "aspect_ratio_mask": np.ones_like(inputs["aspect_ratio_mask"])}
    masked_logits, unmasked_logits = (
        family.form.run_language(family, model.config, root / "onnx" / "model.onnx", image, feed, prompt, 0,
                                 len(prompt) + 4)["logits"][0] for feed in (inputs, unmasked))
    assert np.abs(masked_logits - unmasked_logits).max() > 1e-3


def test_text_before_the_image_token_as_transformers_masks_it(exported):
    """Tokens before the `<|image|>` token get no tile in cross_attention_mask: transformers then lets their
    cross-attention read every row unmasked and zeroes their cross MLP branch; a prefill split at the image
    token gives transformers' logits at both ends."""
    from pipelines.targets.qaic.ort import session

    family, model, root, _report, vision = exported
    inputs = family.vision_inputs(model.config, 0)
    image = image_state(root / vision.path, inputs)
    prompt = [1, 17, 33, 90, IMAGE_TOKEN, 5, 6, 7]
    ref = _reference(family, model, prompt, inputs)
    mask = family.form.token_masks(family, model.config, inputs, prompt)
    assert mask[0, :4].sum() == 0 and (mask[0, 4:] == 1).all()
    sess = session(root / "onnx" / "model.onnx")
    names = [o.name for o in sess.get_outputs()]
    state = {i.name: image.get(i.name, np.zeros((1, 2, 16, 16), np.float32)) for i in sess.get_inputs()
             if i.name.startswith("past_")}
    for lo, hi in ((0, 4), (4, len(prompt))):
        feed = {"input_ids": np.asarray([prompt[lo:hi]]), "cross_attention_mask": mask[:, lo:hi],
                "position_ids": np.arange(lo, hi)[None], "batch_index": np.zeros((1, 1), np.int64), **state}
        res = dict(zip(names, sess.run(names, feed)))
        assert np.abs(res["logits"][0, 0] - ref[hi - 1]).max() < 1e-3, (lo, hi)
        state = {k: res[f"{k}_RetainedState"] for k in state}
    assert np.array_equal(state["past_key.1"], image["past_key.1"])  # the image's K/V pass through unchanged


def test_the_graph_contract(exported):
    _family, _model, root, report, vision = exported
    lang = onnx.load(str(root / "onnx" / "model.onnx"), load_external_data=False).graph
    inits = {t.name for t in lang.initializer}
    names = [i.name for i in lang.input if i.name not in inits]
    assert names == ["input_ids", "cross_attention_mask", "position_ids", "past_key.0", "past_value.0", "past_key.1",
                     "past_value.1", "past_key.2", "past_value.2", "batch_index"]
    assert [o.name for o in lang.output] == ["logits"] + [f"past_{kv}.{i}_RetainedState" for i in range(3)
                                                          for kv in ("key", "value")]
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in lang.input}
    assert dims["cross_attention_mask"] == ["batch_size", "seq_len", "max_num_images", 2]
    assert dims["past_key.1"] == ["full_batch_size", 2, ROWS, 16]  # the image's rows, not ctx_len
    assert dims["past_key.0"] == ["full_batch_size", 2, "ctx_len", 16]
    vis = onnx.load(str(root / vision.path), load_external_data=False).graph
    assert [i.name for i in vis.input if i.name not in {t.name for t in vis.initializer}] == [
        "pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"]
    assert [o.name for o in vis.output] == ["past_key.1", "past_value.1"] == vision.outputs
    assert vision.path == f"{VISION_DIR}/model.onnx" and vision.float_inputs == ["pixel_values"]
    assert vision.symbols == {"batch_size": "1", "max_num_images": "1", "img_size": "28"} and report.layers == 3


def test_the_compile_inputs_of_the_dual_qpc(exported):
    _family, _model, _root, report, vision = exported
    info = vision.to_json()
    opts = CompileOptions.parse({"num_cores": 4, "ctx_len": 256, "prefill_seq_len": 32})
    files, specs = dual_compile_inputs(report, vision, opts)
    assert all(s["symbols"]["max_num_images"] == "1" and "vision_size" not in s["symbols"] for s in specs)
    io = files["compile/custom_io.yaml"].decode()
    listed = [line.split(":", 1)[1].strip() for line in io.splitlines() if line.startswith("- IOName:")]
    assert len(listed) == len(set(listed)) == 12  # 3 layers x key/value x input/retained, each once
    for name in ("past_key.1", "past_value.1", "past_key.1_RetainedState", "past_value.1_RetainedState"):
        assert f"- IOName: {name}\n  Precision: float16" in io  # the vision QPC writes the image's K/V in float16
    assert f"- IOName: past_key.0\n  Precision: {opts.kv_precision}" in io and "vision_embeds" not in io
    assert json.loads(files["compile/vision/specializations.json"]) == {"specializations": [
        {"name": "Vision", "symbols": {"batch_size": "1", "max_num_images": "1", "img_size": "28"}}]}
    assert files["compile/vision/custom_io.yaml"].decode().split() == [
        "-", "IOName:", "pixel_values", "Precision:", "float16", "-", "IOName:", "past_key.1", "Precision:", "float16",
        "-", "IOName:", "past_value.1", "Precision:", "float16"]
    vis = vision_command(opts, info)
    assert "-mxfp6-matmul" not in vis and "-retained-state" not in vis


def test_mllama_goes_through_check_export_bundle_and_standin_compile(smollm2_dir, tmp_path):
    """check routes a tiny Mllama to the qaic recipes; the build exports both graphs (ORT parity gated), writes the
    dual bundle (quality predicted on both QPCs), and the STAND-IN compile builds both programs."""
    from qaic_flow import run_flow
    from qaic_standin import LABEL

    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    model_dir = tiny_mllama(tmp_path / "mllama", vocab=vocab, image_token=vocab)  # as Llama 3.2: past the head
    flow = run_flow(tmp_path, model_dir, smollm2_dir, "test-org/tiny-mllama", "qaic-mxfp6", "qaic-vlm-tiny",
                    {"num_cores": 2, "ctx_len": 256, "prefill_seq_len": 32}, validation={"min_predicted_top1": 0.3})
    assert {"qaic-export", "qaic-mxfp6", "qaic-fp16", "qaic-vlm-tiny"} <= set(flow.check["recipes"]), flow.check
    export, m = flow.export, flow.export["validation"]["metrics"]
    assert export["build"]["export"]["vision"]["outputs"] == ["past_key.1", "past_value.1"]
    assert m["ort_top1_agreement"] == 1.0 and m["ort_max_abs_delta"] < 1e-3 and m["ort_vision_max_abs_delta"] < 1e-4, m
    assert {"onnx/vision/model.onnx", "onnx/vision/model.onnx.data", "onnx/model.onnx"} <= {f["path"] for f in export["files"]}
    q = flow.bundle["validation"]["mxfp6"]
    assert q["emulated"] == ["fp16 vision weights", "mxfp6 language weights", "mxint8 kv cache"] and q["positions"] > 20
    pulled, served = flow.pulled, flow.served
    language = json.loads((served / "qpc" / "programqpc.bin").read_bytes()[len(LABEL):])
    vision = json.loads((served / "qpc-vision" / "programqpc.bin").read_bytes()[len(LABEL):])
    assert [s["name"] for s in vision["specializations"]] == ["Vision"] and "-mxfp6-matmul" not in vision["flags"]
    assert language["custom_io"]["past_key.1"] == "float16" and language["custom_io"]["past_key.0"] == "mxint8"
    assert language["specializations"][0]["symbols"]["max_num_images"] == "1"
    assert pulled["env"]["VLLM_QAIC_QPC_PATH"] == f"{served}/qpc-vision:{served}/qpc"
    assert pulled["serve_refused"] is None, pulled["serve_refused"]


def test_the_text_model_alone_is_refused_and_stays_off_the_causal_lm_list(exported):
    from pipelines.core.errors import NotApplicableError
    from pipelines.targets.qaic.decoder import build_decoder
    from pipelines.targets.qaic.families import FAMILY_SPECS
    from pipelines.targets.qaic.vision.export import language_shim

    family, model, _root, _report, _vision = exported
    assert "MllamaForCausalLM" not in FAMILY_SPECS  # a text-only checkpoint is not a supported causal LM
    with pytest.raises(NotApplicableError, match="cross-attention layers"):
        build_decoder(language_shim(family, model))
