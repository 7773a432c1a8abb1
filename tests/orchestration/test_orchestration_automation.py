"""Onboarding automation on real ephemeral Dagster instances: the registry sensor (new, malformed, retired
models), run requests that name only a model's recipes, the revision observation and the sensor that rebuilds
what changed upstream, the schedule, and `hive-aot onboard`'s one-line failures."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml
from factories import SMOLLM2_PRE, copy_model, make_llama, rewrite_safetensors

from pipelines.config.registry import Config
from pipelines.orchestration.automation import (
    observe_revisions_job,
    onboard_job,
    recipe_sensor,
    registry_sensor,
    revision_sensor,
    revisions_schedule,
)
from pipelines.orchestration.factories import SNAPSHOT_KEY, UPSTREAM_KEY, all_recipe_assets, source_assets
from pipelines.orchestration.resources import HiveResource
from pipelines.orchestration.summary import summary_asset

REPO = Path.cwd()
F32 = {"id": "gguf-f32", "kind": "gguf", "options": {"outtype": "f32"}, "runtime_profiles": ["llm-llamacpp-cpu"],
       "validation": {"min_top1_agreement": 0.99, "max_mean_kl": 0.001}}


@pytest.fixture(scope="module")
def tiny_llama(smollm2_small_vocab_dir, tmp_path_factory) -> Path:
    """A 2-layer random Llama on SmolLM2's BPE cut to 2,048 tokens (the full vocabulary is most of a tiny
    model's conversion and validation; what these tests check is the automation around them)."""
    return make_llama(tmp_path_factory.mktemp("models") / "tiny-llama", smollm2_small_vocab_dir)


def write_registry(tmp: Path, models: list[dict], extra_recipes: list[dict] = ()) -> Path:
    """The repo's registry and recipes (plus a lossless f32 recipe: tiny random models have small logit margins).
    GGUF recipes name the cut vocabulary's pre-tokenizer (its check hash is not llama.cpp's SmolLM2 one)."""
    base = yaml.safe_load((REPO / "registry.yaml").read_text())
    recipes = tmp / "recipes"
    if not recipes.exists():
        shutil.copytree(REPO / "recipes", recipes)
    for r in [F32, *extra_recipes]:
        (recipes / f"{r['id']}.yaml").write_text(yaml.safe_dump(r))
    for path in recipes.glob("*.yaml"):
        data = yaml.safe_load(path.read_text())
        if data.get("kind") == "gguf":
            data["options"] = {**(data.get("options") or {}), "bpe_pre_fallback": SMOLLM2_PRE}
            path.write_text(yaml.safe_dump(data, sort_keys=False))
    base.update(models=models, recipes_dir=str(recipes))
    path = tmp / "registry.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


def sensor_context(instance, reg: Path, store: Path | None = None):
    return dg.build_sensor_context(instance=instance, resources={"hive": HiveResource(
        registry=str(reg), store=str(store or ""))})


def definitions(reg: Path, store: Path) -> dg.Definitions:
    config = Config.load(reg)
    recipe_assets, checks = all_recipe_assets(config.recipes.values())
    return dg.Definitions(assets=source_assets() + recipe_assets + [summary_asset(list(config.recipes.values()))],
                          asset_checks=checks,
                          jobs=[onboard_job, observe_revisions_job],
                          resources={"hive": HiveResource(registry=str(reg), store=str(store))})


def run_request(defs: dg.Definitions, instance, request: dg.RunRequest):
    """Execute a sensor's run request as the daemon would: its partition and its asset selection."""
    return defs.resolve_job_def("onboard").execute_in_process(
        partition_key=request.partition_key, asset_selection=request.asset_selection, instance=instance,
        tags=request.tags, raise_on_error=False)


def onboard_with_the_sensor(reg: Path, store: Path):
    """A fresh instance where the registry sensor's first tick added every model and its requests ran."""
    defs = definitions(reg, store)
    instance = dg.DagsterInstance.ephemeral()
    first = registry_sensor(sensor_context(instance, reg))
    instance.add_dynamic_partitions("models", first.dynamic_partitions_requests[0].partition_keys)
    for request in first.run_requests:
        assert run_request(defs, instance, request).success
    return defs, instance


def warnings_of(instance, result) -> list[str]:
    """What a run logged at WARNING or above in the instance (user code's context.log)."""
    return [e.user_message for e in instance.all_logs(result.run_id) if e.level >= 30]


def no_result_warnings(caplog) -> list[str]:
    """Dagster's executor warns through Python logging (not the event log) when a blocking check emits nothing."""
    return [r.getMessage() for r in caplog.records if "emitted no result" in r.getMessage()]


