"""No-op onboarding (`hive-aot onboard`): N registered models x 3 recipes, every build id already published.

    .venv/bin/python bench/onboard_noop.py [--models 5,10,20] [--json-out FILE]

Each model is its own copy of one tiny synthetic Llama (`pipelines.model.synthetic --preset tiny`, with its own
SentencePiece tokenizer) under its own id, so every (model, recipe) is a distinct build id. The store is
filled once by `hive-aot onboard` of all models (not timed); then, for each N, `hive-aot onboard` of a
registry listing N of them is timed as a child process (wall: Python start-up, definitions, one Dagster run
per model that has work, each run's fetch + classification + builds). An unchanged model is answered before
any run (`build.unchanged`), so the no-op's cost is the CLI's start-up plus a plan and a few store reads per recipe.

The anchor is the engine alone doing the same no-op (`hive-aot build` of one model x recipe, which plans,
finds the build id published and skips): the ratio says what onboarding adds per model over it.
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

import yaml

ROOT = Path(__file__).resolve().parent.parent
HIVE = Path(sys.executable).parent / "hive-aot"
RECIPES = ["gguf-f16", "gguf-q8_0", "gguf-f32"]
# Gates loose enough for random weights: this measures orchestration, not numerics (the suite checks those).
LOOSE = {"min_top1_agreement": 0.0, "max_mean_kl": 100.0}


def write_config(work: Path, models: list[str]) -> Path:
    recipes = work / "recipes"
    recipes.mkdir(exist_ok=True)
    for rid, outtype in (("gguf-f16", "f16"), ("gguf-q8_0", "q8_0"), ("gguf-f32", "f32")):
        (recipes / f"{rid}.yaml").write_text(yaml.safe_dump({
            "id": rid, "kind": "gguf", "options": {"outtype": outtype}, "runtime_profiles": ["llm-llamacpp-cpu"],
            "validation": LOOSE}))
    reg = yaml.safe_load((ROOT / "registry.yaml").read_text())
    reg.update(recipes_dir=str(recipes), models=[
        {"id": m, "source": str(work / "models" / m.split("/")[1]), "recipes": RECIPES} for m in models])
    path = work / f"registry-{len(models)}.yaml"
    path.write_text(yaml.safe_dump(reg))
    return path


def run(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd[:3])} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return wall, proc


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="5,10,20", help="registry sizes to time, comma-separated")
    ap.add_argument("--runs", type=int, default=2, help="timed runs per size (median)")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    sizes = sorted(int(n) for n in args.models.split(","))
    work = Path(tempfile.mkdtemp(prefix="bench-onboard-"))
    env = {**os.environ, "DAGSTER_HOME": str(work / "dagster"), "HIVE_AOT_CACHE": str(work / "cache"),
           "HIVE_AOT_STORE": str(work / "store")}
    env.pop("HIVE_AOT_REGISTRY", None)
    try:
        base = work / "models" / "base"
        subprocess.run([sys.executable, "-m", "pipelines.model.synthetic", "--preset", "tiny", "--out", str(base)],
                       cwd=ROOT, check=True, capture_output=True)
        ids = [f"bench/m{i:02d}" for i in range(max(sizes))]
        for m in ids:
            shutil.copytree(base, work / "models" / m.split("/")[1])
        full = write_config(work, ids)
        t0 = time.perf_counter()
        run([str(HIVE), "onboard", "--registry", str(full), "--json"], env, work)
        populate = time.perf_counter() - t0
        print(f"populated {len(ids)} models x {len(RECIPES)} recipes in {populate:.1f} s", file=sys.stderr)

        rows = []
        for n in sizes:
            reg = write_config(work, ids[:n])
            walls = []
            for _ in range(args.runs):
                wall, proc = run([str(HIVE), "onboard", "--registry", str(reg), "--json"], env, work)
                doc = json.loads(proc.stdout)
                states = {r["state"] for r in doc["results"]}
                assert states == {"skipped"}, f"not a no-op: {states}"
                assert len(doc["results"]) == n * len(RECIPES)
                walls.append(wall)
            rows.append({"models": n, "builds": n * len(RECIPES), "wall_s": round(statistics.median(walls), 2)})
            print(f"{n:3} models: {rows[-1]['wall_s']:.2f} s", file=sys.stderr)

        # anchor: the engine's own no-op, one `hive-aot build` per (model, recipe) of one model
        anchor_walls = []
        for rid in RECIPES:
            wall, proc = run([str(HIVE), "build", str(work / "models" / "m00"), "--recipe", rid, "--model-id",
                              ids[0], "--registry", str(full), "--json"], env, work)
            assert json.loads(proc.stdout)["skipped"] is True
            anchor_walls.append(wall)
        anchor_model = sum(anchor_walls)

        small, large = rows[0], rows[-1]
        per_model = (large["wall_s"] - small["wall_s"]) / (large["models"] - small["models"])
        fixed = small["wall_s"] - per_model * small["models"]
        doc = {
            "recipes": RECIPES, "rows": rows, "populate_s": round(populate, 1),
            "per_model_s": round(per_model, 3), "fixed_s": round(fixed, 2),
            "growth": round(large["wall_s"] / small["wall_s"], 2),
            "anchor_engine_noop_per_model_s": round(anchor_model, 2),
            "per_model_vs_engine_noop": round(per_model / anchor_model, 2),
        }
        print("\n| models | builds | wall | per model |\n| --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['models']} | {r['builds']} | {r['wall_s']:.2f} s | {r['wall_s'] / r['models']:.2f} s |")
        print(f"\nmarginal cost per model {per_model:.3f} s (fixed {fixed:.2f} s); {large['models']} vs "
              f"{small['models']} models: {doc['growth']:.2f}x wall")
        print(f"anchor: the engine's no-op of one model x {len(RECIPES)} recipes as 3 `hive-aot build` processes: "
              f"{anchor_model:.2f} s; onboarding's marginal per model / that: {doc['per_model_vs_engine_noop']:.2f}x")
        if args.json_out:
            args.json_out.write_text(json.dumps(doc, indent=1) + "\n")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
