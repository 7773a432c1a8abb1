"""The vLLM runner's own logic that needs no engine (pipelines/targets/vllm/runner.py): the FP8 matmul it runs
on a CPU whose torch._scaled_mm is oneDNN's scalar reference loop. The emulation is checked against the real
torch._scaled_mm and against float64 arithmetic on the FP8 values; the engine end to end is
tests/targets/vllm/test_vllm_engine.py's.
"""

from __future__ import annotations

import pytest
import torch

from pipelines.targets.vllm import runner


def fp8_operands(m: int, k: int, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=gen) * 3).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, generator=gen) * 3).to(torch.float8_e4m3fn).t()  # vLLM passes the weight transposed
    return a, b


def float64_truth(a, b, scale_a, scale_b, bias=None):
    out = (a.to(torch.float64) @ b.to(torch.float64)) * scale_a.to(torch.float64) * scale_b.to(torch.float64)
    return out if bias is None else out + bias.to(torch.float64)


@pytest.fixture
def emulated(monkeypatch):
    original = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", original)  # restored after the test, whatever it installs
    return runner.emulated_scaled_mm(original), original


def test_vllm_channel_wise_call_equals_torch_and_float64(emulated):
    """vLLM's channel-wise kernel: unit scales, fp32 out, the scales applied by vLLM afterwards."""
    emu, original = emulated
    a, b = fp8_operands(19, 96, 40)  # 19 tokens: vLLM pads to 17+, an odd count on purpose
    one = torch.ones(1)
    got = emu(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
    real = original(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
    truth = float64_truth(a, b, one, one)
    assert got.dtype == torch.float32 and got.shape == (19, 40)
    assert torch.allclose(got.double(), truth, rtol=1e-6, atol=1e-4)
    assert torch.allclose(got, real, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_row_and_column_scales_with_bias(emulated, out_dtype):
    emu, original = emulated
    a, b = fp8_operands(8, 64, 24, seed=1)
    gen = torch.Generator().manual_seed(2)
    sa, sb = torch.rand(8, 1, generator=gen) + 0.1, torch.rand(1, 24, generator=gen) + 0.1
    bias = torch.randn(24, generator=gen).to(out_dtype)
    got = emu(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
    truth = float64_truth(a, b, sa, sb, bias)
    assert got.dtype == out_dtype
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2  # bf16 keeps 8 bits of mantissa
    assert torch.allclose(got.double(), truth, rtol=tol, atol=tol * truth.abs().max().item())
    scale_ones = emu(a, b, torch.ones(1), torch.ones(1), out_dtype=torch.float32)
    assert not torch.allclose(got.double(), scale_ones.double(), rtol=0.05)  # the scales were applied


def test_calls_it_cannot_emulate_go_to_the_original(emulated):
    _emu, _original = emulated
    calls = []

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return "original"

    emu = runner.emulated_scaled_mm(recording)
    a, b = fp8_operands(4, 32, 8)
    block = torch.ones(4, 2)  # a scale per (row, 16-wide block of k): not a row or column scale
    assert emu(a, b, block, torch.ones(1), out_dtype=torch.float32) == "original"
    assert emu(a, b, torch.ones(1), torch.ones(1)) == "original"  # no out_dtype
    assert emu(a, b, torch.ones(1), torch.ones(1), scale_result=torch.ones(1), out_dtype=torch.float32) == "original"
    assert len(calls) == 3


@pytest.mark.parametrize("requested", ["native", "emulated"])
def test_the_choice_is_installed_and_says_why(emulated, requested):
    _emu, original = emulated
    record = runner.choose_fp8_matmul(requested)
    assert record["reason"] == f"HIVE_AOT_VLLM_FP8_MATMUL={requested}" and record["probe_ratio"] is None
    assert (torch._scaled_mm is original) == (requested == "native")
    assert record["kernel"] == ("torch._scaled_mm" if requested == "native" else "fp32 emulation of torch._scaled_mm")
    runner.choose_fp8_matmul(requested)  # a second job in the same (warm) process wraps nothing twice
    assert getattr(torch._scaled_mm, "_hive_aot", False) == (requested == "emulated")
    assert getattr(torch._scaled_mm, "original", original) is original
    if requested == "emulated":
        a, b = fp8_operands(3, 16, 5)
        assert torch._scaled_mm(a, b, torch.ones(1), torch.ones(1), out_dtype=torch.float32).shape == (3, 5)


def test_auto_follows_the_measured_ratio(emulated):
    _emu, original = emulated
    record = runner.choose_fp8_matmul("auto")
    assert record["probe_ratio"] > 0
    slow = record["probe_ratio"] >= runner.FP8_SLOW_RATIO
    assert (torch._scaled_mm is not original) == slow
    assert ("oneDNN has no fast FP8 kernel" in record["reason"]) == slow and str(record["probe_ratio"]) in record["reason"]
    assert runner.choose_fp8_matmul("native")["kernel"] == "torch._scaled_mm" and torch._scaled_mm is original


def test_a_weight_is_widened_once_while_it_lives(emulated):
    emu, _original = emulated
    a, b = fp8_operands(5, 32, 16)
    first = emu(a, b, torch.ones(1), torch.ones(1), out_dtype=torch.float32)
    again = emu(a.clone(), b, torch.ones(1), torch.ones(1), out_dtype=torch.float32)
    assert torch.equal(first, again) and len(emu.narrow) == 1  # the same weight: one bf16 copy
    other = fp8_operands(5, 32, 16, seed=3)[1]
    emu(a, other, torch.ones(1), torch.ones(1), out_dtype=torch.float32)
    assert len(emu.narrow) == 2
    del b, other  # a freed weight takes its copy with it: a new tensor at a reused id is never served a stale one
    assert len(emu.narrow) == 0


@pytest.mark.parametrize("transposed", [True, False])
def test_bf16_is_widened_exactly_in_either_layout(transposed):
    w = (torch.randn(48, 80) * 5).to(torch.float8_e4m3fn)
    w = w.t() if transposed else w
    wide = runner.widen_bf16(w.to(torch.bfloat16))
    assert wide.dtype == torch.float32 and wide.shape == w.shape and torch.equal(wide, w.to(torch.float32))


def test_a_gpu_engine_is_left_alone(emulated, monkeypatch):
    _emu, original = emulated
    monkeypatch.setattr(runner, "_cpu_engine", lambda: False)
    record = runner.choose_fp8_matmul("emulated")
    assert record == {"kernel": "the platform's own FP8 kernels", "probe_ratio": None, "reason": "not a CPU engine"}
    assert torch._scaled_mm is original