# --- registry sensor ---------------------------------------------------------------------------------------


def test_new_models_are_requested_with_only_their_recipes(tmp_path, tiny_llama):
    reg = write_registry(tmp_path, [{"id": "test/a", "source": str(tiny_llama), "recipes": ["gguf-f16"]},
                                    {"id": "test/b", "source": str(tiny_llama), "recipes": ["qaic-mxfp6"]}])
    instance = dg.DagsterInstance.ephemeral()
    result = registry_sensor(sensor_context(instance, reg))
    assert result.dynamic_partitions_requests[0].partition_keys == ["test/a", "test/b"]
    by_key = {r.partition_key: r for r in result.run_requests}
    assert [k.to_user_string() for k in by_key["test/a"].asset_selection] == [
        "snapshot", "compatibility", "artifact/gguf-f16", "published/gguf-f16", "summary"]
    # a compile recipe brings the export it is built from, and its QPC step
    assert [k.to_user_string() for k in by_key["test/b"].asset_selection] == [
        "snapshot", "compatibility", "artifact/qaic-export", "published/qaic-export", "artifact/qaic-mxfp6",
        "published/qaic-mxfp6", "qpc/qaic-mxfp6", "summary"]
    assert by_key["test/a"].run_key == "onboard:test/a" and by_key["test/a"].tags["hive-aot/trigger"] == "registry"


@pytest.mark.parametrize("text, says", [
    ("models: [\n  {id: test/a", "registry.yaml"),  # YAML that does not parse
    ("models:\n- {id: test/a, recipes: []}\n", "models.0.recipes"),  # a field that fails validation
    ("models:\n- {id: 'test/a|b', recipes: [gguf-f16]}\n", "models.0.id"),  # a key Dagster cannot carry
    ("models:\n- {id: test/a, recipes: [gguf-nope]}\n", "unknown recipe 'gguf-nope'"),
])
def test_a_malformed_registry_adds_nothing_says_where_and_the_next_tick_recovers(tmp_path, tiny_llama, text, says):
    good = write_registry(tmp_path, [{"id": "test/a", "source": str(tiny_llama), "recipes": ["gguf-f16"]}])
    good_text = good.read_text()
    doc = yaml.safe_load(good_text)
    doc.pop("models")
    good.write_text(yaml.safe_dump(doc) + text)
    instance = dg.DagsterInstance.ephemeral()
    result = registry_sensor(sensor_context(instance, good))
    assert not result.run_requests and not result.dynamic_partitions_requests
    message = result.skip_reason.skip_message
    assert message.startswith("registry not read: ") and says in message and "\n" not in message
    assert instance.get_dynamic_partitions("models") == []
    good.write_text(good_text)  # fixed: the same sensor's next tick reads the file again
    assert [r.partition_key for r in registry_sensor(sensor_context(instance, good)).run_requests] == ["test/a"]


def test_a_removed_model_is_reported_retired_and_its_partition_kept(tmp_path, tiny_llama):
    reg = write_registry(tmp_path, [{"id": "test/a", "source": str(tiny_llama), "recipes": ["gguf-f16"]}])
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("models", ["test/a", "test/gone"])
    result = registry_sensor(sensor_context(instance, reg))
    assert not result.run_requests
    assert result.skip_reason.skip_message == f"no new models in {reg}; retired: test/gone"
    assert sorted(instance.get_dynamic_partitions("models")) == ["test/a", "test/gone"]  # history kept


# --- runs request only what a model lists -------------------------------------------------------------------


def test_whole_job_launch_warns_per_unlisted_recipe_and_a_requested_run_does_not(tmp_path, tiny_llama, caplog):
    """The negative control of the selection: launching every asset (as from the UI's job page) makes each
    unlisted recipe's blocking check 'emit no result'; the sensor's request runs only gguf-f32 and warns of
    nothing."""
    reg = write_registry(tmp_path, [{"id": "test/a", "source": str(tiny_llama), "recipes": ["gguf-f32"]}])
    store = tmp_path / "store"
    defs = definitions(reg, store)
    instance = dg.DagsterInstance.ephemeral()
    (request,) = registry_sensor(sensor_context(instance, reg)).run_requests
    instance.add_dynamic_partitions("models", ["test/a"])
    caplog.set_level("WARNING")
    result = run_request(defs, instance, request)
    assert result.success and warnings_of(instance, result) == [] and no_result_warnings(caplog) == []
    whole = defs.resolve_job_def("onboard").execute_in_process(partition_key="test/a", instance=instance,
                                                              raise_on_error=False)
    assert whole.success
    noisy = no_result_warnings(caplog)
    # two blocking checks (parity, integrity) per recipe the model does not list
    assert len(noisy) == 2 * (len(Config.load(reg).recipes) - 1), noisy
    assert not any("gguf-f32:" in w for w in noisy)


