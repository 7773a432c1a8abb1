"""The Dagster layer: definitions load (`dg check defs`), the graph's shape, and the whole slice
materialized in-process on a tiny model with real checks and a real published manifest."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import yaml
from factories import copy_model

from pipelines.config import Config
from pipelines.orchestration.automation import onboard_job, registry_sensor
from pipelines.orchestration.factories import PARITY_CHECK, all_recipe_assets, artifact_key, published_key, source_assets
from pipelines.orchestration.partitions import models_partitions
from pipelines.orchestration.resources import HiveResource

REPO = Path.cwd()


def _registry(tmp: Path, models: list[dict]) -> Path:
    """The repo's registry and recipes plus a lossless f32 recipe (tiny random models have
    small logit margins, so the q8_0 threshold tuned on a real model is not what this tests)."""
    base = yaml.safe_load((REPO / "registry.yaml").read_text())
    base["models"] = models
    recipes = tmp / "recipes"
    shutil.copytree(REPO / "recipes", recipes, dirs_exist_ok=True)
    (recipes / "gguf-f32.yaml").write_text(yaml.safe_dump({
        "id": "gguf-f32", "kind": "gguf", "options": {"outtype": "f32"}, "runtime_profiles": ["llm-llamacpp-cpu"],
        "validation": {"min_top1_agreement": 0.99, "max_mean_kl": 0.001}}))
    base["recipes_dir"] = str(recipes)
    path = tmp / "registry.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


def test_dg_check_defs_loads_the_code_location():
    env = {**os.environ, "HIVE_AOT_REGISTRY": str(REPO / "registry.yaml")}
    dg_bin = Path(sys.executable).parent / "dg"
    proc = subprocess.run([str(dg_bin), "check", "defs"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_graph_snapshot():
    """Fails loudly when the asset graph changes by accident (keys, checks, job, automation)."""
    from pipelines.definitions import defs

    graph = defs.resolve_asset_graph()
    keys = sorted(k.to_user_string() for k in graph.get_all_asset_keys())
    recipes = sorted(Config.load(REPO / "registry.yaml").recipes)
    config = Config.load(REPO / "registry.yaml")
    compiles = [r for r in recipes if config.recipe(r).kind == "qaic"]
    assert compiles == ["qaic-embed-mxfp6", "qaic-fp16", "qaic-mxfp6"]
    assert keys == sorted(["snapshot", "compatibility"] + [f"artifact/{r}" for r in recipes]
                          + [f"published/{r}" for r in recipes] + [f"qpc/{r}" for r in compiles])
    for r in compiles:  # derived builds: the compile reads the published export; the QPC step needs an SDK host
        assert graph.get(artifact_key(r)).parent_keys == {dg.AssetKey("snapshot"), dg.AssetKey("compatibility"),
                                                          published_key("qaic-export")}
        assert graph.get(dg.AssetKey(["qpc", r])).parent_keys == {published_key(r)}
        assert graph.get(dg.AssetKey(["qpc", r])).pools == {"ai100_compile"}
    checks = sorted(f"{c.asset_key.to_user_string()}:{c.name}" for c in graph.asset_check_keys)
    assert checks == [f"artifact/{r}:{PARITY_CHECK}" for r in recipes]
    # Every validation and the whole-model ONNX export share the large-memory pool (limit 1, pools.py).
    assert {graph.assets_def_for_key(c).node_def.pool for c in graph.asset_check_keys} == {"validate_large"}
    for r in recipes:
        kind = config.recipe(r).kind
        assert graph.get(artifact_key(r)).pools == {"validate_large" if kind == "qaic-export" else f"build_{kind}"}
    for r in recipes:
        node = graph.get(artifact_key(r))
        assert node.partitions_def == models_partitions
        assert node.code_version == Config.load(REPO / "registry.yaml").recipe(r).digest[:16]
        assert graph.get(published_key(r)).parent_keys == {artifact_key(r)}
    assert defs.resolve_job_def("onboard") is not None
    assert [s.name for s in defs.sensors] == ["registry_sensor"]
    assert [s.name for s in defs.schedules] == ["revisions_schedule"]


def test_registry_sensor_adds_new_models_as_partitions(tmp_path, tiny_llama):
    reg = _registry(tmp_path, [{"id": "test/tiny", "source": str(tiny_llama), "recipes": ["gguf-f16"]}])
    instance = dg.DagsterInstance.ephemeral()
    ctx = dg.build_sensor_context(instance=instance, resources={"hive": HiveResource(registry=str(reg))})
    result = registry_sensor(ctx)
    assert [r.partition_key for r in result.run_requests] == ["test/tiny"]
    assert result.dynamic_partitions_requests[0].partition_keys == ["test/tiny"]
    instance.add_dynamic_partitions("models", ["test/tiny"])
    again = registry_sensor(dg.build_sensor_context(instance=instance, resources={"hive": HiveResource(registry=str(reg))}))
    assert again.run_requests == [] and again.dynamic_partitions_requests == []


def _run(reg: Path, store: Path, model_id: str):
    config = Config.load(reg)
    recipe_assets, checks = all_recipe_assets(config.recipes.values())
    defs = dg.Definitions(assets=source_assets() + recipe_assets, asset_checks=checks, jobs=[onboard_job],
                          resources={"hive": HiveResource(registry=str(reg), store=str(store))})
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("models", [model_id])
    return defs.resolve_job_def("onboard").execute_in_process(partition_key=model_id, instance=instance,
                                                              raise_on_error=False)


def test_materialize_whole_slice_publishes_and_checks(tmp_path, tiny_llama):
    reg = _registry(tmp_path, [{"id": "test/tiny", "source": str(tiny_llama), "recipes": ["gguf-f16", "gguf-f32"]}])
    store = tmp_path / "store"
    result = _run(reg, store, "test/tiny")
    assert result.success
    evals = {e.asset_key.path[-1]: e for e in result.get_asset_check_evaluations()}
    assert set(evals) == {"gguf-f16", "gguf-f32"}
    assert all(e.passed for e in evals.values())
    assert evals["gguf-f16"].metadata["top1_agreement"].value >= 0.99
    mats = {e.asset_key.to_user_string(): e.materialization.metadata for e in result.get_asset_materialization_events()}
    # q4_k_m is not requested for this model: nothing built, nothing published
    assert "artifact/gguf-q4_k_m" not in mats and "published/gguf-q4_k_m" not in mats
    assert mats["compatibility"]["status"].value == "compatible"
    for rid in ("gguf-f16", "gguf-f32"):
        md = mats[f"published/{rid}"]
        assert md["state"].value == "published"
        manifest_path = Path(md["manifest"].value.removeprefix("file://"))
        doc = json.loads(manifest_path.read_text())
        assert doc["build_id"] == md["build_id"].value == mats[f"artifact/{rid}"]["build_id"].value
        assert doc["validation"]["passed"] is True
        assert (store / "refs" / "test--tiny" / rid / "latest").is_file()
    # a second run rebuilds nothing
    again = _run(reg, store, "test/tiny")
    states = {e.asset_key.to_user_string(): e.materialization.metadata["state"].value
              for e in again.get_asset_materialization_events() if e.asset_key.path[0] == "published"}
    assert states == {"published/gguf-f16": "skipped", "published/gguf-f32": "skipped"}


def test_failing_check_blocks_publish(tmp_path, tiny_llama):
    """Gates no artifact can meet: the artifact builds, the blocking parity check fails, publish never runs."""
    reg = _registry(tmp_path, [{"id": "test/strict", "source": str(tiny_llama), "recipes": ["gguf-impossible"]}])
    (tmp_path / "recipes" / "gguf-impossible.yaml").write_text(yaml.safe_dump({
        "id": "gguf-impossible", "kind": "gguf", "options": {"outtype": "f16"}, "runtime_profiles": ["llm-llamacpp-cpu"],
        "validation": {"min_top1_agreement": 1.0, "max_mean_kl": 0.0, "max_abs_logit_delta": 0.0}}))
    store = tmp_path / "store"
    result = _run(reg, store, "test/strict")
    evals = result.get_asset_check_evaluations()
    assert len(evals) == 1 and not evals[0].passed
    assert "mean KL" in (evals[0].description or "")
    published = [e for e in result.get_asset_materialization_events() if e.asset_key == published_key("gguf-impossible")]
    assert published == []
    assert not (store / "manifests").exists() or not any((store / "manifests").rglob("*.json"))
    assert not (store / "refs").exists()


def test_nan_weights_fail_the_artifact_step_with_one_line(tmp_path, tiny_llama):
    """NaN weights are refused while converting: the artifact step fails with the engine's line."""
    from safetensors.torch import load_file, save_file

    bad = copy_model(tiny_llama, tmp_path / "nan-model")
    weights = load_file(str(bad / "model.safetensors"))
    name = next(k for k in weights if "q_proj" in k)
    weights[name][0, 0] = float("nan")
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    reg = _registry(tmp_path, [{"id": "test/nan", "source": str(bad), "recipes": ["gguf-f16"]}])
    store = tmp_path / "store"
    result = _run(reg, store, "test/nan")
    assert not result.success
    failures = [e.event_specific_data.error.message for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert len(failures) == 1 and f"tensor {name} has 1 non-finite value(s)" in failures[0]
    assert not (store / "refs").exists() and not (store / "manifests").exists()


def test_engine_crash_fails_the_check_with_one_line_and_publishes_nothing(tmp_path, tiny_llama, monkeypatch):
    """llama.cpp dying in validation (fault-injected SIGSEGV in its child) is the check's description."""
    monkeypatch.setenv("HIVE_AOT_FAULT", "GGUF validation:segv")
    reg = _registry(tmp_path, [{"id": "test/crash", "source": str(tiny_llama), "recipes": ["gguf-f16"]}])
    store = tmp_path / "store"
    result = _run(reg, store, "test/crash")
    (ev,) = result.get_asset_check_evaluations()
    assert not ev.passed
    assert ev.description == ("llama.cpp crashed with SIGSEGV (segmentation fault) during GGUF validation of "
                              "test/crash (gguf-f16); nothing was published")
    assert [e for e in result.get_asset_materialization_events() if e.asset_key == published_key("gguf-f16")] == []
    assert not (store / "refs").exists()


def test_memory_plan_refusal_fails_the_artifact_step_with_its_line_and_metadata(tmp_path, tiny_llama, monkeypatch):
    """A model the budget cannot hold: the artifact step fails before building, with the one-line refusal as its
    description and the memory plan in its failure metadata; nothing is published."""
    monkeypatch.setenv("HIVE_AOT_MEMORY_BUDGET", "1M")
    reg = _registry(tmp_path, [{"id": "test/toolarge", "source": str(tiny_llama), "recipes": ["gguf-f16"]}])
    store = tmp_path / "store"
    result = _run(reg, store, "test/toolarge")
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    data = failure.event_specific_data
    assert data.error.message.strip().endswith(
        "budget 1.0 MiB (HIVE_AOT_MEMORY_BUDGET); nothing was built"), data.error.message
    assert data.error.message.strip().startswith("dagster._core.definitions.events.Failure: gguf-f16 of test/toolarge: "
                                                 "step 'validate' needs ")
    md = data.user_failure_data.metadata
    plan = md["memory_plan"].value
    assert plan["fits"] is False and plan["budget"] == 1 << 20 and plan["model_id"] == "test/toolarge"
    assert [s["step"] for s in plan["steps"]] == ["convert", "publish", "reference", "validate"]
    assert md["peak_memory_estimate"].value == plan["peak_memory"] > 1 << 20
    assert not (store / "blobs").exists() or not any((store / "blobs").rglob("*.*"))
    assert not (store / "refs").exists() and not (store / "manifests").exists()
    assert not any((store / "staging").glob("*")) if (store / "staging").exists() else True


def test_pool_limits_are_applied_once_and_dead_claims_released(tmp_path):
    """validate_large gets limit 1 on a fresh instance, an operator's own limit is kept, and a slot held by a
    run whose onboarding process died (it would block every later validation) is freed; a live one's is not."""
    import socket

    from pipelines.orchestration.pools import HOST_TAG, PID_TAG, apply_pool_limits, release_dead_claims

    @dg.op
    def noop():
        pass

    @dg.job
    def tiny():
        noop()

    instance = dg.DagsterInstance.local_temp(str(tmp_path))
    assert apply_pool_limits(instance) == {"validate_large": 1}
    instance.event_log_storage.set_concurrency_slots("validate_large", 2)
    assert apply_pool_limits(instance) == {"validate_large": 2}
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    storage = instance.event_log_storage
    gone = instance.create_run_for_job(tiny, tags={HOST_TAG: socket.gethostname(), PID_TAG: str(dead.pid)})
    alive = instance.create_run_for_job(tiny, tags={HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())})
    for run in (gone, alive):
        storage.claim_concurrency_slot("validate_large", run.run_id, "noop")
    assert storage.get_concurrency_info("validate_large").active_run_ids == {gone.run_id, alive.run_id}
    assert release_dead_claims(instance) == [gone.run_id]
    assert storage.get_concurrency_info("validate_large").active_run_ids == {alive.run_id}
