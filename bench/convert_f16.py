"""Benchmark: HF -> f16 GGUF of the demo model vs `cp` of the same safetensors bytes, in one run.

Each command runs in its own child process (median of N runs); wall time and the child's peak RSS
come from wait4(). Prints a table and the ratios (convert / cp).

    .venv/bin/python bench/convert_f16.py [MODEL_DIR] [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONVERT = """
import json, sys
from pathlib import Path
from pipelines.targets.gguf.convert import convert
d = Path(sys.argv[1])
cfg = json.loads((d / "config.json").read_text())
files = sorted(d.glob("*.safetensors"))
convert(d, cfg, files, Path(sys.argv[2]), "f16", name="bench")
"""


def run(cmd: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _pid, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"bench: {cmd[0]} failed: {proc.stderr.read().decode()[-500:]}")
    return wall, usage.ru_maxrss * 1024  # Linux reports KiB


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", nargs="?", default=os.environ.get("HIVE_AOT_SMOLLM2_DIR", ".demo/SmolLM2-135M-Instruct"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = Path(args.model_dir).resolve()
    shards = sorted(model.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in shards)
    work = Path(tempfile.mkdtemp(prefix="hive-bench-"))
    results: dict[str, list[tuple[float, int]]] = {"hive-aot convert f16": [], "cp safetensors": []}
    try:
        for i in range(args.runs):
            out = work / f"out-{i}.gguf"
            results["hive-aot convert f16"].append(run([sys.executable, "-c", CONVERT, str(model), str(out)]))
            out.unlink()
            dst = work / f"cp-{i}"
            dst.mkdir()
            results["cp safetensors"].append(run(["cp", *map(str, shards), str(dst)]))
            shutil.rmtree(dst)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {name: {"wall_s": statistics.median(w for w, _ in rs), "peak_rss_mib": statistics.median(r for _, r in rs) / 2**20}
               for name, rs in results.items()}
    conv, cp = summary["hive-aot convert f16"], summary["cp safetensors"]
    ratios = {"wall": conv["wall_s"] / cp["wall_s"], "peak_rss": conv["peak_rss_mib"] / cp["peak_rss_mib"]}
    doc = {"model": str(model), "weights_mib": size / 2**20, "runs": args.runs, "results": summary,
           "ratios_convert_over_cp": ratios}
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(f"model {model.name}: {size / 2**20:.0f} MiB of safetensors, median of {args.runs} runs")
    print(f"{'command':24} {'wall s':>8} {'peak RSS MiB':>13}")
    for name, s in summary.items():
        print(f"{name:24} {s['wall_s']:8.2f} {s['peak_rss_mib']:13.0f}")
    print(f"ratio convert/cp: wall {ratios['wall']:.1f}x, peak RSS {ratios['peak_rss']:.1f}x "
          f"(peak RSS / weights = {conv['peak_rss_mib'] * 2**20 / size:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
