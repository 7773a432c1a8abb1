"""Plans at the sizes the platform onboards: a Llama-3-70B-shaped model (headers only, data sections left as
holes) planned for every shipped recipe kind on a 24 GB host, from its headers, in seconds.

Every step of every kind must fit 20 GiB: the streamed reference and the artifact run unit by unit, the engines
check a layer slice, the ONNX export streams its weights. Disk is not what this measures (the host's free space
decides it); the memory plan is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipelines.model.synthetic import generate, preset

REPO = Path.cwd()
GIB = 1 << 30
RECIPES = ["gguf-f16", "gguf-q4_k_m", "vllm-bf16", "vllm-fp8", "vllm-w4a16", "vllm-w8a8-int8", "qaic-export", "qaic-mxfp6",
           "qaic-fp16"]


@pytest.fixture(scope="module")
def llama3_70b(tmp_path_factory) -> Path:
    """Llama-3-70B's config and safetensors headers (36 shards, 141 GB of bf16 declared, no byte written)."""
    model = generate(tmp_path_factory.mktemp("sparse") / "llama3-70b", preset("llama3-70b"), tokenizer_vocab=2000,
                     sparse=True)
    assert model.parameters == 70_553_706_496 and model.shards > 30
    return Path(model.path)


def hive(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), **env})


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_step_of_a_70b_model_fits_20_gib_planned_from_headers_in_seconds(recipe, llama3_70b, tmp_path):
    t0 = time.monotonic()
    out = hive("plan", str(llama3_70b), "--recipe", recipe, "--model-id", "synthetic/llama3-70b",
               "--store", str(tmp_path / "store"), "--json", env={"HIVE_AOT_MEMORY_BUDGET": "24G"})
    seconds = time.monotonic() - t0
    assert out.returncode in (0, 7), out.stderr  # 7: this host's disk is smaller than a 70B build's
    doc = json.loads(out.stdout)
    assert seconds <= 10, f"plan took {seconds:.1f} s"
    for plan in doc["plans"]:  # a derived recipe plans its input first
        steps = {s["step"]: s for s in plan["steps"]}
        print(recipe, plan["recipe"], {k: round(s["memory"] / GIB, 1) for k, s in steps.items()}, f"{seconds:.1f} s")
        assert max(s["memory"] for s in steps.values()) <= 20 * GIB, plan["steps"]
        assert all("of disk" in p for p in plan["problems"]), plan["problems"]  # memory never refused
        assert plan["build_id"] is None  # nothing hashed: a header-only look
        validate = steps.get("validate", {}).get("detail", "")
        if plan["recipe"].startswith("vllm"):  # vLLM checks a slice of the real files
            assert "its first 2 layers with embeddings and head" in validate
        if plan["recipe"] == "qaic-export":  # onnxruntime checks a graph of 2 layers over the same data
            assert "a graph of its first 2 layers over the same external data" in validate
            assert steps["export"]["memory"] < 2 * GIB  # the export streams: the graph and a few chunks
            assert steps["export"]["disk"] < 0.55 * 4 * 70_553_706_496  # fp16 external data, not fp32


def _header_only(path: Path, tensors: dict[str, tuple[str, list[int], int]]) -> None:
    """A safetensors file of these tensors (name -> dtype, shape, bytes) with its data section left a hole."""
    header, offset = {}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)


def _clip_l_336() -> dict[str, tuple[str, list[int], int]]:
    """CLIP ViT-L/14 at 336 pixels (LLaVA's vision tower) and LLaVA's two-layer projector, as llava-1.5's
    checkpoints name them (transformers 4's layout), in bf16."""
    h, inter, out = 1024, 4096, []
    out += [("embeddings.class_embedding", [h]), ("embeddings.patch_embedding.weight", [h, 3, 14, 14]),
            ("embeddings.position_embedding.weight", [577, h]), ("pre_layrnorm.weight", [h]), ("pre_layrnorm.bias", [h]),
            ("post_layernorm.weight", [h]), ("post_layernorm.bias", [h])]
    for i in range(24):
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out += [(f"encoder.layers.{i}.self_attn.{proj}.weight", [h, h]), (f"encoder.layers.{i}.self_attn.{proj}.bias", [h])]
        for norm in ("layer_norm1", "layer_norm2"):
            out += [(f"encoder.layers.{i}.{norm}.weight", [h]), (f"encoder.layers.{i}.{norm}.bias", [h])]
        out += [(f"encoder.layers.{i}.mlp.fc1.weight", [inter, h]), (f"encoder.layers.{i}.mlp.fc1.bias", [inter]),
                (f"encoder.layers.{i}.mlp.fc2.weight", [h, inter]), (f"encoder.layers.{i}.mlp.fc2.bias", [h])]
    return {f"vision_tower.vision_model.{n}": ("BF16", shape, 2 * int(np.prod(shape))) for n, shape in out}


