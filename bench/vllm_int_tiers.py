"""The vLLM tiers of the demo model side by side: vllm-bf16, vllm-fp8, vllm-w8a8-int8 and vllm-w4a16 of SmolLM2-135M
built in one run, each validated as a build validates it, and their numbers against the same fp32 reference.

    .venv/bin/python bench/vllm_int_tiers.py [--recipes vllm-w4a16,...] [--json-out FILE]

Per tier: the artifact in transformers (fp32, quantization simulated from the stored bytes) against the source's
fp32 reference on the parity texts (top-1, mean KL, max |delta logit|), vLLM's own top-1 against that reference
and against transformers on the same files, the dtype the CPU engine ran at, the largest weight error, the build's
wall time per step. Builds go to a temporary store with a fresh cache (nothing reused from earlier runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = ("vllm-bf16", "vllm-fp8", "vllm-w8a8-int8", "vllm-w4a16")
DEMO = "HuggingFaceTB/SmolLM2-135M-Instruct"
COLUMNS = (("top1_agreement", "top-1", ".3f"), ("mean_kl", "mean KL", ".4f"), ("max_abs_logit_delta", "max|dlogit|", ".2f"),
           ("vllm_reference_top1_agreement", "vLLM top-1", ".3f"), ("vllm_top1_agreement", "vLLM~tf", ".3f"),
           ("max_weight_rel_error", "max w err", ".3f"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--model", default=str(REPO / ".demo" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--json-out")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-int-") as tmp:
        os.environ["HIVE_AOT_CACHE"] = str(Path(tmp) / "cache")  # a fresh cache: nothing from earlier runs
        from pipelines.config.registry import Config
        from pipelines.engine.build import build_and_publish

        config = Config.load(REPO / "registry.yaml")
        rows = {}
        for rid in args.recipes.split(","):
            res = build_and_publish(args.model, rid, config, str(Path(tmp) / "store"), DEMO)
            v = res.validation or {}
            rows[rid] = {"state": res.state, "metrics": v.get("metrics", {}), "failures": v.get("failures", []),
                         "engine_dtype": (v.get("vllm") or {}).get("dtype"), "step_seconds": res.step_seconds}
            print(f"{rid}: {res.state}", file=sys.stderr)
    header = f"{'recipe':16} {'state':10} " + " ".join(f"{title:>11}" for _k, title, _f in COLUMNS) + "  engine dtype"
    print(header)
    for rid, row in rows.items():
        m = row["metrics"]
        cells = " ".join(f"{format(m[k], fmt) if isinstance(m.get(k), (int, float)) else '-':>11}" for k, _t, fmt in COLUMNS)
        print(f"{rid:16} {row['state']:10} {cells}  {row['engine_dtype']}")
    for rid, row in rows.items():
        seconds = ", ".join(f"{k} {v:.0f} s" for k, v in (row["step_seconds"] or {}).items())
        print(f"{rid}: {seconds}" + (f"; failed: {'; '.join(row['failures'])}" if row["failures"] else ""))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
