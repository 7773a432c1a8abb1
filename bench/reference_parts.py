"""The transformers reference in its two parts, streamed, against the same computation with fresh memory for
every read (the anchor: how every streamed pass read its weights before `model/unit_memory.py`).

    .venv/bin/python bench/reference_parts.py [MODEL_DIR] [--preset llama3-1b] [--json-out FILE]

For each of the two ways (buffers reused, fresh memory), in a cache of its own: the logits of the parity texts
alone (what a vLLM or AI 100 build computes), then the greedy continuation alone (what a GGUF build after it
adds), each timed in one child process that runs the reference child's own function (`compute_into`) streamed
whatever the model's size, as an 8B model is on a host of its size, with its linear layers' FLOPs over that
time beside the fp32 GEMM rate of the model's shapes measured in the same run (bench/floors.py's). The
continuation's token ids must be the same both ways.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from floors import CACHE, gemm_rate  # noqa: E402

RUN = """
import json, sys, tempfile, time
from pathlib import Path
model, fresh = Path(sys.argv[1]), sys.argv[2] == "fresh"
from pipelines.model import unit_memory
from pipelines.validation import prompts, reference
if fresh:  # the anchor: every read gets new memory, as before the pool
    take = unit_memory.BufferPool.take
    def never_reused(pool, shape):
        pool.clear()
        return take(pool, shape)
    unit_memory.BufferPool.take = never_reused
tok = reference.load_tokenizer(model)
ids = reference.encode(tok, prompts.PARITY_TEXTS)
gen = reference.encode(tok, [prompts.GENERATION_PROMPT])[0]
files = [str(f) for f in sorted(model.glob("*.safetensors"))]
out = {"positions": sum(map(len, ids))}
work = Path(tempfile.mkdtemp())
# the reference child's own function, called here (streamed) so that the anchor's patch applies to it
for part, n_gen in (("logits", 0), ("continuation", prompts.GENERATION_TOKENS)):
    t0 = time.perf_counter()
    usage = reference.compute_into(str(model), files, ids, gen, n_gen, {part: str(work / part)}, resident=False)
    seconds = time.perf_counter() - t0
    out[part] = {"seconds": seconds, "flop": usage["flop"], "flop_per_s": usage["flop"] / seconds}
out["generation_ids"] = json.loads((work / "continuation" / "done.json").read_text())["generation_ids"]
out["peak_rss"] = usage.get("peak_rss")
print(json.dumps(out))
"""


def run(model: Path, fresh: bool, work: Path) -> dict:
    env = {**os.environ, "HIVE_AOT_CACHE": str(work / ("fresh" if fresh else "reused"))}
    subprocess.run(["sync"], check=False)
    out = subprocess.run([sys.executable, "-c", RUN, str(model), "fresh" if fresh else "reused"], env=env, cwd=REPO,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", nargs="?")
    ap.add_argument("--preset", default="llama3-1b")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    model = Path(args.model_dir) if args.model_dir else CACHE / args.preset
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "pipelines.model.synthetic", "--preset", args.preset, "--out", str(model)],
                       check=True, cwd=REPO)
    config = json.loads((model / "config.json").read_text())
    work = Path(tempfile.mkdtemp(prefix="hive-bench-reference-"))
    try:
        results = {way: run(model, way == "fresh memory", work) for way in ("fresh memory", "buffers reused")}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gemm = gemm_rate(config, results["buffers reused"]["positions"])
    ids = {way: r["generation_ids"] for way, r in results.items()}
    print(f"model {model.name}, streamed; fp32 GEMM rate of its shapes "
          f"{gemm['rate'] / 1e9:.1f} GFLOP/s")
    print("| way | logits (s) | logits GFLOP/s | of GEMM | continuation (s) | both (s) |\n|---|---:|---:|---:|---:|---:|")
    for way, r in results.items():
        rate = r["logits"].get("flop_per_s", 0)
        print(f"| {way} | {r['logits']['seconds']:.1f} | {rate / 1e9:.1f} | {rate / gemm['rate']:.2f} | "
              f"{r['continuation']['seconds']:.1f} | {r['logits']['seconds'] + r['continuation']['seconds']:.1f} |")
    fresh, reused = results["fresh memory"], results["buffers reused"]
    print(f"continuation: {fresh['continuation']['seconds'] / reused['continuation']['seconds']:.2f}x faster with "
          f"buffers reused; the same token ids: {ids['fresh memory'] == ids['buffers reused']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"model": model.name, "gemm": gemm,
                                                   "results": results}, indent=1) + "\n")
    return 0 if ids["fresh memory"] == ids["buffers reused"] else 1


if __name__ == "__main__":
    sys.exit(main())
