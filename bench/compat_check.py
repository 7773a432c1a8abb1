"""Benchmark the compatibility check.

1. Classify every architecture in the database (time per architecture).
2. Header-only check of a >= 1 GB synthetic sharded Llama repo served by a loopback olah HF mirror
   (generated here, sparse files, never committed): wall time, and bytes fetched / repo size,
   against the anchor of downloading the repo (snapshot_download through the same mirror).

    .venv/bin/python bench/compat_check.py [--gb 1.0] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "support"))  # the test factories and the olah mirror helper


def classify_all() -> dict:
    from pipelines.compat import classify, database
    from pipelines.config.registry import Config

    config = Config.load(REPO / "registry.yaml")
    db = database.build(config.registry)
    base = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "vocab_size": 32000,
            "max_position_embeddings": 4096}
    t0 = time.perf_counter()
    statuses: dict[str, int] = {}
    for name in db.architectures:
        c = classify({"architectures": [name], **base}, registry=config.registry, recipes=config.recipes.values(),
                     files=["tokenizer.json"])
        statuses[c.status] = statuses.get(c.status, 0) + 1
    wall = time.perf_counter() - t0
    return {"architectures": len(db.architectures), "wall_s": wall, "per_arch_us": wall / len(db.architectures) * 1e6,
            "statuses": statuses}


def header_only(gb: float) -> dict:
    from factories import make_sharded_llama
    from hf_mirror import _stop, start_mirror

    work = Path(tempfile.mkdtemp(prefix="hive-bench-compat-"))
    try:
        layers = max(1, round(gb * 1e9 / 90.2e6))  # hidden 2048 / ffn 5632: ~90 MB of bf16 per layer
        src, params = make_sharded_llama(work / "src", hidden=2048, intermediate=5632, layers=layers, vocab=32000,
                                         heads=16, kv_heads=4, shards=4)
        (src / "tokenizer.json").write_text("{}")
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        mirror = start_mirror(work / "mirror")
        try:
            t = time.perf_counter()
            mirror.publish("bench/sharded-1g", src)
            publish_s = time.perf_counter() - t
            env = {**os.environ, "HF_ENDPOINT": mirror.endpoint, "HIVE_AOT_CACHE": str(work / "cache"),
                   "HF_HOME": str(work / "hf-home")}
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "check", "hf://bench/sharded-1g@main", "--json"],
                                  capture_output=True, text=True, env=env, cwd=REPO)
            check_s = time.perf_counter() - t
            if proc.returncode != 0:
                sys.exit(f"bench: check failed: {proc.stderr[-800:]}")
            doc = json.loads(proc.stdout)
            t = time.perf_counter()
            dl = subprocess.run([sys.executable, "-c", "import sys; from huggingface_hub import snapshot_download; "
                                 "snapshot_download('bench/sharded-1g', revision='main', local_dir=sys.argv[1])",
                                 str(work / "download")], capture_output=True, text=True, env=env)
            download_s = time.perf_counter() - t
            if dl.returncode != 0:
                sys.exit(f"bench: download anchor failed: {dl.stderr[-800:]}")
        finally:
            _stop(mirror.process)
        assert doc["estimated_requirements"]["parameters"] == params, "parameter count is not exact"
        return {"repo_weights_bytes": size, "parameters": params, "bytes_fetched": doc["bytes_fetched"],
                "fetched_fraction": doc["bytes_fetched"] / size, "check_wall_s": check_s,
                "download_wall_s": download_s, "publish_to_mirror_s": publish_s, "status": doc["status"]}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = {"classify_all": classify_all(), "header_only": header_only(args.gb)}
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    c, h = res["classify_all"], res["header_only"]
    print(f"classify every architecture: {c['architectures']} in {c['wall_s']:.2f} s "
          f"({c['per_arch_us']:.0f} us each) {c['statuses']}")
    print(f"header-only check of a {h['repo_weights_bytes'] / 1e9:.2f} GB sharded repo: {h['check_wall_s']:.2f} s "
          f"(CLI start included), fetched {h['bytes_fetched']:,} bytes = {h['fetched_fraction'] * 100:.4f}% of the weights; "
          f"exact parameters {h['parameters']:,}")
    print(f"anchor, full download of the same repo through the mirror: {h['download_wall_s']:.2f} s "
          f"-> header-only is {h['download_wall_s'] / h['check_wall_s']:.1f}x faster and fetches "
          f"{h['repo_weights_bytes'] / max(h['bytes_fetched'], 1):.0f}x fewer bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
