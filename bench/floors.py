"""`make bench`: each step of a build beside its physical floor on this host, measured in the same run.

    .venv/bin/python bench/floors.py [MODEL_DIR] [--preset llama3-1b] [--recipe gguf-q4_k_m] [--runs 3]
        [--json-out FILE]

The model is a synthetic Llama with real shapes (`--preset`, generated once into ~/.cache/hive-aot/bench/), or
MODEL_DIR. Three measurements, each in its own child process:

1. **f16 conversion against `cp`** of the same safetensors (median of --runs): the ratio the issue holds to
   1.5x. The source is read through the page cache in both (each run reads it once before timing).
2. **The fp32 GEMM rate** of the model's own matrix shapes (every linear layer and the output head, at the
   validated positions' batch, torch on every core): the rate a forward pass could reach here.
3. **One cold build** (`hive-aot build --recipe R --json`, fresh store and cache): the step lines it writes
   (`hive-aot: [step] done in N s`) give each step's time. Each step's floor: `cp` of the bytes it reads for the
   IO-bound ones (fetch, hash, convert), FLOPs of one forward pass over the validated positions at the
   measured GEMM rate for the compute-bound ones (reference, engine check). A conversion that quantizes to
   k-quants as it streams is bound by ggml's quantizer instead: its floor is the published GGUF's k-quant
   elements at the seconds per element ggml_quantize_chunk takes here for each type, on every core.

Printed: the step table (time, floor, ratio), the build against (copy of the source + two forward passes at
the GEMM rate), the issue's 3x bound, and against that floor plus ggml's own k-quant time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support"))  # factories.write_test_config
CACHE = Path(os.environ.get("HIVE_AOT_BENCH_DIR", Path.home() / ".cache" / "hive-aot" / "bench"))
STEP_LINE = re.compile(r"^hive-aot: \[(?P<step>[^\]]+)\] done in (?P<seconds>[0-9.]+) s")

CONVERT = """
import json, sys
from pathlib import Path
from pipelines.targets.gguf.convert import convert
d = Path(sys.argv[1])
convert(d, json.loads((d / "config.json").read_text()), sorted(d.glob("*.safetensors")), Path(sys.argv[2]), sys.argv[3],
        name="bench")
"""

GEMM = """
import json, sys, time
import torch
shapes, positions, repeats = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(int(sys.argv[4]))
x = {k: torch.randn(positions, k) for k in {s[0] for s in shapes}}
w = [torch.randn(k, n) for k, n in shapes]
for (k, _), m in zip(shapes, w):
    x[k] @ m  # warm the kernels
best = float("inf")
for _ in range(repeats):
    t0 = time.perf_counter()
    for (k, _), m in zip(shapes, w):
        x[k] @ m
    best = min(best, time.perf_counter() - t0)
flops = sum(2 * positions * k * n for k, n in shapes)
print(json.dumps({"flops": flops, "seconds": best, "rate": flops / best}))
"""


def timed(cmd: list[str], **kw) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd[:3])} failed: {proc.stderr[-2000:]}")
    return wall, proc.stdout + proc.stderr


def source_files(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def warm_page_cache(files: list[Path]) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def cp_seconds(files: list[Path], work: Path, runs: int) -> float:
    times = []
    for i in range(runs):
        dst = work / f"cp-{i}"
        dst.mkdir()
        times.append(timed(["cp", *map(str, files), str(dst)])[0])
        shutil.rmtree(dst)
    return statistics.median(times)


def convert_seconds(model: Path, work: Path, outtype: str, runs: int) -> float:
    times = []
    for i in range(runs):
        out = work / f"out-{i}.gguf"
        times.append(timed([sys.executable, "-c", CONVERT, str(model), str(out), outtype], cwd=REPO)[0])
        out.unlink()
    return statistics.median(times)


def linear_shapes(config: dict) -> list[tuple[int, int]]:
    """(in, out) of every matrix a forward pass multiplies by, the output head included."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or h // heads
    per_layer = [(h, heads * head_dim), (h, kv * head_dim), (h, kv * head_dim), (heads * head_dim, h),
                 (h, inter), (h, inter), (inter, h)]
    return per_layer * layers + [(h, config["vocab_size"])]


