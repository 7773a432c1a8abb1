"""GGUF of the language models of vision-language models: LLaVA (llama), Qwen2-VL / Qwen2.5-VL (qwen2vl), Qwen3-VL
(qwen3vl) and Gemma 3 (gemma3), each a wrapper of a text family (families/llava.py, qwen2vl.py, qwen3vl.py,
gemma3_vlm.py), on tiny random models: converted to f16 and q8_0 and validated in llama.cpp against transformers
fp32 (`gguf_family_check.check_family`; the reference is the whole VLM run on the token ids), f16 tensors
byte-identical to llama.cpp's own converter, the streamed Q4_K_M, the keys of each wrapper, negative controls, the
checkpoint layouts, and one-line refusals.

The layouts: transformers 5.23 saves LLaVA and Gemma 3 as released (`language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.*`, `multi_modal_projector.*`), Qwen2.5-VL as released (the language
model at the top level, `visual.*`), Qwen3-VL as released (`model.language_model.*`, `model.visual.*`, `lm_head.*`).
Each of the first three is also rewritten to transformers 5's own nested layout (`model.language_model.*`,
`model.vision_tower.*` ...), which converts to the same tensors and validates the same.

On text alone M-RoPE's three positions are equal, so its sections cannot show in the parity numbers: llama.cpp
refuses a qwen2vl / qwen3vl file without them instead (the negative control). Qwen3-VL's text config ties its
embeddings while the outer config does not, as transformers 5 saves a Qwen3-VL-MoE: transformers ties by the outer
value, so the head is the checkpoint's own (dropping it is the negative control).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from factories import SMALL_BPE_VOCAB, copy_model, make_causal_lm, rewrite_safetensors
from gguf_family_check import (
    assert_refused,
    assert_same_tensors_as_llamacpp,
    check_family,
    check_kquant,
    convert_and_validate,
    convert_only,
    field,
    tensors,
)
from gguf_reader import FastGGUFReader

from pipelines.core.errors import ModelFormatError
from pipelines.targets.gguf import convert as convert_mod
from pipelines.targets.gguf.families import family_for
from pipelines.targets.gguf.families.spec import R

VOCAB = SMALL_BPE_VOCAB  # SmolLM2's tokenizer cut to 2,048 tokens (gguf_family_check)
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15, bos_token_id=1, eos_token_id=2)
IMAGE_TOKENS = dict(image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3,
                    vision_end_token_id=VOCAB - 4)
CLIP = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, image_size=56, patch_size=14, projection_dim=32, hidden_act="quick_gelu")
SIGLIP = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, image_size=56, patch_size=14, vision_use_head=False)
# Vision towers of at least 3 blocks: llama.cpp's converter maps a merger's `mlp.2` through its block table.
# Qwen2.5-VL: windows of 56 pixels (2 x 2 merged patches), full attention on every 2nd block (n_wa_pattern 2).
QWEN25_VISION = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1, 3])
QWEN2_VISION = dict(depth=3, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2)
# Qwen3-VL: an 8 x 8 learned position grid (128 pixels at patch 16), DeepStack mergers on blocks 0 and 1
QWEN3_VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                    deepstack_visual_indexes=[0, 1])
# what llama.cpp's projector converter reads besides the config (test_gguf_mmproj.py); harmless for the text model
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
PREPROCESSORS = {
    "llava": {"image_processor_type": "CLIPImageProcessor", "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
              "size": {"shortest_edge": 56}, "crop_size": {"height": 56, "width": 56}, "do_center_crop": True,
              "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
              "do_convert_rgb": True, "resample": 3},
    "qwen2_5_vl": {"image_processor_type": "Qwen2VLImageProcessor", "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
                   "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 3136,
                   "max_pixels": 12845056},
    "qwen3_vl": {"image_processor_type": "Qwen2VLImageProcessor", "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                 "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 4096,
                 "max_pixels": 16777216},
    "gemma3_vlm": {"image_processor_type": "Gemma3ImageProcessor", "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                   "size": {"height": 56, "width": 56}, "image_seq_length": 4, "do_resize": True, "do_rescale": True,
                   "rescale_factor": 1 / 255, "do_normalize": True, "resample": 2},
}
PREPROCESSORS["qwen2_vl"] = PREPROCESSORS["qwen2_5_vl"]
PREPROCESSORS["qwen3_vl_moe"] = PREPROCESSORS["qwen3_vl"]

# name: (config class, model class, config, gguf arch)
CASES = {
    # llava-1.5: a Llama decoder (untied), a CLIP tower whose second-to-last layer feeds the projector
    "llava": ("LlavaConfig", "LlavaForConditionalGeneration",
              dict(text_config=dict(TEXT, model_type="llama"), vision_config=CLIP, image_token_index=VOCAB - 1,
                   vision_feature_layer=-2, tie_word_embeddings=False), "llama"),
    # Qwen2.5-VL: Qwen2 (q/k/v biases) with M-RoPE sections [2, 3, 3] of head_dim 16, as released ("mrope")
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                   dict(text_config=dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                "mrope_section": [2, 3, 3]}),
                        vision_config=QWEN25_VISION, tie_word_embeddings=False, **IMAGE_TOKENS), "qwen2vl"),
    # Qwen3-VL: head_dim 32 (hidden 64 / 4 heads is 16), interleaved sections [4, 6, 6], two DeepStack levels;
    # the text config ties, the outer config does not (transformers 5 unties: the head is the checkpoint's)
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                 dict(text_config=dict(TEXT, head_dim=32, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                        "mrope_section": [4, 6, 6], "mrope_interleaved": True}),
                      vision_config=QWEN3_VISION, tie_word_embeddings=False, **IMAGE_TOKENS), "qwen3vl"),
    # Gemma 3: layer 0 slides (window 16, shorter than every parity prompt), layer 1 is global; tied by default
    "gemma3_vlm": ("Gemma3Config", "Gemma3ForConditionalGeneration",
                   dict(text_config=dict(TEXT, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                                         layer_types=["sliding_attention", "full_attention"]),
                        vision_config=SIGLIP, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
                        boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3), "gemma3"),
    # Qwen3-VL-MoE: 4 experts of width 96 (whole q8_0 blocks), top-2, weights 0.1 and routers scaled 4x (decisive
    # routing, as in test_gguf_families_moe.py); the experts fused, saved by transformers 5 as [E, 2I, H] / [E, H, I]
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration",
                     dict(text_config=dict(TEXT, head_dim=32, initializer_range=0.1, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=96,
                                           rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                            "mrope_section": [4, 6, 6], "mrope_interleaved": True}),
                          vision_config=QWEN3_VISION, tie_word_embeddings=False, **IMAGE_TOKENS), "qwen3vlmoe"),
    # Qwen2-VL: the same language model as Qwen2.5-VL (byte identity only)
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
                 dict(text_config=dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                              "mrope_section": [2, 3, 3]}),
                      vision_config=QWEN2_VISION, tie_word_embeddings=False, **IMAGE_TOKENS), "qwen2vl"),
}
VALIDATED = ["llava", "qwen2_5_vl", "qwen3_vl", "gemma3_vlm", "qwen3_vl_moe"]


def build_vlm(name: str, dest: Path, tokenizer_dir: Path, **text) -> Path:
    """A tiny random VLM of a case (`text`: text config changes), saved by transformers (the released layout) with
    the preprocessor config. Gemma 3's input projection, which transformers initializes to zeros, is randomized."""
    cfg_cls, model_cls, params, _ = CASES[name]
    params = {**params, "text_config": {**params["text_config"], **text}}
    d = make_causal_lm(cfg_cls, model_cls, params, dest, tokenizer_dir=tokenizer_dir,
                       router_scale=4.0 if name.endswith("_moe") else 1.0)
    (d / "preprocessor_config.json").write_text(json.dumps(PREPROCESSORS[name]))

    def randomize(t: dict[str, np.ndarray]) -> None:
        rng = np.random.default_rng(0)
        for n in t:
            if n.endswith("mm_input_projection_weight"):
                t[n] = rng.normal(0.0, 0.2, t[n].shape).astype(np.float32)
    if name == "gemma3_vlm":
        rewrite_safetensors(d, randomize)
    return d


