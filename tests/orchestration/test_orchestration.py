"""The Dagster layer: definitions load (`dg check defs`), the graph's shape, and the whole slice
materialized in-process on a tiny model with real checks and a real published manifest."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml
from factories import copy_model, write_test_config

from pipelines.config.registry import Config
from pipelines.orchestration.automation import onboard_job, registry_sensor
from pipelines.orchestration.factories import (
    INTEGRITY_CHECK,
    PARITY_CHECK,
    all_recipe_assets,
    artifact_key,
    model_asset_keys,
    published_key,
    source_assets,
)
from pipelines.orchestration.quality import INLINE_MARKDOWN, KL_BINS, full_build_id
from pipelines.orchestration.resources import HiveResource
from pipelines.orchestration.summary import SUMMARY_KEY, summary_asset

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


SNAPSHOT = REPO / "tests" / "snapshots" / "dagster_graph.json"


def graph_snapshot(defs: dg.Definitions) -> dict:
    """What the code location declares, in a stable shape: every asset (deps, group, pools, partitions,
    code version, kinds, retries), every check (blocking, pool), the jobs, sensors and schedules."""
    graph = defs.resolve_asset_graph()
    assets = {}
    for key in sorted(graph.get_all_asset_keys(), key=lambda k: k.to_user_string()):
        node = graph.get(key)
        ad = graph.assets_def_for_key(key)
        retry = ad.op.retry_policy if ad.is_executable and ad.node_def is not None else None
        assets[key.to_user_string()] = {
            "deps": sorted(k.to_user_string() for k in node.parent_keys),
            "group": node.group_name, "pools": sorted(node.pools or []),
            "partitions": getattr(node.partitions_def, "name", None),
            "code_version": node.code_version, "kinds": sorted(node.kinds),
            "observable": node.is_observable, "retries": retry.max_retries if retry else 0,
        }
    checks = {}
    for ck in sorted(graph.asset_check_keys, key=lambda c: (c.asset_key.to_user_string(), c.name)):
        spec = graph.get_check_spec(ck)
        checks[f"{ck.asset_key.to_user_string()}:{ck.name}"] = {
            "blocking": spec.blocking, "pool": graph.assets_def_for_key(ck).node_def.pool,
            "partitions": getattr(spec.partitions_def, "name", None)}
    jobs = {j.name: sorted(k.to_user_string() for k in j.asset_layer.selected_asset_keys)
            for j in (defs.resolve_job_def(n) for n in ("onboard", "observe_revisions"))}
    return {
        "assets": assets, "checks": checks, "jobs": jobs,
        "sensors": {s.name: {"job": s.job_name, "default": s.default_status.value,
                             "interval_s": s.minimum_interval_seconds} for s in defs.sensors},
        "schedules": {s.name: {"job": s.job_name, "cron": s.cron_schedule, "default": s.default_status.value}
                      for s in defs.schedules},
    }


def _format_snapshot(snap: dict) -> str:
    """One line per asset, check, job, sensor and schedule: a change reads as a one-line diff in review."""
    parts = []
    for part in sorted(snap):
        rows = [f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(snap[part].items())]
        parts.append(f" {json.dumps(part)}: {{\n" + ",\n".join(rows) + "\n }")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def test_graph_matches_the_committed_snapshot():
    """The asset graph is a reviewed artifact: a change to assets, deps, checks, pools, partitions, code
    versions (recipe hashes), jobs or automation must update tests/snapshots/dagster_graph.json on purpose
    (`HIVE_AOT_UPDATE_SNAPSHOTS=1 pytest tests/orchestration/test_orchestration.py -k snapshot`) and shows in review."""
    from pipelines.definitions import defs

    current = graph_snapshot(defs)
    if os.environ.get("HIVE_AOT_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text(_format_snapshot(current))
    committed = json.loads(SNAPSHOT.read_text())
    for part in ("assets", "checks", "jobs", "sensors", "schedules"):
        added = sorted(set(current[part]) - set(committed[part]))
        removed = sorted(set(committed[part]) - set(current[part]))
        changed = sorted(k for k in set(current[part]) & set(committed[part]) if current[part][k] != committed[part][k])
        assert not (added or removed or changed), (
            f"{part} differ from {SNAPSHOT.name}: added {added}, removed {removed}, changed "
            f"{[(k, committed[part][k], current[part][k]) for k in changed][:3]}")


def test_snapshot_invariants():
    """Properties of the committed graph a reviewer relies on, read from the snapshot file (not re-derived
    from the config under test): every recipe's publish sits behind its blocking parity check."""
    snap = json.loads(SNAPSHOT.read_text())
    recipes = sorted(k.split("/", 1)[1] for k in snap["assets"] if k.startswith("artifact/"))
    # assets for the recipes registry.yaml's models list and the inputs those are built from, and no other
    # (HIVE_AOT_DAGSTER_RECIPES=used): "Materialize all" offers nothing no model uses
    listed = {r for m in yaml.safe_load((REPO / "registry.yaml").read_text())["models"] for r in m["recipes"]}
    inputs = {yaml.safe_load((REPO / "recipes" / f"{r}.yaml").read_text()).get("input") for r in listed} - {None}
    assert set(recipes) == listed | inputs and listed, (recipes, listed, inputs)
    # the model's summary comes after every publish (and compile) step
    assert snap["assets"]["summary"]["deps"] == sorted(
        k for k in snap["assets"] if k.startswith(("published/", "qpc/")))
    for r in recipes:
        check = snap["checks"][f"artifact/{r}:{PARITY_CHECK}"]
        assert check == {"blocking": True, "pool": "validate_large", "partitions": "models"}
        # the integrity check holds no model: no pool, it never waits behind a validation
        assert snap["checks"][f"artifact/{r}:{INTEGRITY_CHECK}"] == {"blocking": True, "pool": None, "partitions": "models"}
        assert snap["assets"][f"published/{r}"]["deps"] == [f"artifact/{r}"]
        assert snap["assets"][f"published/{r}"]["retries"] > 0
        assert snap["assets"][f"artifact/{r}"]["code_version"]
    assert snap["assets"]["snapshot"]["deps"] == ["upstream_revision"]
    assert snap["assets"]["upstream_revision"]["observable"] is True
    assert "upstream_revision" not in snap["jobs"]["onboard"] and snap["jobs"]["observe_revisions"] == ["upstream_revision"]
    assert all(s["default"] == "STOPPED" for s in [*snap["sensors"].values(), *snap["schedules"].values()])
    assert {a["pools"][0] for k, a in snap["assets"].items() if k.startswith("qpc/")} == {"ai100_compile"}


