"""The FP8 GEMM of a CPU vLLM check: torch._scaled_mm (vLLM's channel-wise call: FP8 in, fp32 out, unit scales)
against the runner's fp32 emulation (pipelines/targets/vllm/runner.py: bf16-kept weight widened per call, fp32
GEMM), at the linear shapes of the models hive-aot checks, in one run, on this CPU.

    .venv/bin/python bench/vllm_fp8_matmul.py [--json-out FILE]

The anchor is torch._scaled_mm, which vLLM runs on a CPU without AMX-FP8: oneDNN's fast FP8 kernel on
AMX-FP16/AVX10.2 CPUs, its scalar reference loop elsewhere. Each row also times an fp32 torch.mm of the same
shape (what the emulation cannot beat); then the runner's probe (torch._scaled_mm over the emulation at one
shape), the number it decides on. Tokens:
17 (vLLM pads a prefill to 17 rows for this kernel) and 1 (a decode step).
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch

from pipelines.targets.vllm import runner

SHAPES = {  # (in, out) of a model's largest linears: attention qkv and the MLP's up/down
    "SmolLM2-135M qkv": (576, 960), "SmolLM2-135M up": (576, 3072),
    "Llama-3-8B up": (4096, 14336), "Llama-3-8B down": (14336, 4096),
    "Llama-3-70B up": (8192, 28672),
}


def best(fn, repeats: int = 5) -> float:
    fn()  # warm-up: the emulation keeps its bf16 copy of the weight, as in the engine
    return runner.best_seconds(fn, repeats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out")
    args = ap.parse_args()
    one = torch.ones(1)
    native = torch._scaled_mm
    emulated = runner.emulated_scaled_mm(native)
    rows = []
    for name, (k, n) in SHAPES.items():
        weight = (torch.randn(n, k) * 3).to(torch.float8_e4m3fn).t()  # vLLM holds the weight transposed
        for tokens in (17, 1):
            a = (torch.randn(tokens, k) * 3).to(torch.float8_e4m3fn)
            a32, w32 = a.float(), weight.float()
            t_native = best(lambda: native(a, weight, scale_a=one, scale_b=one, out_dtype=torch.float32))
            t_emulated = best(lambda: emulated(a, weight, one, one, out_dtype=torch.float32))
            t_fp32 = best(lambda: torch.mm(a32, w32))
            same = torch.allclose(emulated(a, weight, one, one, out_dtype=torch.float32),
                                  native(a, weight, scale_a=one, scale_b=one, out_dtype=torch.float32),
                                  rtol=1e-5, atol=1e-3)
            rows.append({"shape": name, "tokens": tokens, "native_ms": round(t_native * 1e3, 2),
                         "emulated_ms": round(t_emulated * 1e3, 2), "fp32_mm_ms": round(t_fp32 * 1e3, 2),
                         "native/emulated": round(t_native / t_emulated, 2), "same_result": same})
            r = rows[-1]
            print(f"{name:18} x{tokens:<3} native {r['native_ms']:9.2f} ms  emulated {r['emulated_ms']:8.2f} ms  "
                  f"fp32 mm {r['fp32_mm_ms']:8.2f} ms  native/emulated {r['native/emulated']:6.2f}x  same {same}")
    probe = runner.probe_fp8_matmul()
    print(f"probe: torch._scaled_mm / emulation = {probe:.1f}x at {runner.FP8_PROBE_SHAPE} (the runner emulates from "
          f"{runner.FP8_SLOW_RATIO:g}x)")
    if args.json_out:
        doc = {"torch": torch.__version__, "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
               "probe_ratio": round(probe, 2), "threshold": runner.FP8_SLOW_RATIO, "rows": rows}
        with open(args.json_out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
