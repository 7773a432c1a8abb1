"""Onboarding automation: the onboarding job, the registry sensor, the revision observation and its schedule,
and the sensor that turns a changed upstream revision into a rebuild.

Every run request names the assets of the recipes the model lists (and the inputs they are built from), so a
run never schedules steps that would build nothing. Unchanged inputs rebuild nothing either way: build ids are
content addresses, and a published build id is skipped.
"""

from __future__ import annotations

import dagster as dg

from ..core import settings
from ..core.errors import HiveError
from .factories import SNAPSHOT_KEY, UPSTREAM_KEY, artifact_key, model_asset_keys
from .partitions import models_partitions, partition_key
from .resources import HiveResource

# Partitions come from the assets (one dynamic partition per model); the job passes none of its own.
onboard_job = dg.define_asset_job(
    "onboard",
    selection=dg.AssetSelection.all() - dg.AssetSelection.assets(UPSTREAM_KEY),
    description="fetch -> classify -> build -> validate -> publish, for one model partition",
)

observe_revisions_job = dg.define_asset_job(
    "observe_revisions", selection=dg.AssetSelection.assets(UPSTREAM_KEY),
    description="Record each registry model's upstream commit (one Hub call per model, nothing downloaded).")

# Nightly by default; a deployment sets its own cadence without editing code.
REVISION_CRON = settings.REVISION_CRON.get()


def _config_or_reason(hive: HiveResource, context):
    """The registry and recipes, or the one-line reason they cannot be read (the sensor keeps running). A
    broken recipe is left out and logged; the models keep their other recipes."""
    try:
        config, broken = hive.current_config()
    except HiveError as e:
        return None, str(e)
    for rid, why in sorted(broken.items()):
        context.log.warning(f"recipe {rid} is broken and left out: {why}")
    return config, None


def onboard_request(config, entry, run_key: str | None, reason: str) -> dg.RunRequest:
    return dg.RunRequest(partition_key=partition_key(entry.id), run_key=run_key,
                         asset_selection=model_asset_keys(config, entry), tags={"hive-aot/trigger": reason})


def not_loaded(context, config, entry) -> list[str]:
    """The assets onboarding `entry` needs that the running code location does not define: it made assets for the
    recipes the registry's models used when it loaded (recipe_selection.py), and a model added since may list
    another. Empty for a context built without a code location (nothing to compare with)."""
    repo = context.repository_def
    if repo is None:
        return []
    defined = repo.asset_graph.get_all_asset_keys()
    return [k.to_user_string() for k in model_asset_keys(config, entry) if k not in defined]


def _wait_for_reload(context, entry, missing: list[str]) -> str:
    line = (f"{entry.id} waits for a reload of the code location, which has no {', '.join(missing)} yet "
            "(Deployment > Reload, or restart `make ui`)")
    context.log.warning(line)
    return line


@dg.sensor(job=onboard_job, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.STOPPED,
           description="Adds models listed in registry.yaml as partitions and onboards each new one; a model "
                       "removed from the registry keeps its partition and history and is reported retired.")
def registry_sensor(context: dg.SensorEvaluationContext, hive: HiveResource) -> dg.SensorResult:
    config, problem = _config_or_reason(hive, context)
    if config is None:  # a malformed registry adds nothing; the next tick reads it again
        return dg.SensorResult(skip_reason=f"registry not read: {problem}")
    try:
        wanted = {partition_key(m.id): m for m in config.registry.models}
    except ValueError as e:
        return dg.SensorResult(skip_reason=f"registry not read: {config.origin}: {e}")
    existing = set(context.instance.get_dynamic_partitions(models_partitions.name))
    new, waiting = [], []
    for k, entry in wanted.items():
        if k in existing:
            continue
        missing = not_loaded(context, config, entry)
        if missing:  # not added as a partition yet: the first tick after the reload finds it new and onboards it
            waiting.append(_wait_for_reload(context, entry, missing))
        else:
            new.append(k)
    retired = sorted(existing - set(wanted))
    if retired:
        context.log.info(f"retired (not in {config.origin}; partitions and history kept): {', '.join(retired)}")
    if not new:
        return dg.SensorResult(skip_reason=("; ".join(waiting) or f"no new models in {config.origin}")
                                           + (f"; retired: {', '.join(retired)}" if retired else ""))
    return dg.SensorResult(
        run_requests=[onboard_request(config, wanted[k], f"onboard:{k}", "registry") for k in new],
        dynamic_partitions_requests=[models_partitions.build_add_request(new)],
    )


