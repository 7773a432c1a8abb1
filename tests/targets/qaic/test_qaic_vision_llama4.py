"""AI 100 vision-language export of Llama 4 (vision/llama4.py, the decoder of families/llama4.py): a tiny random
Llama4ForConditionalGeneration (vision hidden 32, 2 layers, tiles of 56 pixels in patches of 14, pixel shuffle
0.5: 4 rows per tile; text hidden 64, 4 layers covering RoPE/NoPE x MoE/dense, a chunk of 16 positions, temperature
tuning active) exported as both graphs and run end to end in onnxruntime against transformers' whole model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from test_qaic_vision import TEXT, assert_end_to_end, language_io

from pipelines.targets.qaic.vision import VISION_FAMILIES, vision_family
from pipelines.targets.qaic.vision.export import export_vlm, load_vlm, round_language
from pipelines.targets.qaic.vision.llama4 import MAX_NUM_TILES
from pipelines.targets.qaic.vision.parity import image_prompt, vlm_parity
from pipelines.targets.qaic.vision.runs import run_language, run_vision

ARCH = "Llama4ForConditionalGeneration"
CHUNK = 16


def tiny_llama4_vlm(model_dir: Path, vocab: int = 256, image_token: int = 255) -> Path:
    from transformers import Llama4Config, Llama4ForConditionalGeneration, Llama4TextConfig, Llama4VisionConfig

    torch.manual_seed(0)
    text = Llama4TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_local_experts=4, num_experts_per_tok=1, moe_layers=[0, 3], no_rope_layer_interval=2,
                            attention_chunk_size=CHUNK, floor_scale=16, attn_scale=0.5, max_position_embeddings=4096,
                            initializer_range=0.1, pad_token_id=0)
    # the adapter's MLP reads the pixel-shuffled rows (4 x hidden) as `intermediate_size`; projector dims agree
    vision = Llama4VisionConfig(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                image_size=56, patch_size=14, pixel_shuffle_ratio=0.5, projector_input_dim=48,
                                projector_output_dim=48, vision_output_dim=48)
    cfg = Llama4Config(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=image_token)
    Llama4ForConditionalGeneration(cfg).save_pretrained(str(model_dir))
    return model_dir


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model_dir = tiny_llama4_vlm(tmp_path_factory.mktemp("llama4") / "model")
    _arch, family = vision_family(json.loads((model_dir / "config.json").read_text()))
    model = load_vlm(model_dir)
    round_language(family, model, "float16")
    root = tmp_path_factory.mktemp("llama4-onnx")
    report, vision = export_vlm(family, model_dir, root, batch_index=True)  # streamed from the checkpoint
    return family, model, root, report, vision


@pytest.mark.parametrize("case", [ARCH])  # the matrix names this test by its architecture, as test_qaic_vision's
def test_both_graphs_match_transformers_end_to_end_on_a_synthetic_image(case, exported):
    """transformers runs the whole model on the same 17 tiles (its own vision tower with complex RoPE, pixel
    shuffle, placeholder count check, chunked and NoPE layers): the prompt of 76 tokens spans 5 chunks."""
    family, model, root, _report, vision = exported
    assert vision.architecture == case and vision.vision_size == MAX_NUM_TILES * 4
    r = vlm_parity(family, model, root / "onnx" / "model.onnx", root / vision.path, TEXT, decode_steps=8)
    print("llama4 vlm", {k: v for k, v in r.items() if k not in ("tokens", "reference_tokens")})
    assert_end_to_end(r, vision.vision_size)
    assert r["prompt_tokens"] > 4 * CHUNK and len(set(r["tokens"])) > 1, r
    other = family.vision_inputs(model.config, 1)  # a second image changes what the model says
    prompt = image_prompt(family, model.config, TEXT)
    lang = root / "onnx" / "model.onnx"
    first = run_language(lang, run_vision(root / vision.path, family.vision_inputs(model.config, 0)), prompt, 0,
                         len(prompt) + 4)["logits"][0]
    second = run_language(lang, run_vision(root / vision.path, other), prompt, 0, len(prompt) + 4)["logits"][0]
    assert np.abs(first - second).max() > 1e-3


def test_the_real_valued_vision_module_equals_transformers_complex_rope_tower(exported):
    """The vision module's own attention (real cos / sin) against transformers' vision model + projector as
    Llama4ForConditionalGeneration.forward runs them."""
    family, model, _root, _report, _vision = exported
    pixel_values = torch.from_numpy(family.vision_inputs(model.config, 2)["pixel_values"])
    with torch.no_grad():
        feats = model.get_image_features(pixel_values=pixel_values, return_dict=True).last_hidden_state
        ref = model.multi_modal_projector(feats.reshape(-1, feats.shape[-1]))
        got = family.vision_module(model)(pixel_values)
    assert got.shape == (1, *ref.shape) and float((got[0] - ref).abs().max()) < 1e-5


def test_each_tile_gives_its_own_rows_in_order(exported):
    """Changing one tile changes only that tile's rows of vision_embeds (tile-major order, as transformers
    flattens them before the projector)."""
    family, model, root, _report, vision = exported
    base = family.vision_inputs(model.config, 0)
    changed = {"pixel_values": base["pixel_values"].copy()}
    changed["pixel_values"][5] = family.vision_inputs(model.config, 7)["pixel_values"][5]
    a, b = run_vision(root / vision.path, base), run_vision(root / vision.path, changed)
    differs = np.abs(a - b).max(axis=-1)[0] > 1e-6  # [rows]
    assert differs.reshape(MAX_NUM_TILES, -1).any(axis=1).tolist() == [t == 5 for t in range(MAX_NUM_TILES)]


def test_the_graph_contract_and_symbols(exported):
    _family, _model, root, report, vision = exported
    vis = onnx.load(str(root / vision.path), load_external_data=False).graph
    [pixel] = [i for i in vis.input if i.name not in {t.name for t in vis.initializer}]
    dims = [d.dim_param or d.dim_value for d in pixel.type.tensor_type.shape.dim]
    assert pixel.name == "pixel_values" and dims == ["max_num_tiles", 3, "img_size", "img_size"]
    assert [o.name for o in vis.output] == ["vision_embeds"]
    assert vision.symbols == {"batch_size": "1", "max_num_tiles": str(MAX_NUM_TILES), "img_size": "56"}
    assert set(vision.symbols) - {"batch_size"} <= {d for d in dims if isinstance(d, str)}  # the graph's own axes
    assert vision.float_inputs == ["pixel_values"] and vision.image_token_id == 255
    names, outputs, _dims = language_io(root)
    assert outputs[:3] == ["logits", "vision_embeds_RetainedState", "image_idx_output"]
    assert names[:4] == ["input_ids", "vision_embeds", "position_ids", "image_idx"] and names[-1] == "batch_index"
    assert report.layers == 4 and report.architecture == "Llama4ForCausalLM"
    assert ARCH in VISION_FAMILIES


def test_the_single_qpc_graph_composed_from_both_matches_transformers(exported, tmp_path):
    """kv_offload: false (QEfficient compiles Llama 4 so too): the composed graph, the 17 tiles kept as device
    state, against transformers' whole model over 6 decode steps."""
    from pipelines.targets.qaic.vision.export import VISION_DIR
    from pipelines.targets.qaic.vision.parity import _reference
    from pipelines.targets.qaic.vision.single import SINGLE_ONNX, run_single, write_single

    family, model, root, _report, vision = exported
    assert vision.single_qpc
    for rel in ("onnx/model.onnx.data", f"{VISION_DIR}/model.onnx.data"):  # the bundle links the export's data
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        os.link(root / rel, tmp_path / rel)
    assert write_single(root, vision.to_json(), tmp_path) == SINGLE_ONNX
    inputs = family.vision_inputs(model.config, 0)
    prompt = image_prompt(family, model.config, TEXT)
    got = run_single(tmp_path / SINGLE_ONNX, inputs, prompt, 6, len(prompt) + 16)
    ref = _reference(family, model, prompt + got["tokens"][:-1], inputs)[len(prompt) - 1:]
    assert len(ref) == len(got["logits"]) == 7
    assert [int(r.argmax()) for r in ref] == got["tokens"]
    assert max(float(np.abs(r - g).max()) for r, g in zip(ref, got["logits"])) < 1e-3