@pytest.fixture(scope="module")
def model(smollm2_small_vocab_dir, tmp_path_factory):
    """Build (once per module) the tiny model of a case."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("gguf-vlm-models")

    def build(name: str) -> Path:
        if name not in built:
            built[name] = build_vlm(name, root / name, smollm2_small_vocab_dir)
        return built[name]

    return build


# transformers 5's own layout, from the released one (the first prefix that matches wins)
NESTED = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
          ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."),
          ("visual.", "model.visual."), ("model.", "model.language_model."))


def renamed(d: Path, dest: Path, moves: tuple[tuple[str, str], ...]) -> Path:
    """A copy of the model with its tensors renamed by the first matching (old prefix, new prefix)."""
    out = copy_model(d, dest)

    def edit(t: dict[str, np.ndarray]) -> None:
        for n in list(t):
            hit = next(((old, new) for old, new in moves if n.startswith(old)), None)
            if hit:
                t[hit[1] + n[len(hit[0]):]] = t.pop(n)
    rewrite_safetensors(out, edit)
    return out


def checkpoint_names(d: Path) -> set[str]:
    from pipelines.source.safetensors_io import read_header

    return set(read_header(d / "model.safetensors").tensors)


def same_tensors(a: Path, b: Path) -> None:
    x, y = tensors(a), tensors(b)
    assert sorted(x) == sorted(y)
    assert [n for n in x if np.asarray(x[n].data).tobytes() != np.asarray(y[n].data).tobytes()] == []


# --- parity, byte identity with llama.cpp's converter, the streamed k-quant ------------------------------------

@pytest.mark.parametrize("name", VALIDATED)
def test_family_parity(name, model, tmp_path):
    d = model(name)
    results = check_family(d, tmp_path, CASES[name][3])
    report = results["f16"][0]
    assert report.architecture == CASES[name][1] and report.family == family_for(CASES[name][1]).name
    path = tmp_path / f"{d.name}-f16.gguf"
    r, t = FastGGUFReader(str(path)), tensors(path)
    assert not any(n.startswith(("v.", "mm.")) for n in t)  # the vision side is the projector's GGUF
    if name == "llava":
        assert field(r, "llama.rope.dimension_count") == 16 and "output.weight" in t
    elif name == "qwen2_5_vl":
        assert list(field(r, "qwen2vl.rope.dimension_sections")) == [2, 3, 3, 0]
        assert field(r, "qwen2vl.rope.freq_base") == pytest.approx(1e6)
        assert "blk.0.attn_q.bias" in t and "output.weight" in t
    elif name == "qwen3_vl":
        assert list(field(r, "qwen3vl.rope.dimension_sections")) == [4, 6, 6, 0]
        assert field(r, "qwen3vl.n_deepstack_layers") == 2
        assert field(r, "qwen3vl.attention.key_length") == 32
        assert tuple(t["blk.0.attn_q.weight"].shape) == (64, 128) and tuple(t["blk.0.attn_q_norm.weight"].shape) == (32,)
        assert "output.weight" in t  # untied by the outer config
    elif name == "qwen3_vl_moe":
        assert field(r, "qwen3vlmoe.expert_count") == 4 and field(r, "qwen3vlmoe.expert_feed_forward_length") == 96
        assert field(r, "qwen3vlmoe.n_deepstack_layers") == 2
        # GGUF shapes read back reversed: [cols, rows, experts]
        assert tuple(t["blk.0.ffn_gate_exps.weight"].shape) == (64, 96, 4)
        assert tuple(t["blk.1.ffn_down_exps.weight"].shape) == (96, 64, 4)
    else:
        assert field(r, "gemma3.attention.sliding_window") == 16
        assert list(field(r, "gemma3.attention.sliding_window_pattern")) == [True, False]
        assert "output.weight" not in t  # tied by Gemma3Config's default


def released_experts(d: Path, dest: Path) -> Path:
    """Qwen3-VL-MoE as released: the fused experts stored inputs first, [E, H, 2I] and [E, I, H]."""
    out = copy_model(d, dest)

    def edit(t: dict[str, np.ndarray]) -> None:
        for n in t:
            if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                t[n] = np.ascontiguousarray(t[n].transpose(0, 2, 1))
    rewrite_safetensors(out, edit)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_same_tensors_as_llamacpp(name, model, llamacpp_tree, tmp_path):
    """Qwen3-VL-MoE in its released layout: llama.cpp's converter transposes the fused experts unconditionally."""
    d = model(name)
    if name == "qwen3_vl_moe":
        d = released_experts(d, tmp_path / "qwen3_vl_moe-released")
    assert_same_tensors_as_llamacpp(llamacpp_tree, d, tmp_path)


