"""Measure each GGUF quantization type on the demo model, to set recipe thresholds with margin.

    .venv/bin/python bench/calibrate_gguf_recipes.py [MODEL_DIR] [--types q4_0,Q5_K_M,Q3_K_M+imatrix,...] [--json]

One lossless intermediate is converted once; every type is made from it (our converter for outtypes,
libllama for ftypes, with the project's own importance matrix for the types that need one or that are
named with a `+imatrix` suffix) and validated
with the same `validate_gguf` as a build. The demo model's weights were dequantized from Q4_1, so its
quantization error understates that of a model trained in bf16: recipes keep a wide margin over these.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_TYPES = "q8_0,q4_0,q5_0,Q6_K,Q5_K_M,Q4_K_M,Q4_K_S,IQ4_XS,Q3_K_M,Q2_K,IQ2_XS"


def main() -> int:
    from pipelines.source.fetch import fetch
    from pipelines.targets.gguf import imatrix
    from pipelines.targets.gguf.convert import OUTTYPES, convert
    from pipelines.targets.gguf.quantize import NEEDS_IMATRIX, quantize
    from pipelines.targets.gguf.validate import validate_gguf

    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(ROOT / ".demo/SmolLM2-135M-Instruct"))
    ap.add_argument("--types", default=DEFAULT_TYPES)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    snap = fetch(args.model, "demo/" + Path(args.model).name)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        inter = work / "f16.gguf"
        convert(snap.dir, snap.config(), snap.safetensors_files(), inter, "f16", name=snap.model_id)
        imat = None
        for spec in args.types.split(","):
            t, _, extra = spec.partition("+")
            weighted = extra == "imatrix" or t.upper() in NEEDS_IMATRIX
            out = work / f"{t}.gguf"
            start = time.perf_counter()
            if t.lower() in OUTTYPES:
                convert(snap.dir, snap.config(), snap.safetensors_files(), out, t.lower(), name=snap.model_id)
            else:
                if weighted and imat is None:
                    imat = work / "imatrix.gguf"
                    imatrix.compute(snap, imat)
                quantize(inter, out, t, imatrix=imat if weighted else None)
            made = time.perf_counter() - start
            metrics, _ = validate_gguf(snap, out)
            rows.append({"type": spec, "size_mib": round(out.stat().st_size / 2**20, 1), "make_s": round(made, 1),
                         **{k: metrics[k] for k in ("top1_agreement", "mean_kl", "max_abs_logit_delta", "token_parity")}})
            out.unlink()
            print(json.dumps(rows[-1]), file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'type':8} {'MiB':>7} {'top-1':>7} {'KL':>9} {'max|dl|':>8}")
        for r in rows:
            print(f"{r['type']:8} {r['size_mib']:7.1f} {r['top1_agreement']:7.4f} {r['mean_kl']:9.5f} "
                  f"{r['max_abs_logit_delta']:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