def test_recipes_get_assets_where_a_model_uses_them_unless_all_are_asked_for(tmp_path, monkeypatch):
    """HIVE_AOT_DAGSTER_RECIPES: `used` (the default) makes assets for the recipes the registry's models list and
    the inputs those are built from; `all` for every recipe file; anything else is one line naming the choices."""
    from pipelines.core.settings import SettingError
    from pipelines.orchestration.recipe_selection import recipes_in_code_location

    reg = _registry(tmp_path, [{"id": "test/a", "source": str(tmp_path), "recipes": ["gguf-f32", "qaic-mxfp6"]},
                               {"id": "test/b", "source": str(tmp_path), "recipes": ["gguf-f32"]}])
    config = Config.load(reg)
    assert [r.id for r in recipes_in_code_location(config)] == ["gguf-f32", "qaic-export", "qaic-mxfp6"]
    monkeypatch.setenv("HIVE_AOT_DAGSTER_RECIPES", "all")
    assert [r.id for r in recipes_in_code_location(config)] == sorted(config.recipes) and len(config.recipes) > 20
    monkeypatch.setenv("HIVE_AOT_DAGSTER_RECIPES", "some")
    with pytest.raises(SettingError) as refused:
        recipes_in_code_location(config)
    assert str(refused.value) == "HIVE_AOT_DAGSTER_RECIPES='some': expected one of used, all"


def test_registry_sensor_adds_new_models_as_partitions(tmp_path, tiny_llama):
    reg = _registry(tmp_path, [{"id": "test/tiny", "source": str(tiny_llama), "recipes": ["gguf-f16"]}])
    instance = dg.DagsterInstance.ephemeral()
    ctx = dg.build_sensor_context(instance=instance, resources={"hive": HiveResource(registry=str(reg))})
    result = registry_sensor(ctx)
    assert [r.partition_key for r in result.run_requests] == ["test/tiny"]
    assert result.dynamic_partitions_requests[0].partition_keys == ["test/tiny"]
    instance.add_dynamic_partitions("models", ["test/tiny"])
    again = registry_sensor(dg.build_sensor_context(instance=instance, resources={"hive": HiveResource(registry=str(reg))}))
    assert not again.run_requests and not again.dynamic_partitions_requests
    assert again.skip_reason.skip_message == f"no new models in {reg}"