def test_qwen3_vl_moe_released_experts_convert_and_validate_alike(model, tmp_path):
    """The fused experts as released ([E, H, 2I]) and as transformers 5 saves them ([E, 2I, H]) make the same GGUF,
    and the reference reads the released layout too (transposed as transformers' conversion does)."""
    saved = model("qwen3_vl_moe")
    released = released_experts(saved, tmp_path / "released")
    assert tensors_of(released)["model.language_model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 192)
    assert tensors_of(saved)["model.language_model.layers.0.mlp.experts.gate_up_proj"] == (4, 192, 64)
    convert_only(saved, tmp_path / "saved.gguf")
    _, metrics, _ = convert_and_validate(released, tmp_path / "released.gguf", "f16")
    same_tensors(tmp_path / "saved.gguf", tmp_path / "released.gguf")
    assert metrics["top1_agreement"] >= 0.99 and metrics["mean_kl"] < 1e-3, metrics


def tensors_of(d: Path) -> dict[str, tuple[int, ...]]:
    from pipelines.source.safetensors_io import read_header

    return {n: tuple(t.shape) for n, t in read_header(d / "model.safetensors").tensors.items()}


@pytest.mark.parametrize("name", VALIDATED)
def test_streamed_q4_k_m(name, model, tmp_path):
    check_kquant(model(name), tmp_path)


@pytest.mark.parametrize("name", VALIDATED)
def test_the_streamed_reference_is_the_whole_vlm(name, model):
    """The parity reference (streamed, one block resident) is the image-text-to-text model as `from_pretrained`
    loads it, run on token ids alone."""
    import torch
    from transformers import AutoModelForImageTextToText

    from pipelines.model import streamed_model

    d = model(name)
    ids = list(range(100, 160))
    with streamed_model.StreamedCausalLM(d, sorted(d.glob("*.safetensors"))) as lm:
        assert type(lm.model).__name__ == CASES[name][1]
        got = lm.logits(ids)
    whole = AutoModelForImageTextToText.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        expected = whole(input_ids=torch.tensor([ids])).logits[0].numpy()
    assert np.abs(got - expected).max() < 1e-4


@pytest.mark.parametrize("name,matrices", [("qwen2_5_vl", 2 * 7 + 1), ("qwen3_vl_moe", 2 * 7 + 1)])
def test_imatrix_of_a_vlm(name, matrices, model, tmp_path):
    """The importance matrix hooks the language model inside the wrapper: every matrix of the GGUF has its rows
    (a layer's 7 matrices: q, k, v, o and gate, up, down or their stacks of experts; the head)."""
    from pipelines.source.fetch import fetch
    from pipelines.targets.gguf import imatrix

    summary = imatrix.compute(fetch(str(model(name)), f"test/{name}"), tmp_path / "vlm.imatrix.gguf")
    assert summary["missing"] == [] and summary["tensors"] == matrices, summary


# --- the checkpoint layouts ------------------------------------------------------------------------------------

def test_the_layouts_transformers_saves_are_the_released_ones(model):
    names = {name: checkpoint_names(model(name)) for name in VALIDATED}
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in names["llava"]
    assert {"language_model.lm_head.weight", "vision_tower.encoder.layers.0.mlp.fc1.weight"} <= names["llava"]
    assert {"model.layers.0.self_attn.q_proj.bias", "visual.merger.mlp.0.weight"} <= names["qwen2_5_vl"]
    assert {"model.language_model.layers.0.self_attn.q_norm.weight", "lm_head.weight",
            "model.visual.deepstack_merger_list.1.norm.weight"} <= names["qwen3_vl"]
    assert "language_model.model.layers.0.self_attn.q_norm.weight" in names["gemma3_vlm"]
    assert not any("lm_head" in n for n in names["gemma3_vlm"])


@pytest.mark.parametrize("name", ["llava", "qwen2_5_vl", "gemma3_vlm"])
def test_transformers5_nested_layout_converts_to_the_same_tensors(name, model, tmp_path):
    d = model(name)
    nested = renamed(d, tmp_path / f"{name}-nested", NESTED)
    assert any(n.startswith("model.language_model.layers.0.") for n in checkpoint_names(nested))
    convert_only(d, tmp_path / "released.gguf")
    convert_only(nested, tmp_path / "nested.gguf")
    same_tensors(tmp_path / "released.gguf", tmp_path / "nested.gguf")


# llava-1.5-7b-hf and gemma-3-4b-it as released keep the CLIP / SigLIP transformer under `vision_tower.vision_model.`
RELEASED_TOWER = (("vision_tower.", "vision_tower.vision_model."),)


@pytest.mark.parametrize("layout", ["nested", "released_tower"])
def test_other_layouts_validate(layout, model, tmp_path):
    """The reference (the whole VLM, weight_rules' VLM prefixes) reads transformers 5's nested layout and the
    released tower's names too: parity as for the layout transformers saves."""
    d = renamed(model("llava"), tmp_path / f"llava-{layout}", NESTED if layout == "nested" else RELEASED_TOWER)
    _, metrics, _ = convert_and_validate(d, tmp_path / f"{layout}.gguf", "f16")
    assert metrics["top1_agreement"] >= 0.99 and metrics["mean_kl"] < 1e-3, metrics


def test_llava_as_released_names_its_decoder_in_the_text_config(model, tmp_path):
    """llava-1.5's released config says LlamaForCausalLM in its text config: the wrapper's own architecture names
    the family (the weights are under the wrapper's prefix), and the GGUF is the same."""
    d = copy_model(model("llava"), tmp_path / "llava-released")
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["architectures"] = ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    report = convert_only(d, tmp_path / "released.gguf")
    assert report.family == "llava"
    convert_only(model("llava"), tmp_path / "saved.gguf")
    same_tensors(tmp_path / "released.gguf", tmp_path / "saved.gguf")


def test_gemma3_config_without_a_tie_key_is_tied(model, tmp_path):
    """Released Gemma 3 configs say nothing of tying (Gemma3Config ties by default): no head of its own."""
    d = copy_model(model("gemma3_vlm"), tmp_path / "gemma3-released")
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("tie_word_embeddings", None)
    cfg["text_config"].pop("tie_word_embeddings", None)
    (d / "config.json").write_text(json.dumps(cfg))
    convert_only(d, tmp_path / "released.gguf")
    convert_only(model("gemma3_vlm"), tmp_path / "saved.gguf")
    same_tensors(tmp_path / "released.gguf", tmp_path / "saved.gguf")


# --- negative controls -----------------------------------------------------------------------------------------

def test_qwen3_vl_head_is_tied_by_the_outer_config(model, tmp_path, monkeypatch):
    """Negative control: reading the tie from the text config alone (true) drops the checkpoint's own head, and
    only parity shows it."""
    original = convert_mod.text_config

    def text_only(cfg):
        out = original(cfg)
        out["tie_word_embeddings"] = cfg["text_config"]["tie_word_embeddings"]
        return out

    monkeypatch.setattr(convert_mod, "text_config", text_only)
    out = tmp_path / "qwen3-vl-tied.gguf"
    _, metrics, _ = convert_and_validate(model("qwen3_vl"), out, "f16")
    assert "output.weight" not in tensors(out)
    assert metrics["finite"] is True and metrics["mean_kl"] > 0.1, metrics


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_llama_cpp_needs_the_rope_sections(name, model, tmp_path, monkeypatch):
    """Negative control: without `rope.dimension_sections` llama.cpp does not load the file (on text alone the
    sections cannot show in parity: the three positions are equal)."""
    original = convert_mod.family_for

    def without_sections(arch):
        fam = original(arch)
        return dataclasses.replace(fam, params=tuple(p for p in fam.params if p.key != R.DIMENSION_SECTIONS))

    monkeypatch.setattr(convert_mod, "family_for", without_sections)
    with pytest.raises(Exception, match="dimension_sections"):
        convert_and_validate(model(name), tmp_path / "no-sections.gguf", "f16")


def test_the_wrapper_prefixes_matter(model, tmp_path, monkeypatch):
    """Without the wrapper's renames the rules name tensors the checkpoint does not have."""
    original = convert_mod.family_for
    monkeypatch.setattr(convert_mod, "family_for", lambda arch: dataclasses.replace(original(arch), renames=()))
    with pytest.raises(ModelFormatError, match=r"missing tensor 'model\.embed_tokens\.weight' for llava"):
        convert_only(model("llava"), tmp_path / "unrenamed.gguf")


# --- refusals --------------------------------------------------------------------------------------------------

def _set_text(**change):
    def edit(cfg):
        cfg["text_config"].update(change)
    return edit


def _set_rope(**change):
    def edit(cfg):
        cfg["text_config"]["rope_parameters"].update(change)
    return edit


REFUSALS = [
    ("llava", _set_text(model_type="qwen2"), r"LLaVA with a 'qwen2' language model is not supported"),
    ("qwen2_5_vl", _set_rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=128),
     r"rope scaling type 'yarn' is not supported for qwen2vl GGUF yet"),
    ("qwen3_vl", _set_rope(mrope_section=[4, 4, 4]), r"mrope_section \[4, 4, 4\] must be at most 4 sections covering"),
    ("qwen3_vl_moe", _set_text(mlp_only_layers=[1]), r"qwen3vlmoe GGUF: layers \[1\] are dense"),
    ("llava", lambda cfg: cfg.update(architectures=["LlavaNextForConditionalGeneration"]),
     r"^no GGUF converter for LlavaNextForConditionalGeneration"),
]