def gemm_rate(config: dict, positions: int) -> dict:
    shapes = linear_shapes(config)
    distinct = sorted(set(shapes))  # each shape once, weighted back by its count
    _, out = timed([sys.executable, "-c", GEMM, json.dumps(distinct), str(positions), "3", str(os.cpu_count() or 1)])
    measured = json.loads(out.strip().splitlines()[-1])
    per_pass = sum(2 * positions * k * n for k, n in shapes)
    return {"rate": measured["rate"], "forward_flops": per_pass, "forward_seconds": per_pass / measured["rate"]}


def build_steps(model: Path, model_id: str, recipe: str, work: Path) -> tuple[float, dict[str, float], dict]:
    """One cold build: its wall time, each step's time from its step lines, its JSON document. Random weights
    have flat logits, so a k-quant's top-1 choices flip where a trained model's would not: such a recipe is
    built with large_model.py's relaxed gates (the metrics are still measured)."""
    from factories import write_test_config
    from large_model import relaxed_gates

    env = {**os.environ, "HIVE_AOT_STORE": str(work / "store"), "HIVE_AOT_CACHE": str(work / "cache"),
           "DAGSTER_HOME": str(work / "dagster")}
    env.pop("HIVE_AOT_PROGRESS", None)
    env.pop("HIVE_AOT_RECIPES", None)
    if relaxed_gates(recipe) is not None:
        (work / "config").mkdir()
        env["HIVE_AOT_REGISTRY"] = str(write_test_config(work / "config", REPO, gates={recipe: relaxed_gates(recipe)}))
    wall, out = timed([str(REPO / ".venv" / "bin" / "hive-aot"), "build", str(model), "--model-id", model_id,
                       "--recipe", recipe, "--json"], env=env, cwd=work)
    steps: dict[str, float] = {}
    for line in out.splitlines():
        m = STEP_LINE.match(line)
        if m:
            steps[m["step"]] = steps.get(m["step"], 0.0) + float(m["seconds"])
    doc = json.loads(out[out.index("{"):out.rindex("}") + 1]) if "{" in out else {}
    return wall, steps, doc


QUANTIZE_RATE = """
import json, sys, time
import gguf, numpy as np
from pipelines.targets.gguf.tensor_quant import quantize_rows
rows = np.random.default_rng(0).standard_normal((1024, 2048), dtype=np.float32) * 0.02
rates = {}
for name in json.loads(sys.argv[1]):
    qtype = gguf.GGMLQuantizationType[name]
    quantize_rows(rows[:16], qtype)
    t0 = time.perf_counter()
    quantize_rows(rows, qtype)
    rates[name] = (time.perf_counter() - t0) / rows.size
print(json.dumps(rates))
"""