def _run(reg: Path, store: Path, model_id: str, everything: bool = False, instance: dg.DagsterInstance | None = None,
         summary_only: bool = False):
    """One onboarding run of a model: the assets of its recipes, as the CLI and sensors request them (or every
    asset, as a launch of the whole job from the UI does; or its summary alone)."""
    config = Config.load(reg)
    recipes = list(config.recipes.values())
    recipe_assets, checks = all_recipe_assets(recipes)
    defs = dg.Definitions(assets=source_assets() + recipe_assets + [summary_asset(recipes)], asset_checks=checks,
                          jobs=[onboard_job],
                          resources={"hive": HiveResource(registry=str(reg), store=str(store))})
    instance = instance or dg.DagsterInstance.ephemeral()
    if model_id not in instance.get_dynamic_partitions("models"):
        instance.add_dynamic_partitions("models", [model_id])
    selection = [SUMMARY_KEY] if summary_only else (
        None if everything else model_asset_keys(config, config.registry.model(model_id)))
    return defs.resolve_job_def("onboard").execute_in_process(partition_key=model_id, instance=instance,
                                                              raise_on_error=False, asset_selection=selection)


SVG = "{http://www.w3.org/2000/svg}"


def _chart(value: str, alt: str):
    """The SVG document a Markdown chart entry embeds as a data: image (parsed: it must be well-formed XML)."""
    import urllib.parse
    import xml.etree.ElementTree as ET

    prefix = f"![{alt}](<data:image/svg+xml,"
    assert value.startswith(prefix) and value.endswith(">)"), value[:80]
    escaped = value[len(prefix):-2]  # the angle-bracket destination's \< \> \\ escapes, then the URI's %-escapes
    svg = urllib.parse.unquote(re.sub(r"\\(.)", r"\1", escaped))
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return root


def _warnings(instance: dg.DagsterInstance, result, caplog) -> list[str]:
    """What the run logged at WARNING or above: user code in the event log, Dagster's executor through Python
    logging (where a blocking check that "emitted no result" is reported)."""
    return ([e.user_message for e in instance.all_logs(result.run_id) if e.level >= 30]
            + [r.getMessage() for r in caplog.records if r.levelno >= 30 and r.name.startswith("dagster")])