@dg.schedule(job=observe_revisions_job, cron_schedule=REVISION_CRON, default_status=dg.DefaultScheduleStatus.STOPPED,
             description="Observe every registered model's upstream revision (nightly unless HIVE_AOT_REVISION_CRON "
                         "says otherwise); revision_sensor requests the builds of those that changed.")
def revisions_schedule(context: dg.ScheduleEvaluationContext, hive: HiveResource):
    config, problem = _config_or_reason(hive, context)
    if config is None:
        return dg.SkipReason(f"registry not read: {problem}")
    if not config.registry.models:
        return dg.SkipReason(f"no models in {config.origin}")
    # One run observes every registered model: the observation returns a version per partition.
    return dg.RunRequest(run_key=None, tags={"hive-aot/trigger": "revisions-schedule"})


def _latest_observed(instance: dg.DagsterInstance, key: str) -> str | None:
    records = instance.fetch_observations(dg.AssetRecordsFilter(asset_key=UPSTREAM_KEY, asset_partitions=[key]),
                                          limit=1).records
    if not records:
        return None
    obs = records[0].event_log_entry.asset_observation
    return obs.tags.get("dagster/data_version") if obs is not None else None


def _latest_built_from(instance: dg.DagsterInstance, key: str) -> str | None:
    records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=SNAPSHOT_KEY, asset_partitions=[key]),
                                              limit=1).records
    if not records:
        return None
    # the snapshot's commit is what the observation reports for the same source (sources.resolve_revision)
    entry = records[0].event_log_entry.asset_materialization.metadata.get("commit")
    return entry.value if entry is not None else None


def _rebuilds(context: dg.SensorEvaluationContext, hive: HiveResource, change, trigger: str,
              unchanged: str) -> dg.SensorResult:
    """One run request per onboarded model for which `change(instance, config, entry, key)` returns a stamp (what
    changed), with the model's own assets. The run key carries the stamp: a later tick that sees the same
    change does not request it again."""
    config, problem = _config_or_reason(hive, context)
    if config is None:
        return dg.SensorResult(skip_reason=f"registry not read: {problem}")
    known = set(context.instance.get_dynamic_partitions(models_partitions.name))
    requests = []
    for entry in config.registry.models:
        key = partition_key(entry.id)
        if key not in known:
            continue  # the registry sensor onboards new models
        stamp = change(context.instance, config, entry, key)
        if stamp is None:
            continue
        missing = not_loaded(context, config, entry)
        if missing:  # no run key spent: the first tick after the reload requests it
            _wait_for_reload(context, entry, missing)
            continue
        requests.append(onboard_request(config, entry, f"{trigger}:{key}:{stamp}", trigger))
    return dg.SensorResult(run_requests=requests) if requests else dg.SensorResult(skip_reason=unchanged)


def _revision_change(instance, config, entry, key: str) -> str | None:
    observed = _latest_observed(instance, key)
    return None if observed is None or observed == _latest_built_from(instance, key) else observed


@dg.sensor(job=onboard_job, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.STOPPED,
           description="Requests the onboarding of each model whose observed upstream revision differs from the one "
                       "its snapshot was fetched at; an unchanged revision requests nothing.")
def revision_sensor(context: dg.SensorEvaluationContext, hive: HiveResource) -> dg.SensorResult:
    return _rebuilds(context, hive, _revision_change, "revision",
                     "every observed revision is the one its snapshot was fetched at")


CODE_VERSION_TAG = "dagster/code_version"


def _built_with(instance: dg.DagsterInstance, recipe_id: str, key: str) -> str | None:
    """The code version (recipe hash) of a model's latest artifact materialization for a recipe, if any."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=artifact_key(recipe_id), asset_partitions=[key]), limit=1).records
    return records[0].event_log_entry.asset_materialization.tags.get(CODE_VERSION_TAG) if records else None


def _recipe_change(instance, config, entry, key: str) -> str | None:
    changed = sorted(rid for rid in config.requested_recipes(entry)
                     if (built := _built_with(instance, rid, key)) is not None
                     and built != config.recipe(rid).digest[:16])
    return ",".join(f"{rid}={config.recipe(rid).digest[:16]}" for rid in changed) or None


@dg.sensor(job=onboard_job, minimum_interval_seconds=300, default_status=dg.DefaultSensorStatus.STOPPED,
           description="Requests the onboarding of each model whose artifact was built with another version of a "
                       "recipe it lists (the recipe hash is the artifact's code version): only those models, each "
                       "with its own assets; the pools bound how many of those builds run at once.")
def recipe_sensor(context: dg.SensorEvaluationContext, hive: HiveResource) -> dg.SensorResult:
    return _rebuilds(context, hive, _recipe_change, "recipes",
                     "every built recipe is the version its artifacts were built with")