def test_llama4_goes_through_check_export_bundle_and_standin_compile(smollm2_dir, tmp_path):
    """check routes a tiny Llama 4 to the qaic recipes; the build exports both graphs (ORT parity gated), the
    dual bundle is written and the STAND-IN compiler builds both programs with the vision graph's own symbols."""
    from qaic_flow import run_flow
    from qaic_standin import LABEL

    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    model_dir = tiny_llama4_vlm(tmp_path / "vlm", vocab=vocab + 1, image_token=vocab)
    family = VISION_FAMILIES[ARCH]
    config = load_vlm(model_dir).config
    flow = run_flow(tmp_path, model_dir, smollm2_dir, "test-org/tiny-llama4", "qaic-mxfp6", "qaic-vlm-tiny",
                    {"num_cores": 2, "ctx_len": 256, "prefill_seq_len": 32}, validation={"min_predicted_top1": 0.3})
    assert {"qaic-export", "qaic-mxfp6", "qaic-fp16", "qaic-vlm-tiny"} <= set(flow.check["recipes"]), flow.check
    m = flow.export["validation"]["metrics"]
    assert flow.export["build"]["export"]["vision"]["vision_size"] == family.vision_size(config) == 68
    assert m["ort_top1_agreement"] == 1.0 and m["ort_max_abs_delta"] < 1e-3 and m["ort_vision_max_abs_delta"] < 1e-4, m
    served = flow.served
    language = json.loads((served / "qpc" / "programqpc.bin").read_bytes()[len(LABEL):])
    vision = json.loads((served / "qpc-vision" / "programqpc.bin").read_bytes()[len(LABEL):])
    assert vision["specializations"][0]["symbols"] == {"batch_size": "1", "max_num_tiles": "17", "img_size": "56"}
    assert language["specializations"][0]["symbols"]["vision_size"] == "68"
    assert flow.pulled["serve_refused"] is None, flow.pulled["serve_refused"]