@pytest.fixture(scope="module")
def llava_70b(llama3_70b, tmp_path_factory) -> Path:
    """A LLaVA of Llama-3-70B's language model and CLIP-L/336 (llava-next-72b's scale), headers only, in the layout
    transformers 4 saved (`language_model.model.*`, `vision_tower.*`): 70.9 B parameters."""
    from pipelines.source.safetensors_io import read_header

    out = tmp_path_factory.mktemp("sparse") / "llava-70b"
    out.mkdir()
    text = json.loads((llama3_70b / "config.json").read_text())
    hidden = text["hidden_size"]
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 128255,
              "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu",
              "text_config": {k: v for k, v in text.items() if k != "architectures"},
              "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                                "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336,
                                "patch_size": 14, "projection_dim": 768}}
    (out / "config.json").write_text(json.dumps(config))
    weight_map = {}
    for shard in sorted(llama3_70b.glob("*.safetensors")):
        tensors = {}
        for name, info in read_header(shard).tensors.items():
            renamed = "language_model." + name  # model.layers.* -> language_model.model.layers.*, lm_head too
            tensors[renamed] = (info.dtype, list(info.shape), info.nbytes)
            weight_map[renamed] = shard.name
        _header_only(out / shard.name, tensors)
    vision = {**_clip_l_336(), **{f"multi_modal_projector.{n}": ("BF16", shape, 2 * int(np.prod(shape))) for n, shape in (
        ("linear_1.weight", [hidden, 1024]), ("linear_1.bias", [hidden]), ("linear_2.weight", [hidden, hidden]),
        ("linear_2.bias", [hidden]))}}
    _header_only(out / "vision.safetensors", vision)
    weight_map.update(dict.fromkeys(vision, "vision.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (llama3_70b / name).is_file():
            (out / name).write_bytes((llama3_70b / name).read_bytes())
    return out


@pytest.mark.parametrize("recipe", ["qaic-export", "qaic-mxfp6"])
def test_a_70b_vision_language_model_streams_every_ai100_step_within_20_gib(recipe, llava_70b, tmp_path):
    """The VLM export and its checks stream the language model as a decoder's: only the vision side (CLIP-L and
    the projector, 0.33 B parameters) is held, and onnxruntime checks a 2-layer slice."""
    out = hive("plan", str(llava_70b), "--recipe", recipe, "--model-id", "synthetic/llava-70b",
               "--store", str(tmp_path / "store"), "--json", env={"HIVE_AOT_MEMORY_BUDGET": "24G"})
    assert out.returncode in (0, 7), out.stderr
    for plan in json.loads(out.stdout)["plans"]:
        steps = {s["step"]: s for s in plan["steps"]}
        print(recipe, plan["recipe"], {k: round(s["memory"] / GIB, 1) for k, s in steps.items()})
        assert max(s["memory"] for s in steps.values()) <= 20 * GIB, plan["steps"]
        assert all("of disk" in p for p in plan["problems"]), plan["problems"]
        assert "the vision side held" in steps["validate"]["detail"], steps["validate"]
        if plan["recipe"] == "qaic-export":
            assert "the vision side held" in steps["export"]["detail"]
            assert "a graph of its first 2 layers over the same external data" in steps["validate"]["detail"]
            assert steps["export"]["memory"] < 6 * GIB  # the graph, a few chunks and the vision side (x 2.2)


# --- the 2025-26 frontier MoE models (tests/support/real_size_moe.py), headers only ------------------------------------

@pytest.fixture(scope="module")
def frontier_moe(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    """Qwen3-235B-A22B, DeepSeek-V3 (671B, bf16), GLM-4.6 (355B + its MTP layer), Llama-4 Maverick (400B of
    language model, experts fused as released): configs and header-only shards in the released names."""
    import real_size_moe

    root = tmp_path_factory.mktemp("sparse-moe")
    out = {}
    for name, expected in (("qwen3-235b-a22b", 235.1e9), ("deepseek-v3", 671.0e9), ("glm-4.6", 356.8e9),
                           ("llama-4-maverick", 400.7e9)):
        path, parameters = real_size_moe.write(name, root / name, smollm2_dir)
        assert abs(parameters - expected) < 0.1e9, (name, parameters)
        out[name] = path
    return out


@pytest.mark.parametrize("recipe", ["gguf-f16", "gguf-q4_k_m"])
@pytest.mark.parametrize("name", ["qwen3-235b-a22b", "deepseek-v3", "glm-4.6", "llama-4-maverick"])
def test_frontier_moe_gguf_plans_fit_20_gib_from_headers(name, recipe, frontier_moe, tmp_path):
    """Every step of their GGUF builds fits 20 GiB on a 24 GB host: the converter streams tensors, llama.cpp maps the
    file, and the reference holds a decoder layer with its stacked experts read one expert at a time (a DeepSeek-V3
    layer is 43 GiB of fp32, a Maverick MoE layer 61 GiB)."""
    out = hive("plan", str(frontier_moe[name]), "--recipe", recipe, "--model-id", f"synthetic/{name}",
               "--store", str(tmp_path / "store"), "--json", env={"HIVE_AOT_MEMORY_BUDGET": "24G"})
    assert out.returncode in (0, 7), out.stderr  # 7: this host's disk is smaller than the build's
    (plan,) = json.loads(out.stdout)["plans"]
    steps = {s["step"]: s for s in plan["steps"]}
    print(name, recipe, {k: round(s["memory"] / GIB, 1) for k, s in steps.items()})
    assert max(s["memory"] for s in steps.values()) <= 20 * GIB, plan["steps"]
    assert all("of disk" in p for p in plan["problems"]), plan["problems"]
    facts = _facts(frontier_moe[name])
    if facts.largest_layer * 4 > 20 * GIB:  # DeepSeek-V3, Maverick: a whole layer alone would not fit
        assert facts.largest_streamed_layer * 4 < 4 * GIB < 20 * GIB < facts.largest_layer * 4


def _facts(model: Path):
    from pipelines.model.memory import facts_from_tensors
    from pipelines.source.safetensors_io import read_header

    tensors = [t for shard in sorted(model.glob("*.safetensors")) for t in read_header(shard).tensors.values()]
    return facts_from_tensors(tensors, json.loads((model / "config.json").read_text()))



def test_a_fused_expert_tensor_is_planned_an_expert_at_a_time_in_the_converter(frontier_moe, tmp_path):
    """Llama 4 keeps its experts fused ([E, H, 2I]): the converter rearranges them an expert at a time (sliced.py),
    at least one expert a slice (Maverick's gate_up: 5120 x 16384 = 320 MiB of fp32), so the plan counts slices of
    that size; per-expert checkpoints (DeepSeek-V3) keep the plain 16 MiB row slices."""
    assert _facts(frontier_moe["llama-4-maverick"]).largest_stacked_expert == 5120 * 16384
    assert _facts(frontier_moe["deepseek-v3"]).largest_stacked_expert == 0
    out = hive("plan", str(frontier_moe["llama-4-maverick"]), "--recipe", "gguf-f16", "--model-id", "synthetic/maverick",
               "--store", str(tmp_path / "store"), "--json", env={"HIVE_AOT_MEMORY_BUDGET": "24G"})
    (plan,) = json.loads(out.stdout)["plans"]
    convert = next(s for s in plan["steps"] if s["step"] == "convert")
    assert "4 row slices of 800.0 MiB" in convert["detail"] and 3 * GIB < convert["memory"] < 4 * GIB
