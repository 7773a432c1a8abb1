#!/usr/bin/env bash
# GPU check of prepared vLLM weights (run on a CUDA host; about 5-8 min including the install):
#   bench/gpu_vllm.sh [RAW_DIR] [BF16_DIR] [FP8_DIR]
# RAW_DIR: the model as downloaded (default .demo/SmolLM2-135M-Instruct, made by `make setup`);
# BF16_DIR / FP8_DIR: pulled vllm-bf16 / vllm-fp8 artifacts (default: pulled here from ./artifacts with
# `hive-aot pull`, after `make demo` and `hive-aot build ... --recipe vllm-fp8`).
# Installs vLLM into /tmp/gpu-vllm unless `import vllm` already works, then for each directory: cold-start
# time of LLM(...) (load + profile + KV allocation), greedy continuations of fixed prompts in bf16, and
# token parity of the artifacts against the raw repo (bf16 vs bf16: the same weights must give the same
# tokens; fp8 is reported, W8A8 on sm89+, W8A16 Marlin below). Prints one JSON line per directory and a summary.
set -euo pipefail
cd "$(dirname "$0")/.."
RAW=${1:-.demo/SmolLM2-135M-Instruct}
BF16=${2:-pulled/gpu-check/vllm-bf16}
FP8=${3:-pulled/gpu-check/vllm-fp8}
MODEL=HuggingFaceTB/SmolLM2-135M-Instruct
if [ ! -d "$BF16" ] && [ -x .venv/bin/python ]; then
  .venv/bin/python -m pipelines.cli pull "$MODEL" --target vllm-cu121 --recipe vllm-bf16 --dest "$BF16" --store artifacts
fi
if [ ! -d "$FP8" ] && [ -x .venv/bin/python ]; then
  .venv/bin/python -m pipelines.cli pull "$MODEL" --target vllm-cu121 --recipe vllm-fp8 --dest "$FP8" --store artifacts || true
fi
PY=python3
if ! $PY -c "import vllm" 2>/dev/null; then
  t0=$(date +%s)
  [ -x /tmp/gpu-vllm/bin/python ] || python3 -m venv /tmp/gpu-vllm
  /tmp/gpu-vllm/bin/pip install -q "vllm==${VLLM_VERSION:-0.33.0}"
  PY=/tmp/gpu-vllm/bin/python
  echo "{\"install_seconds\": $(( $(date +%s) - t0 ))}"
fi
nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader || true
for dir in "$RAW" "$BF16" "$FP8"; do
  [ -d "$dir" ] || { echo "{\"dir\": \"$dir\", \"skipped\": \"missing\"}"; continue; }
  # one process per directory: a cold start each, as a serving container has
  $PY bench/gpu_vllm_run.py "$dir" | tail -1 | tee -a /tmp/gpu-vllm-results.jsonl
done
$PY - <<'PYEOF'
import json
rows = [json.loads(l) for l in open("/tmp/gpu-vllm-results.jsonl") if l.startswith("{")][-3:]
base = next((r for r in rows if r.get("dir", "").startswith(".demo")), rows[0] if rows else None)
for r in rows:
    same = sum(a == b for a, b in zip(r["greedy"], base["greedy"])) if base else 0
    print(f"{r['dir']:45} cold start {r['cold_start_s']:6.1f}s ({r['cold_start_s'] / base['cold_start_s']:.2f}x raw)  "
          f"greedy prompts identical to raw: {same}/{len(r['greedy'])}")
PYEOF
