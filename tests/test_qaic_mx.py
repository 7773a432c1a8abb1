"""MX emulation (pipelines/targets/qaic/mx.py) on values whose encodings are known, and the predicted
quality of an AI 100 compile of the demo model (quality.py)."""

from __future__ import annotations

import pytest
import torch

from pipelines.targets.qaic.mx import fake_mxfp6, fake_mxint8

E2M3_GRID = sorted({m / 8 for m in range(8)} | {(1 + m / 8) * 2**e for e in range(3) for m in range(8)})


def test_e2m3_grid_and_shared_power_of_two_scale():
    assert E2M3_GRID[-1] == 7.5 and len(E2M3_GRID) == 32  # 0, 7 subnormals, 24 normals
    block = torch.tensor([7.5] + E2M3_GRID[1:-1] + [0.0] * 2)  # amax 7.5: scale 2^(2 - 2) = 1
    assert torch.equal(fake_mxfp6(block), block)  # every grid value is exact
    assert torch.equal(fake_mxfp6(block * 2**-10), block * 2**-10)  # the scale is a power of two
    x = torch.tensor([6.0, 0.3, 0.0625, -2.6] + [0.0] * 28)  # amax 6 -> scale 1
    assert fake_mxfp6(x)[:4].tolist() == [6.0, 0.25, 0.0, -2.5]  # nearest; 0.0625 ties to even (0)
    big = torch.tensor([8.0, 1.0] + [0.0] * 30)  # amax 8: floor(log2 8) - 2 = 1 -> scale 2, 8 = 4 x 2
    assert fake_mxfp6(big)[:2].tolist() == [8.0, 1.0]


def test_blocks_are_32_wide_along_the_reduction_axis():
    x = torch.zeros(2, 40)
    x[0, 0], x[0, 1], x[0, 33] = 100.0, 1.0, 1.0  # 1.0 shares a block with 100 (lost), the other is alone
    q = fake_mxfp6(x)
    assert q[0, 1] == 0.0 and q[0, 33] == 1.0 and q.shape == (2, 40)
    assert torch.equal(fake_mxfp6(torch.zeros(3, 7)), torch.zeros(3, 7))


def test_mxint8_fixed_point_with_shared_scale():
    x = torch.tensor([1.5, 1 / 64, 1 / 256, -1.0] + [0.0] * 28)  # amax 1.5 -> scale 1; step 1/64
    assert fake_mxint8(x)[:4].tolist() == [1.5, 1 / 64, 0.0, -1.0]
    r = torch.randn(4, 64)
    err = (fake_mxint8(r) - r).abs().max() / r.abs().max()
    assert 0 < err < 2**-6


@pytest.mark.slow
def test_demo_model_quality_prediction(smollm2_dir):
    from pipelines import prompts, reference
    from pipelines.targets.qaic.quality import predict

    ids = reference.encode(reference.load_tokenizer(smollm2_dir), prompts.PARITY_TEXTS[:2])
    both = predict(smollm2_dir, ids)
    off = predict(smollm2_dir, ids[:1], mxfp6=False, mxint8=False, fp16=False)
    print("mxfp6+mxint8", both)
    assert off["top1"] == 1.0 and off["max_abs_logit_delta"] < 1e-3  # the decoder itself equals transformers
    assert 0.8 < both["top1"] < 1.0 and 0 < both["kl"] < 0.2 and both["ppl_delta"] > 0
    assert both["emulated"] == ["mxfp6 weights", "mxint8 kv cache"]