# --- revisions ------------------------------------------------------------------------------------------------


def _observe(defs, instance) -> dg.ExecuteInProcessResult:
    result = defs.resolve_job_def("observe_revisions").execute_in_process(instance=instance, raise_on_error=False)
    assert result.success
    return result


def _observed(instance, key: str) -> str | None:
    records = instance.fetch_observations(dg.AssetRecordsFilter(asset_key=UPSTREAM_KEY, asset_partitions=[key]),
                                          limit=1).records
    return records[0].event_log_entry.asset_observation.tags["dagster/data_version"] if records else None


def test_a_new_upstream_revision_rebuilds_that_model_only(tmp_path, tiny_llama):
    a = copy_model(tiny_llama, tmp_path / "src-a")
    b = copy_model(tiny_llama, tmp_path / "src-b")
    models = [{"id": "test/a", "source": str(a), "recipes": ["gguf-f32"]},
              {"id": "test/b", "source": str(b), "recipes": ["gguf-f32"]}]
    reg = write_registry(tmp_path, models)
    store = tmp_path / "store"
    defs, instance = onboard_with_the_sensor(reg, store)

    # observed and unchanged: nothing is requested
    _observe(defs, instance)
    assert _observed(instance, "test/a") and _observed(instance, "test/b")
    quiet = revision_sensor(sensor_context(instance, reg, store))
    assert not quiet.run_requests
    assert quiet.skip_reason.skip_message == "every observed revision is the one its snapshot was fetched at"

    # a new upstream revision of a (its weights change): a is requested, b is not
    before = _observed(instance, "test/a")
    def bump(weights):
        for name in weights:
            if "mlp" in name:
                weights[name] *= 1.01

    rewrite_safetensors(a, bump)
    _observe(defs, instance)
    after = _observed(instance, "test/a")
    assert after != before and _observed(instance, "test/b") is not None
    (request,) = revision_sensor(sensor_context(instance, reg, store)).run_requests
    assert request.partition_key == "test/a" and request.run_key == f"revision:test/a:{after}"
    assert request.tags["hive-aot/trigger"] == "revision"
    rebuilt = run_request(defs, instance, request)
    assert rebuilt.success
    states = {e.asset_key.to_user_string(): e.materialization.metadata["state"].value
              for e in rebuilt.get_asset_materialization_events() if e.asset_key.path[0] == "published"}
    assert states == {"published/gguf-f32": "published"}  # a new build id, not a skip
    snap = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=SNAPSHOT_KEY, asset_partitions=["test/a"]),
                                           limit=1).records[0]
    assert snap.event_log_entry.asset_materialization.metadata["commit"].value == after
    assert not revision_sensor(sensor_context(instance, reg, store)).run_requests  # caught up


def test_a_revision_that_disappears_is_reported_and_requests_nothing(tmp_path, tiny_llama):
    a = copy_model(tiny_llama, tmp_path / "src-a")
    reg = write_registry(tmp_path, [{"id": "test/a", "source": str(a), "recipes": ["gguf-f32"]}])
    store = tmp_path / "store"
    defs = definitions(reg, store)
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("models", ["test/a"])
    shutil.rmtree(a)
    result = _observe(defs, instance)
    assert _observed(instance, "test/a") is None
    (warning,) = [w for w in warnings_of(instance, result) if "revision not observed" in w]
    assert warning.startswith("test/a: revision not observed: ") and "\n" not in warning
    assert not revision_sensor(sensor_context(instance, reg, store)).run_requests


def test_the_schedule_observes_every_model_in_one_run_and_skips_an_empty_registry(tmp_path, tiny_llama):
    reg = write_registry(tmp_path, [{"id": "test/a", "source": str(tiny_llama), "recipes": ["gguf-f32"]}])
    instance = dg.DagsterInstance.ephemeral()
    ctx = dg.build_schedule_context(instance=instance, resources={"hive": HiveResource(registry=str(reg))})
    request = revisions_schedule(ctx)
    assert isinstance(request, dg.RunRequest) and request.partition_key is None
    assert revisions_schedule.job_name == "observe_revisions" and revisions_schedule.cron_schedule == "0 3 * * *"
    (tmp_path / "empty").mkdir()
    empty = write_registry(tmp_path / "empty", [])
    ctx = dg.build_schedule_context(instance=instance, resources={"hive": HiveResource(registry=str(empty))})
    assert isinstance(revisions_schedule(ctx), dg.SkipReason)