@pytest.mark.parametrize("name,edit,message", REFUSALS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(REFUSALS)])
def test_layouts_llama_cpp_cannot_run_are_refused(name, edit, message, model, tmp_path):
    assert_refused(model(name), tmp_path, edit, message)


def test_qwen2_5_vl_config_as_released(model, tmp_path):
    """Qwen2.5-VL's released config.json is flat (the text model's keys at the top, no text_config) and names its rope
    type "mrope" (rope_scaling.type): the same file, and the reference reads that config too."""
    d = copy_model(model("qwen2_5_vl"), tmp_path / "qwen2_5_vl-released")
    cfg = json.loads((d / "config.json").read_text())
    text = {k: v for k, v in cfg.pop("text_config").items() if k not in ("rope_parameters", "model_type", "dtype")}
    flat = {**cfg, **text, "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    (d / "config.json").write_text(json.dumps(flat))
    _, metrics, _ = convert_and_validate(d, tmp_path / "released.gguf", "f16")
    assert metrics["top1_agreement"] >= 0.99 and metrics["mean_kl"] < 1e-3, metrics
    convert_only(model("qwen2_5_vl"), tmp_path / "saved.gguf")
    same_tensors(tmp_path / "released.gguf", tmp_path / "saved.gguf")
    assert list(field(FastGGUFReader(str(tmp_path / "released.gguf")), "qwen2vl.rope.dimension_sections")) == [2, 3, 3, 0]
