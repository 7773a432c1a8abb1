"""Compare hive-aot's GGUF converter with llama.cpp's own `convert_hf_to_gguf.py`, in one run.

Up to six files from one model (the demo model by default): llama.cpp f16 and q8_0 (its converter's
`--outtype`), llama.cpp q4_k_m (libllama's quantizer, ftype 15, applied to llama.cpp's bf16 by default --
the same source precision hive-aot's own k-quant path uses as its intermediate; `--q4-from f16` to
change), and hive-aot's gguf-f16 / gguf-q8_0 / gguf-q4_k_m recipes built with `GgufTarget().build`
(`--variants` picks a subset). The anchor is `cp` of the same safetensors bytes. Unless
`--no-validate`, every file is validated with the same `validate_gguf` (same prompts, same transformers
fp32 reference). Every conversion runs in its own child process: wall time and peak RSS come from
wait4() (median of `--runs`). The files are compared tensor by tensor, byte for byte, and their GGUF
metadata key by key.

llama.cpp is never vendored here: the llama-cpp-python sdist is downloaded at run time into
$HIVE_AOT_CACHE/compare/ and its converter runs in a separate venv the script creates
($HIVE_AOT_CACHE/venvs/llamacpp-convert-<hash>; first run: several minutes). transformers 4.57
cannot load the "TokenizersBackend" class transformers 5 writes, so llama.cpp's converter reads a
symlinked copy of the model with tokenizer_class "PreTrainedTokenizerFast".

    .venv/bin/python bench/compare_llamacpp.py [MODEL_DIR] [--runs 3] [--variants f16,q8_0,q4_k_m]
        [--no-validate] [--json] [--json-out FILE] [--keep]

    # the ~1B synthetic Llama (Llama-3.2-1B's shapes):
    .venv/bin/python -m pipelines.model.synthetic --preset llama3-1b --out /tmp/llama3-1b
    .venv/bin/python bench/compare_llamacpp.py /tmp/llama3-1b --model-id bench/llama3-1b --variants f16 --no-validate
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

import llamacpp_converter  # noqa: E402

LLAMA_CPP_VERSION = llamacpp_converter.LLAMA_CPP_VERSION
MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CONVERT_REQS = ["torch==2.13.0", "transformers>=4.57,<4.58", "sentencepiece==0.2.0", "protobuf<5", "numpy",
                "safetensors"]
Q4_K_M = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
VARIANTS = ("f16", "q8_0", "q4_k_m")
RECIPES = {"f16": "gguf-f16", "q8_0": "gguf-q8_0", "q4_k_m": "gguf-q4_k_m"}

OURS_CHILD = """
import json, sys
from pathlib import Path
from pipelines.config.registry import Config
from pipelines.source.fetch import Snapshot
from pipelines.targets import BuildContext
from pipelines.targets.gguf import GgufTarget
snap = Snapshot.from_dict(json.loads(Path(sys.argv[1]).read_text()))
recipe = Config.load(sys.argv[3]).recipe(sys.argv[2])
# GgufTarget.build reads only the snapshot and the recipe: no compatibility, registry or classifier needed
ctx = BuildContext(snapshot=snap, recipe=recipe, compatibility=None, registry=None, classify=None)
art = GgufTarget().build(ctx, Path(sys.argv[4]))
print(json.dumps({"file": art.files[0], "info": art.info}, default=str))
"""

QUANT_CHILD = """
import ctypes, os, sys
import llama_cpp
from llama_cpp import _logger
_logger.set_verbose(False)
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = os.cpu_count() or 1
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))
sys.exit(rc)
"""


def log(msg: str) -> None:
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    return Path(os.environ.get("HIVE_AOT_CACHE") or Path.home() / ".cache" / "hive-aot")


# ---------------------------------------------------------------------------------------------
# llama.cpp's converter: sdist + its own venv


def ensure_llamacpp_tree(cache: Path) -> Path:
    """The converter tree the GGUF family tests use too (tests/support/llamacpp_converter.py: the pinned sdist's
    converter, conversion/ and gguf-py, extracted once into the cache)."""
    return llamacpp_converter.ensure_tree(cache, log)


def ensure_convert_venv(cache: Path, python: str) -> Path:
    pyver = subprocess.run([python, "-c", "import sys; print(sys.version)"], check=True, capture_output=True,
                           text=True).stdout.strip()
    key = hashlib.sha256(json.dumps([CONVERT_REQS, LLAMA_CPP_VERSION, pyver]).encode()).hexdigest()[:16]
    venv = cache / "venvs" / f"llamacpp-convert-{key}"
    if (venv / ".complete").is_file():
        return venv
    log(f"creating the comparison venv {venv} (several minutes)")
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *CONVERT_REQS], check=True)
    (venv / ".complete").touch()
    return venv


def converter_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NO_LOCAL_GGUF", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def patched_model_copy(model: Path, dst: Path) -> Path:
    """Symlinks to the model files, plus a tokenizer_config.json that transformers 4.57 can load."""
    dst.mkdir(parents=True)
    for p in model.iterdir():
        if p.is_file() and p.name != "tokenizer_config.json":
            (dst / p.name).symlink_to(p.resolve())
    tc = model / "tokenizer_config.json"
    if tc.is_file():
        cfg = json.loads(tc.read_text())
        if cfg.get("tokenizer_class") == "TokenizersBackend":
            cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        (dst / tc.name).write_text(json.dumps(cfg, indent=2))
    return dst


# ---------------------------------------------------------------------------------------------
# timing


def run_timed(cmd: list[str], logfile: Path, env: dict[str, str] | None = None) -> tuple[float, int, str]:
    """Wall seconds, peak RSS bytes of the child (wait4), and its stdout."""
    with open(logfile, "ab") as err, tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT)
        _pid, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        stdout = out.read().decode(errors="replace")
    if proc.returncode != 0:
        tail = logfile.read_text(errors="replace")[-3000:]
        sys.exit(f"compare: {' '.join(cmd[:3])} ... failed (exit {proc.returncode}); log {logfile}:\n{tail}")
    return wall, usage.ru_maxrss * 1024, stdout  # Linux reports KiB


def median_timing(samples: list[tuple[float, int]]) -> dict[str, Any]:
    return {"wall_s": statistics.median(w for w, _ in samples),
            "peak_rss_mib": statistics.median(r for _, r in samples) / 2**20,
            "wall_s_runs": [round(w, 3) for w, _ in samples]}


# ---------------------------------------------------------------------------------------------
# GGUF comparisons


def _field_value(field) -> Any:
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - exotic field types: compare raw bytes
        return b"".join(bytes(p) for p in field.parts)


def _short(v: Any) -> Any:
    if isinstance(v, list):
        return f"<array of {len(v)}>" if len(v) > 8 else v
    if isinstance(v, str) and len(v) > 120:
        return v[:117] + "..."
    if isinstance(v, bytes):
        return f"<{len(v)} bytes>"
    return v


def metadata_diff(ours: Path, theirs: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    def kv(path: Path) -> dict[str, Any]:
        r = GGUFReader(path)
        return {k: _field_value(f) for k, f in r.fields.items() if not k.startswith("GGUF.")}

    a, b = kv(ours), kv(theirs)
    differ = {}
    for k in sorted(a.keys() & b.keys()):
        if a[k] != b[k]:
            entry = {"ours": _short(a[k]), "llama_cpp": _short(b[k])}
            if isinstance(a[k], list) and isinstance(b[k], list) and len(a[k]) == len(b[k]):
                idx = [i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y]
                entry["n_differing_entries"] = len(idx)
                entry["first"] = [{"i": i, "ours": a[k][i], "llama_cpp": b[k][i]} for i in idx[:5]]
            differ[k] = entry
    return {
        "only_llama_cpp": {k: _short(b[k]) for k in sorted(b.keys() - a.keys())},
        "only_ours": {k: _short(a[k]) for k in sorted(a.keys() - b.keys())},
        "differ": differ,
        "n_identical": sum(1 for k in a.keys() & b.keys() if a[k] == b[k]),
        "tokenizer_pre": {"ours": a.get("tokenizer.ggml.pre"), "llama_cpp": b.get("tokenizer.ggml.pre")},
    }


def tensor_diff(ours: Path, theirs: Path) -> dict[str, Any]:
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    ta = {t.name: t for t in GGUFReader(ours).tensors}
    tb = {t.name: t for t in GGUFReader(theirs).tensors}
    identical, differing, type_mismatch, shape_mismatch = [], [], [], []
    for name in sorted(ta.keys() & tb.keys()):
        x, y = ta[name], tb[name]
        if x.tensor_type != y.tensor_type:
            type_mismatch.append({"name": name, "ours": x.tensor_type.name, "llama_cpp": y.tensor_type.name})
            continue
        if list(x.shape) != list(y.shape):
            shape_mismatch.append({"name": name, "ours": [int(s) for s in x.shape], "llama_cpp": [int(s) for s in y.shape]})
            continue
        bx, by = np.asarray(x.data).view(np.uint8).reshape(-1), np.asarray(y.data).view(np.uint8).reshape(-1)
        if bx.size == by.size and np.array_equal(bx, by):
            identical.append(name)
            continue
        dx = dequantize(np.asarray(x.data), x.tensor_type).astype(np.float32)
        dy = dequantize(np.asarray(y.data), y.tensor_type).astype(np.float32)
        differing.append({"name": name, "type": x.tensor_type.name,
                          "differing_bytes": int(np.count_nonzero(bx != by)) if bx.size == by.size else None,
                          "total_bytes": int(bx.size),
                          "max_abs_diff_dequantized": float(np.max(np.abs(dx - dy))),
                          "differing_values": int(np.count_nonzero(dx != dy))})
    return {
        "n_tensors": {"ours": len(ta), "llama_cpp": len(tb)},
        "identical": len(identical),
        "differing": differing,
        "type_mismatch": type_mismatch,
        "shape_mismatch": shape_mismatch,
        "only_ours": sorted(ta.keys() - tb.keys()),
        "only_llama_cpp": sorted(tb.keys() - ta.keys()),
        "types": {"ours": _type_counts(ta.values()), "llama_cpp": _type_counts(tb.values())},
    }


def _type_counts(tensors) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


# ---------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", nargs="?",
                    default=os.environ.get("HIVE_AOT_SMOLLM2_DIR", str(ROOT / ".demo" / "SmolLM2-135M-Instruct")))
    ap.add_argument("--model-id", default=MODEL_ID)
    ap.add_argument("--registry", default=os.environ.get("HIVE_AOT_REGISTRY", str(ROOT / "registry.yaml")))
    ap.add_argument("--runs", type=int, default=3, help="conversions timed per variant (median reported)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {','.join(VARIANTS)} (default all)")
    ap.add_argument("--no-validate", action="store_true",
                    help="skip the llama.cpp-vs-transformers validation (timing, RSS and byte identity only)")
    ap.add_argument("--q4-from", choices=["bf16", "f16"], default="bf16",
                    help="which llama.cpp conversion libllama quantizes to q4_k_m (default bf16, like hive-aot)")
    ap.add_argument("--python", default=shutil.which("python3") or sys.executable,
                    help="interpreter for the comparison venv")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    ap.add_argument("--json-out", type=Path, help="also write the JSON document to this file")
    ap.add_argument("--markdown", action="store_true", help="print docs/benchmarks.md's table rows instead of the report")
    ap.add_argument("--keep", action="store_true", help="keep the work directory with the GGUF files")
    args = ap.parse_args()
    variants = tuple(v for v in VARIANTS if v in args.variants.split(","))
    if not variants or set(args.variants.split(",")) - set(VARIANTS):
        ap.error(f"--variants takes a comma-separated subset of {','.join(VARIANTS)}")

    from pipelines.source.fetch import fetch

    model = Path(args.model_dir).resolve()
    cache = cache_root()
    tree = ensure_llamacpp_tree(cache)
    venv = ensure_convert_venv(cache, args.python)
    (cache / "compare").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=cache / "compare"))
    logfile = work / "children.log"
    log(f"work dir {work}")
    try:
        snapshot = fetch(str(model), args.model_id)
        snap_json = work / "snapshot.json"
        snap_json.write_text(json.dumps(snapshot.to_dict()))
        hf_copy = patched_model_copy(model, work / "hf-copy" / model.name)
        shards = [str(p) for p in snapshot.safetensors_files()]
        weight_bytes = sum(os.path.getsize(p) for p in shards)

        converter = [str(venv / "bin" / "python"), str(tree / "convert_hf_to_gguf.py"), str(hf_copy)]
        env = converter_env()
        files: dict[tuple[str, str], Path] = {}
        timing: dict[tuple[str, str], list[tuple[float, int]]] = {}
        ours_info: dict[str, Any] = {}
        for i in range(args.runs):
            log(f"conversions, run {i + 1}/{args.runs}")
            # the anchor: cp of the same safetensors bytes (cold or warm page cache alike for every tool)
            dst = work / "cp"
            shutil.rmtree(dst, ignore_errors=True)
            dst.mkdir()
            w, r, _ = run_timed(["cp", *shards, str(dst)], logfile)
            shutil.rmtree(dst)
            timing.setdefault(("cp", "safetensors"), []).append((w, r))
            # llama.cpp: f16, q8_0 straight from its converter; q4_k_m = its bf16/f16 + libllama quantize
            for outtype in [v for v in variants if v in ("f16", "q8_0")]:
                out = work / f"llamacpp-{outtype}.gguf"
                out.unlink(missing_ok=True)
                w, r, _ = run_timed([*converter, "--outtype", outtype, "--outfile", str(out)], logfile, env)
                files["llama.cpp", outtype] = out
                timing.setdefault(("llama.cpp", outtype), []).append((w, r))
            if "q4_k_m" in variants:
                inter = work / f"llamacpp-{args.q4_from}.gguf"
                inter.unlink(missing_ok=True)
                w1, r1, _ = run_timed([*converter, "--outtype", args.q4_from, "--outfile", str(inter)], logfile, env)
                out = work / "llamacpp-q4_k_m.gguf"
                out.unlink(missing_ok=True)
                w2, r2, _ = run_timed([sys.executable, "-c", QUANT_CHILD, str(inter), str(out), str(Q4_K_M)], logfile)
                inter.unlink()
                files["llama.cpp", "q4_k_m"] = out
                timing.setdefault(("llama.cpp", "q4_k_m"), []).append((w1 + w2, max(r1, r2)))
            # hive-aot: GgufTarget().build in a child process
            for variant in variants:
                out_dir = work / f"ours-{variant}"
                shutil.rmtree(out_dir, ignore_errors=True)
                out_dir.mkdir()
                w, r, stdout = run_timed([sys.executable, "-c", OURS_CHILD, str(snap_json), RECIPES[variant],
                                          args.registry, str(out_dir)], logfile)
                res = json.loads(stdout.strip().splitlines()[-1])
                files["hive-aot", variant] = out_dir / res["file"]
                ours_info[variant] = res["info"]
                timing.setdefault(("hive-aot", variant), []).append((w, r))

        rows = []
        for variant in variants:
            for tool in ("llama.cpp", "hive-aot"):
                path = files[tool, variant]
                row = {"tool": tool, "variant": variant, "file": path.name, "size_mb": path.stat().st_size / 1e6,
                       **median_timing(timing[tool, variant])}
                if not args.no_validate:
                    from pipelines.targets.gguf.validate import validate_gguf

                    log(f"validating {tool} {variant}")
                    metrics, details = validate_gguf(snapshot, path)
                    row.update(metrics=metrics, tokenizer_mismatches=details["tokenizer_mismatches"],
                               generation=details["generation"]["artifact"])
                rows.append(row)
        by = {(r["tool"], r["variant"]): r for r in rows}
        cp = median_timing(timing["cp", "safetensors"])
        ratios, over_cp = {}, {}
        for variant in variants:
            o, t = by["hive-aot", variant], by["llama.cpp", variant]
            pairs = {"size_mb": (o["size_mb"], t["size_mb"]), "wall_s": (o["wall_s"], t["wall_s"]),
                     "peak_rss_mib": (o["peak_rss_mib"], t["peak_rss_mib"])}
            if "metrics" in o:
                pairs.update({k: (o["metrics"][k], t["metrics"][k])
                              for k in ("top1_agreement", "mean_kl", "max_abs_logit_delta", "token_parity")})
            ratios[variant] = {k: (a / b if b else None) for k, (a, b) in pairs.items()}
            over_cp[variant] = {tool: {"wall_s": by[tool, variant]["wall_s"] / cp["wall_s"],
                                       "peak_rss_mib": by[tool, variant]["peak_rss_mib"] / cp["peak_rss_mib"]}
                                for tool in ("hive-aot", "llama.cpp")}

        log("comparing tensors and metadata")
        tensors = {v: tensor_diff(files["hive-aot", v], files["llama.cpp", v]) for v in variants}
        meta = {v: metadata_diff(files["hive-aot", v], files["llama.cpp", v]) for v in variants}
        doc = {
            "model": str(model), "model_id": args.model_id, "runs": args.runs, "variants": list(variants),
            "weights_mib": weight_bytes / 2**20, "parameters": snapshot_parameters(shards),
            "host": {"cpus": os.cpu_count(), "loadavg_end": os.getloadavg()},
            "llama_cpp": {"version": LLAMA_CPP_VERSION, "converter": str(tree / "convert_hf_to_gguf.py"),
                          "venv": str(venv), "q4_k_m_from": args.q4_from,
                          "q4_k_m_timing": f"convert --outtype {args.q4_from} + llama_model_quantize, summed"},
            "cp": cp,
            "hive_aot_info": ours_info,
            "results": rows,
            "ratios_ours_over_llama_cpp": ratios,
            "ratios_over_cp": over_cp,
            "tensors_ours_vs_llama_cpp": tensors,
            "metadata_ours_vs_llama_cpp": meta,
            "work_dir": str(work) if args.keep else None,
        }
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    if args.json_out:
        args.json_out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    if args.json:
        print(json.dumps(doc, indent=1, default=str))
        return 0
    if args.markdown:
        print("\n".join(markdown_rows(doc)))
    else:
        print_report(doc)
    return 0


def markdown_rows(doc: dict[str, Any]) -> list[str]:
    """One row per variant: both tools' wall time and peak RSS, the ratios, cp's, tensor identity."""
    name = Path(doc["model"]).name
    cp = doc["cp"]
    rows = []
    for variant in doc["variants"]:
        o = next(r for r in doc["results"] if r["tool"] == "hive-aot" and r["variant"] == variant)
        t = next(r for r in doc["results"] if r["tool"] == "llama.cpp" and r["variant"] == variant)
        q = doc["ratios_ours_over_llama_cpp"][variant]
        td = doc["tensors_ours_vs_llama_cpp"][variant]
        same = td["identical"] == td["n_tensors"]["ours"] == td["n_tensors"]["llama_cpp"]
        quality = (f"{o['metrics']['top1_agreement']:.3f} / {o['metrics']['mean_kl']:.3g} (same)"
                   if "metrics" in o and o["metrics"] == t["metrics"] else
                   f"{o['metrics']['top1_agreement']:.3f} vs {t['metrics']['top1_agreement']:.3f}" if "metrics" in o else "-")
        rows.append(f"| {name} {variant} | {o['wall_s']:.2f} s / {o['peak_rss_mib']:.0f} MiB | "
                    f"{t['wall_s']:.2f} s / {t['peak_rss_mib']:.0f} MiB | **{q['wall_s']:.2f}x / {q['peak_rss_mib']:.2f}x** | "
                    f"{cp['wall_s']:.2f} s / {cp['peak_rss_mib']:.0f} MiB | "
                    f"{'all ' if same else ''}{td['identical']}"
                    f"{'' if same else ' of ' + str(td['n_tensors']['ours'])} identical | "
                    f"{quality} |")
    return rows


def snapshot_parameters(shards: list[str]) -> int:
    from pipelines.source.safetensors_io import read_header

    return sum(t.numel for p in shards for t in read_header(Path(p)).tensors.values())


def _fmt(x: Any, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def print_report(doc: dict[str, Any]) -> None:
    print(f"model {Path(doc['model']).name} ({doc['parameters']:,} parameters, {doc['weights_mib']:.0f} MiB of "
          f"safetensors); llama.cpp = llama-cpp-python {doc['llama_cpp']['version']} vendored converter; q4_k_m = "
          f"llama_model_quantize(ftype 15) of llama.cpp's {doc['llama_cpp']['q4_k_m_from']}; timings median of "
          f"{doc['runs']}")
    hdr = (f"{'variant':18} {'size MB':>8} {'top-1':>7} {'mean KL':>10} {'max|dlogit|':>11} {'tok parity':>10} "
           f"{'wall s':>7} {'RSS MiB':>8}")
    print(hdr)
    print("-" * len(hdr))
    cp = doc["cp"]
    print(f"{'cp safetensors':18} {doc['weights_mib'] * 2**20 / 1e6:8.1f} {'':7} {'':10} {'':11} {'':10} "
          f"{cp['wall_s']:7.2f} {cp['peak_rss_mib']:8.0f}")
    ratios = doc["ratios_ours_over_llama_cpp"]
    for variant in doc["variants"]:
        for r in doc["results"]:
            if r["variant"] != variant:
                continue
            m = r.get("metrics")
            quality = (f"{m['top1_agreement']:7.4f} {m['mean_kl']:10.3g} {m['max_abs_logit_delta']:11.4f} "
                       f"{m['token_parity']:10.3f}") if m else f"{'-':>7} {'-':>10} {'-':>11} {'-':>10}"
            print(f"{r['tool'] + ' ' + variant:18} {r['size_mb']:8.1f} {quality} {r['wall_s']:7.2f} "
                  f"{r['peak_rss_mib']:8.0f}")
        q = ratios[variant]
        print(f"{'  ours/llama.cpp':18} {_fmt(q['size_mb'], '8.3f')} {_fmt(q.get('top1_agreement'), '7.3f')} "
              f"{_fmt(q.get('mean_kl'), '10.3f')} {_fmt(q.get('max_abs_logit_delta'), '11.3f')} "
              f"{_fmt(q.get('token_parity'), '10.3f')} {_fmt(q['wall_s'], '7.2f')} {_fmt(q['peak_rss_mib'], '8.2f')}")
        c = doc["ratios_over_cp"][variant]
        print(f"{'  over cp':18} {'':8} {'':7} {'':10} {'':11} {'':10} "
              f"ours {c['hive-aot']['wall_s']:.1f}x wall, llama.cpp {c['llama.cpp']['wall_s']:.1f}x")
    print()
    for variant, t in doc["tensors_ours_vs_llama_cpp"].items():
        print(f"tensors {variant}: {t['identical']} identical, {len(t['differing'])} differing, "
              f"{len(t['type_mismatch'])} type-mismatched, {len(t['shape_mismatch'])} shape-mismatched, "
              f"only ours {len(t['only_ours'])}, only llama.cpp {len(t['only_llama_cpp'])} "
              f"(ours {t['types']['ours']}, llama.cpp {t['types']['llama_cpp']})")
        if variant in ("f16", "q8_0"):
            for d in t["differing"][:10]:
                print(f"  differs: {d['name']} ({d['type']}): {d['differing_bytes']} of {d['total_bytes']} bytes, "
                      f"max |dequantized diff| {d['max_abs_diff_dequantized']:.3g}")
            for d in t["type_mismatch"]:
                print(f"  type: {d['name']}: ours {d['ours']}, llama.cpp {d['llama_cpp']}")
            for d in t["shape_mismatch"]:
                print(f"  shape: {d['name']}: ours {d['ours']}, llama.cpp {d['llama_cpp']}")
            for n in t["only_ours"] + t["only_llama_cpp"]:
                print(f"  only in one file: {n}")
    print()
    base: dict[str, Any] = {}
    for variant, meta in doc["metadata_ours_vs_llama_cpp"].items():
        pre = meta["tokenizer_pre"]
        print(f"metadata {variant}: {meta['n_identical']} identical keys; tokenizer.ggml.pre ours {pre['ours']!r}, "
              f"llama.cpp {pre['llama_cpp']!r}" + ("" if variant == "f16" else "; other differences as f16 unless listed"))
        lines = [f"  only llama.cpp: {k} = {v!r}" for k, v in meta["only_llama_cpp"].items()]
        lines += [f"  only ours:      {k} = {v!r}" for k, v in meta["only_ours"].items()]
        for k, v in meta["differ"].items():
            extra = f" ({v['n_differing_entries']} entries differ)" if "n_differing_entries" in v else ""
            lines.append(f"  differs:        {k}: ours {v['ours']!r}, llama.cpp {v['llama_cpp']!r}{extra}")
        if variant == "f16":
            base = dict.fromkeys(lines)
            print("\n".join(lines))
        else:
            new = [ln for ln in lines if ln not in base]
            missing = [ln for ln in base if ln not in lines]
            print("\n".join(new + [f"  (no longer) {ln.strip()}" for ln in missing]) or "  (same as f16)")
    for r in doc["results"]:
        for mm in r.get("tokenizer_mismatches", []):
            print(f"token mismatch {r['tool']} {r['variant']}: {mm['text']!r}")


if __name__ == "__main__":
    sys.exit(main())