def test_materialize_whole_slice_publishes_and_checks(tmp_path, tiny_llama, caplog, monkeypatch):
    monkeypatch.setenv("HIVE_AOT_CACHE", str(tmp_path / "cache"))  # the reference computed here (its rate below)
    reg = _registry(tmp_path, [{"id": "test/tiny", "source": str(tiny_llama), "recipes": ["gguf-f16", "gguf-f32"]}])
    store = tmp_path / "store"
    instance = dg.DagsterInstance.ephemeral()
    caplog.set_level("WARNING")
    result = _run(reg, store, "test/tiny", instance=instance)
    assert result.success
    evals = {e.asset_key.path[-1]: e for e in result.get_asset_check_evaluations() if e.check_name == PARITY_CHECK}
    intact = {e.asset_key.path[-1]: e.passed for e in result.get_asset_check_evaluations()
              if e.check_name == INTEGRITY_CHECK}
    assert intact == {"gguf-f16": True, "gguf-f32": True}
    assert set(evals) == {"gguf-f16", "gguf-f32"}
    assert all(e.passed for e in evals.values())
    f16 = evals["gguf-f16"].metadata
    assert f16["top1_agreement"].value >= 0.99
    # each gate's value against its threshold, as visible text (gguf-f16: top-1 >= 0.99, mean KL <= 0.001)
    assert f16["gate: top-1 agreement"].value == f"{f16['top1_agreement'].value:.4f} ≥ 0.99: pass"
    assert f16["gate: mean KL"].value == f"{f16['mean_kl'].value:.5f} ≤ 0.001: pass"
    # the per-position KL chart: an SVG image small enough for the UI to show in place, two curves (the mean and
    # the worst of the parity prompts at each run of positions)
    prompts = f16["parity"].value.records  # the parity table: one record per prompt
    assert len(f16["kl_by_position"].value) < INLINE_MARKDOWN
    chart = _chart(f16["kl_by_position"].value, "KL by position")
    assert {f"mean of {len(prompts)} prompts", "worst"} <= {t.text for t in chart.iter(f"{SVG}text")}
    curves = [p for p in chart.iter(f"{SVG}path") if p.get("stroke") != "gray"]
    assert len(curves) == 2 and all(1 < len(c.get("d").split()) + 1 <= max(KL_BINS) for c in curves)  # points
    # the same measurement recorded on the artifact's partition, with the thresholds beside the values
    (seen,) = [e for e in instance.get_records_for_run(result.run_id, of_type=dg.DagsterEventType.ASSET_OBSERVATION
                                                         ).records
               if e.event_log_entry.dagster_event.asset_key == artifact_key("gguf-f16")]
    observed = seen.event_log_entry.asset_observation.metadata
    assert observed["validation"].value == "passed: within thresholds"
    gates = {r.data["metric"]: r.data for r in observed["quality"].value.records}
    assert gates["top-1 agreement"] == {"metric": "top-1 agreement", "value": f"{f16['top1_agreement'].value:.4f}",
                                        "threshold": "≥ 0.99", "pass": True}
    assert observed["mean_kl"].value == f16["mean_kl"].value
    # the rates each step reached: the artifact step's conversion (source bytes) and upload, the check's engine run
    # and, for the first of the two recipes only, the reference (the second reads it from the cache)
    for e in result.get_asset_materialization_events():
        if e.asset_key in (artifact_key("gguf-f16"), artifact_key("gguf-f32")):
            rates = e.materialization.metadata["step_rates"].value
            assert set(rates) == {"convert", "publish"} and rates["convert"]["bytes_per_s"] > 0, rates
    check_rates = [e.metadata["step_rates"].value for e in evals.values()]
    assert all(r["validate"]["flop_per_s"] > 0 for r in check_rates)
    assert sorted("reference" in r for r in check_rates) == [False, True], check_rates
    mats = {e.asset_key.to_user_string(): e.materialization.metadata for e in result.get_asset_materialization_events()}
    # the model's summary: one row per recipe it lists, in its order, and size against quality
    rows = [r.data for r in mats["summary"]["recipes"].value.records]
    assert [(r["recipe"], r["state"]) for r in rows] == [("gguf-f16", "published"), ("gguf-f32", "published")]
    assert rows[0]["top1"] == f"{f16['top1_agreement'].value:.4f}" and rows[0]["size"].endswith("MiB")
    scatter = _chart(mats["summary"]["size_vs_quality"].value, "size against mean KL")
    (passed,) = [p.get("d") for p in scatter.iter(f"{SVG}path") if p.get("stroke-linecap") == "round"]
    assert passed.count("M") == 2 and {"gguf-f16", "gguf-f32"} <= {t.text for t in scatter.iter(f"{SVG}text")}
    assert mats["summary"]["published"].value == "2 of 2 recipes"
    # q4_k_m is not requested for this model: no step of it is even scheduled, so no blocking check of it
    # "emitted no result" and Dagster warns of nothing
    assert "artifact/gguf-q4_k_m" not in mats and "published/gguf-q4_k_m" not in mats
    steps = {e.step_key for e in result.all_events if e.event_type_value == "STEP_SUCCESS"}
    assert steps == {"snapshot", "compatibility", "artifact__gguf_f16", "artifact__gguf_f32", "published__gguf_f16",
                     "published__gguf_f32", "artifact__gguf_f16_numerical_parity", "artifact__gguf_f32_numerical_parity",
                     "artifact__gguf_f16_integrity", "artifact__gguf_f32_integrity", "summary"}
    assert _warnings(instance, result, caplog) == []
    assert mats["published/gguf-f16"]["size"].value.endswith("MiB")
    assert mats["published/gguf-f16"]["serving_command"].value.startswith("hive-aot serve test/tiny@")
    assert mats["compatibility"]["status"].value == "compatible"
    for rid in ("gguf-f16", "gguf-f32"):
        md = mats[f"published/{rid}"]
        assert md["state"].value == "published"
        manifest_path = Path(md["manifest"].value.removeprefix("file://"))
        doc = json.loads(manifest_path.read_text())
        assert doc["build_id"] == md["build_id"].value == full_build_id(mats[f"artifact/{rid}"])
        # the artifact shows the id cut to 12 hex digits, its files as a table
        assert mats[f"artifact/{rid}"]["build_id"].value == doc["build_id"][:12]
        (gguf,) = [r.data for r in mats[f"artifact/{rid}"]["files"].value.records]
        assert (gguf["path"], gguf["bytes"], gguf["sha256"]) == (doc["files"][0]["path"], doc["files"][0]["size"],
                                                                 doc["files"][0]["sha256"][:12])
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
    instance = dg.DagsterInstance.ephemeral()
    result = _run(reg, store, "test/strict", instance=instance)
    evals = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert set(evals) == {PARITY_CHECK, INTEGRITY_CHECK} and evals[INTEGRITY_CHECK].passed
    assert not evals[PARITY_CHECK].passed and "mean KL" in (evals[PARITY_CHECK].description or "")
    published = [e for e in result.get_asset_materialization_events() if e.asset_key == published_key("gguf-impossible")]
    assert published == []
    assert not (store / "manifests").exists() or not any((store / "manifests").rglob("*.json"))
    assert not (store / "refs").exists()
    # the run skipped the summary (downstream of the blocked publish); alone, it reads the rejection recorded
    assert SUMMARY_KEY not in {e.asset_key for e in result.get_asset_materialization_events()}
    alone = _run(reg, store, "test/strict", instance=instance, summary_only=True)
    (summary,) = alone.get_asset_materialization_events()
    (row,) = [r.data for r in summary.materialization.metadata["recipes"].value.records]
    assert row["state"] == "rejected" and row["note"] == evals[PARITY_CHECK].description


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
    instance = dg.DagsterInstance.ephemeral()
    result = _run(reg, store, "test/nan", instance=instance)
    assert not result.success
    failures = [e.event_specific_data.error.message for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert len(failures) == 1 and f"tensor {name} has 1 non-finite value(s)" in failures[0]
    assert not (store / "refs").exists() and not (store / "manifests").exists()
    # the model's summary, materialized alone after the failed run, says which step failed and why
    (summary,) = _run(reg, store, "test/nan", instance=instance, summary_only=True).get_asset_materialization_events()
    (row,) = [r.data for r in summary.materialization.metadata["recipes"].value.records]
    assert row["state"] == "failed" and f"tensor {name} has 1 non-finite value(s)" in row["note"], row


def test_engine_crash_fails_the_check_with_one_line_and_publishes_nothing(tmp_path, tiny_llama, monkeypatch):
    """llama.cpp dying in validation (fault-injected SIGSEGV in its child) is the check's description."""
    monkeypatch.setenv("HIVE_AOT_FAULT", "GGUF validation:segv")
    reg = _registry(tmp_path, [{"id": "test/crash", "source": str(tiny_llama), "recipes": ["gguf-f16"]}])
    store = tmp_path / "store"
    result = _run(reg, store, "test/crash")
    (ev,) = [e for e in result.get_asset_check_evaluations() if e.check_name == PARITY_CHECK]
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
    md = data.user_failure_data.metadata
    plan = md["memory_plan"].value
    peak = max(plan["steps"], key=lambda s: s["memory"])["step"]  # the line names the step that needs the most
    assert data.error.message.strip().startswith("dagster._core.definitions.events.Failure: gguf-f16 of test/toolarge: "
                                                 f"step '{peak}' needs ")
    assert plan["fits"] is False and plan["budget"] == 1 << 20 and plan["model_id"] == "test/toolarge"
    assert [s["step"] for s in plan["steps"]] == ["convert", "publish", "reference", "validate"]
    assert plan["peak_memory"] > 1 << 20 and "peak_memory_estimate" not in md  # the peak once, in binary units:
    assert md["peak_memory"].value.startswith(f"{plan['peak_memory_human']} (step {peak}, budget 1.0 MiB")
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


def test_onboard_refuses_a_recipe_that_does_not_apply_before_any_run(tmp_path, tiny_llama, monkeypatch):
    """Red team round two, item 20: a recipe that does not apply to a listed model was found only after a 17 s
    Dagster run. A local model's recipes are planned first (config and headers, nothing hashed)."""
    import time

    from pipelines.orchestration.onboard import onboard

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    reg = write_test_config(tmp_path / "cfg", REPO, models=[
        {"id": "test/tiny", "source": str(tiny_llama), "recipes": ["qaic-embed-mxfp6"]}])
    started = time.monotonic()
    res = onboard(registry=str(reg), store=str(tmp_path / "store"))
    took = time.monotonic() - started
    assert not res.success
    (row,) = res.results
    assert row.recipe == "qaic-embed-mxfp6" and row.state == "failed" and "does not apply" in row.error
    import dagster as dg

    assert dg.DagsterInstance.get().get_runs() == []  # refused without a Dagster run
    print(f"refused in {took:.2f} s")
