"""Layer slices (pipelines/model/slicing.py, targets/vllm/engine_check.write_slice): which tensors and config a slice of
the first N layers keeps, and that a vLLM slice is the published bytes of those tensors."""

from __future__ import annotations

import json

import pytest
from factories import make_tiny_causal_lm

from pipelines.model.slicing import in_slice, layer_of, slice_config
from pipelines.source.safetensors_io import TensorSource
from pipelines.targets.vllm.engine_check import write_slice


@pytest.mark.parametrize("name, layer", [("model.layers.3.mlp.up_proj.weight", 3), ("transformer.h.12.attn.c_attn.bias", 12),
                                         ("encoder.layer.0.output.dense.weight", 0), ("model.embed_tokens.weight", None),
                                         ("lm_head.weight", None), ("model.norm.weight", None),
                                         ("model.layers_norm.weight", None)])
def test_layer_of_a_tensor(name, layer):
    assert layer_of(name) == layer
    assert in_slice(name, 2) == (layer is None or layer < 2)


def test_a_config_is_sliced_with_its_per_layer_lists_and_text_config():
    cfg = {"num_hidden_layers": 6, "layer_types": ["sliding_attention", "full_attention"] * 3, "hidden_size": 64,
           "mlp_only_layers": [], "text_config": {"num_hidden_layers": 6, "layer_types": ["a"] * 6}}
    out = slice_config(cfg, 2)
    assert out["num_hidden_layers"] == 2 and out["layer_types"] == ["sliding_attention", "full_attention"]
    assert out["text_config"] == {"num_hidden_layers": 2, "layer_types": ["a", "a"]}
    assert out["mlp_only_layers"] == [] and out["hidden_size"] == 64
    assert cfg["num_hidden_layers"] == 6 and len(cfg["layer_types"]) == 6  # a copy: the original is untouched
    assert slice_config({"n_layer": 1}, 2) == {"n_layer": 1}  # never more layers than the model has


def test_a_vllm_slice_holds_the_published_bytes_of_its_tensors(tmp_path):
    model = make_tiny_causal_lm("qwen3", tmp_path / "m")  # 2 layers: a 1-layer slice drops one
    (model / "tokenizer.json").write_text("{}")
    files = write_slice(model, 1, tmp_path / "slice")
    assert files[:2] == ["model.safetensors", "config.json"] and "tokenizer.json" in files
    cfg = json.loads((tmp_path / "slice" / "config.json").read_text())
    assert (cfg["num_hidden_layers"] == 1
            and cfg["architectures"] == json.loads((model / "config.json").read_text())["architectures"])
    with (TensorSource(sorted(model.glob("*.safetensors"))) as full,
          TensorSource([tmp_path / "slice" / "model.safetensors"]) as part):
        kept = set(part.names())
        assert kept == {n for n in full.names() if layer_of(n) in (None, 0)} and kept
        for n in kept:
            assert full.info(n).dtype == part.info(n).dtype and full.info(n).shape == part.info(n).shape
            assert bytes(full.where[n].raw(n)) == bytes(part.where[n].raw(n))
    assert (tmp_path / "slice" / "tokenizer.json").stat().st_ino == (model / "tokenizer.json").stat().st_ino  # linked