@pytest.mark.parametrize("name", ["gpt2", "gpt_bigcode", "falcon", "mixtral", "gpt_oss"])
def test_mxfp6_emulation_covers_every_constant_matmul_weight(name, tmp_path):
    """After quality.fake_mxfp6_weights, every constant MatMul/Gemm weight of the exported graph (what
    `-mxfp6-matmul` compresses: linear layers, GPT-2's Conv1D, MoE routers and experts, lm_head) is already
    on the MXFP6 grid in blocks along its reduction axis; only attention's two MatMuls per layer and the
    last-position pick read no constant."""
    import numpy as np
    import onnx
    from factories import make_tiny_causal_lm
    from onnx import numpy_helper

    from pipelines import reference
    from pipelines.targets.qaic.decoder import build_decoder
    from pipelines.targets.qaic.export import export_decoder
    from pipelines.targets.qaic.quality import fake_mxfp6_weights

    def on_grid(w: np.ndarray) -> bool:  # w [..., K]: blocks along the last axis
        t = torch.from_numpy(np.ascontiguousarray(w))
        return torch.equal(fake_mxfp6(t), t)

    model = reference.load_model(make_tiny_causal_lm(name, tmp_path / name))
    assert not on_grid(model.lm_head.weight.detach().numpy())  # random weights are not: the check can fail
    assert fake_mxfp6_weights(model) >= 2 * 4 + 1
    out = tmp_path / "model.onnx"
    export_decoder(build_decoder(model), out, ctx_len=16)
    m = onnx.load(str(out))
    weights = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    stored_as = {n.output[0]: n.input[0] for n in m.graph.node if n.op_type == "Cast" and n.input[0] in weights}
    checked, dynamic = 0, 0
    for node in m.graph.node:
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        b = weights.get(stored_as.get(node.input[1], node.input[1]))  # fp16 matrices are read through a Cast
        if b is None:
            dynamic += 1
            continue
        trans_b = any(a.name == "transB" and a.i for a in node.attribute)
        assert on_grid(b if trans_b else b.T), (name, node.name, b.shape)  # MatMul's B is [K, N]
        checked += 1
    assert dynamic == 2 * 2 + 1 and checked >= 2 * 4 + 1
    print(name, "constant MatMul weights on the MXFP6 grid:", checked)


def test_quality_prediction_of_a_moe_family(tmp_path):
    """quality.predict on a non-Llama family: the decoder alone equals transformers; MXFP6 + MXINT8 move it."""
    import random

    from factories import make_tiny_causal_lm

    from pipelines.targets.qaic.quality import predict

    model_dir = make_tiny_causal_lm("gpt_oss", tmp_path / "gpt_oss")
    rng = random.Random(0)
    ids = [rng.sample(range(512), 24), rng.sample(range(512), 20)]
    off = predict(model_dir, ids, mxfp6=False, mxint8=False, fp16=False)
    both = predict(model_dir, ids)
    print("gpt_oss fp32", off, "mxfp6+mxint8", both)
    assert off["positions"] == 44 and off["top1"] == 1.0 and off["max_abs_logit_delta"] < 1e-3
    assert both["max_abs_logit_delta"] > 1e-3 and both["kl"] > 0
    assert both["emulated"] == ["mxfp6 weights", "mxint8 kv cache"]


def test_quality_prediction_streams_unit_by_unit_with_the_same_numbers(tmp_path):
    """Streamed (each weight emulated as it loads, every sequence through a layer before the next is read) the
    prediction equals the resident one: one pass over the weights whatever the number of sequences."""
    import random

    from factories import make_tiny_causal_lm

    from pipelines.targets.qaic.quality import predict

    model_dir = make_tiny_causal_lm("gpt2", tmp_path / "gpt2")  # Conv1D weights (MXFP6 along axis 0)
    rng = random.Random(1)
    ids = [rng.sample(range(512), 20), rng.sample(range(512), 13), rng.sample(range(512), 17)]
    resident = predict(model_dir, ids, resident=True)
    streamed = predict(model_dir, ids, resident=False)
    for key in ("top1", "kl", "max_abs_logit_delta", "ppl_delta"):
        assert abs(resident[key] - streamed[key]) <= 1e-5 * max(1.0, abs(resident[key])), key
    assert streamed["resident"] is False and streamed["unit_loads"] == 2 + 2 + 2  # wte, wpe, 2 blocks, ln_f, lm_head
    assert 0 < streamed["kl"] and streamed["emulated"] == ["mxfp6 weights", "mxint8 kv cache"]