def test_the_schedule_cadence_is_configurable(tmp_path):
    env = {"HIVE_AOT_REVISION_CRON": "*/30 * * * *", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", "from pipelines.orchestration.automation import revisions_schedule as s;"
                           "print(s.cron_schedule)"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "*/30 * * * *", proc.stderr[-2000:]


# --- the CLI ---------------------------------------------------------------------------------------------------


def test_onboard_failure_is_one_line_per_step_with_the_run_id(tmp_path, tiny_llama):
    impossible = {"id": "gguf-impossible", "kind": "gguf", "options": {"outtype": "f16"},
                  "runtime_profiles": ["llm-llamacpp-cpu"],
                  "validation": {"min_top1_agreement": 1.0, "max_mean_kl": 0.0, "max_abs_logit_delta": 0.0}}
    reg = write_registry(tmp_path, [{"id": "test/strict", "source": str(tiny_llama),
                                     "recipes": ["gguf-f32", "gguf-impossible"]}], [impossible])
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER")}
    env["DAGSTER_HOME"] = str(tmp_path / "dagster")
    proc = subprocess.run([str(Path(sys.executable).parent / "hive-aot"), "onboard", "--registry", str(reg),
                           "--store", str(tmp_path / "store")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "dagster._core" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hive-aot: error:")]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("hive-aot: error: test/strict gguf-impossible: rejected: ")
    assert "mean KL" in errors[0] and "(run " in errors[0]
    run_id = errors[0].rsplit("(run ", 1)[1].rstrip(")")
    instance = dg.DagsterInstance.local_temp(str(tmp_path / "dagster"))
    assert instance.get_run_by_id(run_id) is not None  # the run to open in the UI
    # the fresh home got the committed settings: run retries for dead workers, a default limit on every pool
    assert instance.run_retries_enabled and not instance.run_retries_retry_on_asset_or_op_failure
    assert instance.get_concurrency_config().pool_config.default_pool_limit == 2
    rows = [line.split()[:3] for line in proc.stdout.splitlines()]
    assert ["test/strict", "gguf-f32", "published"] in rows, proc.stdout


def test_adding_a_model_to_the_registry_builds_only_that_model(tmp_path, tiny_llama, monkeypatch):
    """The demo's workflow: onboard, add a model to registry.yaml, onboard again: the first model's builds are
    found published (skipped), only the new one is built."""
    from pipelines.orchestration.onboard import onboard

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    first = [{"id": "test/a", "source": str(tiny_llama), "recipes": ["gguf-f32"]}]
    reg = write_registry(tmp_path, first)
    store = str(tmp_path / "store")
    before = onboard(registry=str(reg), store=store)
    assert before.success and [(r.model_id, r.state) for r in before.results] == [("test/a", "published")]
    b = copy_model(tiny_llama, tmp_path / "src-b")
    reg = write_registry(tmp_path, first + [{"id": "test/b", "source": str(b), "recipes": ["gguf-f32"]}])
    after = onboard(registry=str(reg), store=store)
    assert after.success
    assert [(r.model_id, r.state) for r in after.results] == [("test/a", "skipped"), ("test/b", "published")]
    assert after.results[0].build_id == before.results[0].build_id
    # test/a is answered before any run (build.unchanged): one run per onboard, test/b's the second
    assert after.results[0].run_id.startswith("none: unchanged")
    assert after.results[0].check == before.results[0].check  # its validation, from the manifest
    instance = dg.DagsterInstance.local_temp(str(tmp_path / "dagster"))
    assert instance.get_runs_count() == 2 and after.results[1].run_id == instance.get_runs(limit=1)[0].run_id


def test_a_broken_recipe_file_leaves_the_code_location_loading_and_is_reported(tmp_path, tiny_llama):
    """A recipe that fails validation is left out (with its dependants), shown as broken_recipe/<id> with its
    reason; the code location loads, the sensor still onboards the model with its other recipes."""
    reg = write_registry(tmp_path, [{"id": "test/a", "source": str(tiny_llama), "recipes": ["gguf-f32", "gguf-bad"]}],
                         [{"id": "gguf-bad", "kind": "gguf", "options": {"outtype": "q9_9"},
                           "runtime_profiles": ["llm-llamacpp-cpu"], "validation": F32["validation"]}])
    (tmp_path / "recipes" / "gguf-typo.yaml").write_text("id: gguf-typo\nkind: gguf\noptions: {outtype: f16\n")
    env = {**os.environ, "HIVE_AOT_REGISTRY": str(reg)}
    script = ("import json; from pipelines.definitions import defs; g = defs.resolve_asset_graph();"
              "print(json.dumps({k.to_user_string(): (g.get(k).description or '') for k in g.get_all_asset_keys()}))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assets = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "artifact/gguf-f32" in assets and "artifact/gguf-bad" not in assets and "artifact/gguf-typo" not in assets
    # the packaged recipes no model lists have no assets (HIVE_AOT_DAGSTER_RECIPES=used); the model has its summary
    assert not any(k.startswith(("artifact/gguf-f16", "artifact/vllm-", "artifact/qaic-")) for k in assets), assets
    assert "summary" in assets
    assert assets["broken_recipe/gguf-bad"].startswith("Recipe gguf-bad is broken and was left out: recipe gguf-bad: ")
    assert "q9_9" in assets["broken_recipe/gguf-bad"]
    assert str(tmp_path / "recipes" / "gguf-typo.yaml") in assets["broken_recipe/gguf-typo"]
    assert "recipe gguf-bad left out of the code location" in proc.stderr
    # the sensor reads the same files: the model is onboarded with the recipe that is not broken
    instance = dg.DagsterInstance.ephemeral()
    ctx = sensor_context(instance, reg)
    (request,) = registry_sensor(ctx).run_requests
    assert [k.to_user_string() for k in request.asset_selection] == [
        "snapshot", "compatibility", "artifact/gguf-f32", "published/gguf-f32", "summary"]


def test_a_model_listing_a_recipe_the_code_location_has_no_assets_for_waits_for_its_reload(tmp_path, tiny_llama):
    """The code location made assets for the recipes its registry's models used when it loaded; a model added since
    that lists another recipe is neither requested nor added as a partition (the request would name assets that do
    not exist) until a reload defines them, and the sensor says why."""
    from pipelines.orchestration.recipe_selection import recipes_in_code_location
    from pipelines.orchestration.summary import summary_asset

    first = [{"id": "test/a", "source": str(tiny_llama), "recipes": ["gguf-f32"]}]
    loaded = Config.load(write_registry(tmp_path, first))
    recipes = recipes_in_code_location(loaded)
    assert [r.id for r in recipes] == ["gguf-f32"]
    recipe_assets, checks = all_recipe_assets(recipes)
    reg = write_registry(tmp_path, first + [{"id": "test/b", "source": str(tiny_llama), "recipes": ["gguf-f16"]}])
    repo = dg.Definitions(assets=source_assets() + recipe_assets + [summary_asset(recipes)], asset_checks=checks,
                          jobs=[onboard_job], sensors=[registry_sensor],
                          resources={"hive": HiveResource(registry=str(reg))}).get_repository_def()
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("models", ["test/a"])
    ctx = dg.build_sensor_context(instance=instance, repository_def=repo,
                                  resources={"hive": HiveResource(registry=str(reg))})
    result = registry_sensor(ctx)
    assert not result.run_requests and not result.dynamic_partitions_requests
    assert result.skip_reason.skip_message == (
        "test/b waits for a reload of the code location, which has no artifact/gguf-f16, published/gguf-f16 yet "
        "(Deployment > Reload, or restart `make ui`)")


def test_a_changed_recipe_rebuilds_the_models_that_list_it(tmp_path, tiny_llama):
    models = [{"id": "test/a", "source": str(tiny_llama), "recipes": ["gguf-f32"]},
              {"id": "test/b", "source": str(tiny_llama), "recipes": ["gguf-f16"]}]
    reg = write_registry(tmp_path, models)
    store = tmp_path / "store"
    defs, instance = onboard_with_the_sensor(reg, store)
    quiet = recipe_sensor(sensor_context(instance, reg, store))
    assert not quiet.run_requests
    assert quiet.skip_reason.skip_message == "every built recipe is the version its artifacts were built with"
    # the recipe's gates change: its hash (the artifact's code version) changes
    write_registry(tmp_path, models, [{**F32, "validation": {"min_top1_agreement": 0.98, "max_mean_kl": 0.001}}])
    new_digest = Config.load(reg).recipe("gguf-f32").digest[:16]
    (request,) = recipe_sensor(sensor_context(instance, reg, store)).run_requests
    assert request.partition_key == "test/a" and request.run_key == f"recipes:test/a:gguf-f32={new_digest}"
    assert request.tags["hive-aot/trigger"] == "recipes"
    assert run_request(definitions(reg, store), instance, request).success
    assert not recipe_sensor(sensor_context(instance, reg, store)).run_requests  # caught up