def quantize_floor(work: Path) -> tuple[float | None, dict]:
    """ggml's own quantization time for the published GGUF's k-quant tensors, on every core: each tensor's
    elements at the seconds per element ggml_quantize_chunk takes for its type here (one thread, then divided
    by the cores). None when the build published no k-quant."""
    import gguf

    files = sorted((p for p in (work / "store").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    if not files:
        return None, {}
    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(files[-1]).tensors:
        if t.tensor_type.name.endswith("_K"):
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    if not counts:
        return None, {}
    _, out = timed([sys.executable, "-c", QUANTIZE_RATE, json.dumps(sorted(counts))], cwd=REPO)
    per_element = json.loads(out.strip().splitlines()[-1])
    seconds = sum(n * per_element[k] for k, n in counts.items()) / (os.cpu_count() or 1)
    return seconds, {"elements": counts, "seconds_per_element": per_element}


def floor_of(step: str, cp: float, forward: float, quantize: float | None) -> tuple[float | None, str]:
    """A step's floor and what it is: the copy of the source for IO-bound steps (a conversion that quantizes as
    it streams: ggml's quantization time on every core, if longer), forward passes for compute."""
    name = step.split(": ")[-1]
    if name == "convert" and quantize and quantize > cp:
        return quantize, "ggml's k-quant time, all cores"
    if name in ("download source", "hash source", "convert", "input"):
        return cp, "cp of the source"
    if name in ("reference", "llama.cpp check", "vllm check"):
        return forward, "1 forward pass at GEMM rate"
    if name == "validate":
        return 2 * forward, "2 forward passes (holds the two above)"
    return None, ""


def achieved_rates(rates: dict, gemm_rate: float, copy_rate: float) -> list[str]:
    """The build's own record of its rates (meter.rates), each as a share of the host's: FLOP/s of the GEMM,
    bytes/s of a copy of the source."""
    lines = []
    for step, done in rates.items():
        if done.get("flop_per_s"):
            lines.append(f"{step}: {done['flop_per_s'] / 1e9:.1f} GFLOP/s = {done['flop_per_s'] / gemm_rate:.2f} of "
                         "the GEMM rate")
        if done.get("bytes_per_s"):
            lines.append(f"{step}: {done['bytes_per_s'] / 1e9:.2f} GB/s = {done['bytes_per_s'] / copy_rate:.2f} of "
                         "a copy's")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", nargs="?")
    ap.add_argument("--preset", default="llama3-1b")
    ap.add_argument("--recipe", default="gguf-q4_k_m")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    model = Path(args.model_dir) if args.model_dir else CACHE / args.preset
    if not (model / "config.json").exists():
        print(f"bench: generating the synthetic {args.preset} into {model}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pipelines.model.synthetic", "--preset", args.preset, "--out", str(model)],
                       check=True, cwd=REPO)
    config = json.loads((model / "config.json").read_text())
    files = source_files(model)
    size = sum(f.stat().st_size for f in files)
    work = Path(tempfile.mkdtemp(prefix="hive-bench-floors-"))
    try:
        warm_page_cache(files)
        cp = cp_seconds(files, work, args.runs)
        convert_f16 = convert_seconds(model, work, "f16", args.runs)
        wall, steps, doc = build_steps(model, f"bench/{model.name}", args.recipe, work)
        positions = int(((doc.get("validation") or {}).get("metrics") or {}).get("positions") or 0) or 761
        gemm = gemm_rate(config, positions)
        quantize, quantize_detail = quantize_floor(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    bound = cp + 2 * gemm["forward_seconds"]
    print(f"model {model.name}: {size / 1e9:.2f} GB of safetensors, {os.cpu_count()} cores")
    print(f"cp of the source: {cp:.2f} s ({size / cp / 1e9:.2f} GB/s); f16 conversion: {convert_f16:.2f} s = "
          f"{convert_f16 / cp:.2f}x cp (bound 1.5x)")
    print(f"fp32 GEMM rate at {positions} positions: {gemm['rate'] / 1e9:.1f} GFLOP/s; one forward pass "
          f"{gemm['forward_flops'] / 1e12:.2f} TFLOP = {gemm['forward_seconds']:.2f} s")
    print(f"\n{args.recipe} build, cold: {wall:.1f} s = {wall / bound:.2f}x (cp + 2 forward passes = {bound:.1f} s; "
          "bound 3x)")
    if quantize:
        print(f"with ggml's own k-quant time on {os.cpu_count()} cores ({quantize:.1f} s) added to that floor: "
              f"{wall / (bound + quantize):.2f}x")
    print()
    print("| step | time (s) | floor (s) | ratio | floor is |\n|---|---:|---:|---:|---|")
    rows = []
    for step, seconds in steps.items():
        floor, what = floor_of(step, cp, gemm["forward_seconds"], quantize)
        rows.append({"step": step, "seconds": seconds, "floor": floor, "floor_is": what})
        ratio = f"{seconds / floor:.2f}x" if floor else ""
        print(f"| {step} | {seconds:.1f} | {floor:.2f} | {ratio} | {what} |" if floor else f"| {step} | {seconds:.1f} | | | |")
    achieved = achieved_rates(doc.get("step_rates") or {}, gemm["rate"], size / cp)
    if achieved:
        print("\nrates the build recorded (step_rates), beside the host's:")
        for line in achieved:
            print(f"  {line}")
    result = {"model": model.name, "bytes": size, "cores": os.cpu_count(), "cp_seconds": cp,
              "convert_f16_seconds": convert_f16, "convert_over_cp": convert_f16 / cp, "gemm": gemm,
              "positions": positions, "build_seconds": wall, "bound_seconds": bound, "build_over_bound": wall / bound,
              "quantize_floor_seconds": quantize, "quantize": quantize_detail, "steps": rows,
              "step_rates": doc.get("step_rates")}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
