"""Scheduled onboarding: new registry models become partitions and run; upstream revisions are
re-checked on a schedule. Unchanged inputs rebuild nothing: build ids are content addresses."""


import dagster as dg

from .partitions import models_partitions, partition_key
from .resources import HiveResource

onboard_job = dg.define_asset_job(
    "onboard",
    selection=dg.AssetSelection.all(),
    partitions_def=models_partitions,
    description="fetch -> classify -> build -> validate -> publish, for one model partition",
)


@dg.sensor(job=onboard_job, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.STOPPED,
           description="Adds models listed in registry.yaml as partitions and onboards each new one.")
def registry_sensor(context: dg.SensorEvaluationContext, hive: HiveResource) -> dg.SensorResult:
    wanted = [partition_key(m.id) for m in hive.config().registry.models]
    existing = set(context.instance.get_dynamic_partitions(models_partitions.name))
    new = [k for k in wanted if k not in existing]
    return dg.SensorResult(
        run_requests=[dg.RunRequest(partition_key=k, run_key=f"onboard:{k}") for k in new],
        dynamic_partitions_requests=[models_partitions.build_add_request(new)] if new else [],
    )


@dg.schedule(job=onboard_job, cron_schedule="0 3 * * *", default_status=dg.DefaultScheduleStatus.STOPPED,
             description="Nightly: re-resolve every model's revision; only changed inputs rebuild.")
def revisions_schedule(context: dg.ScheduleEvaluationContext):
    keys = context.instance.get_dynamic_partitions(models_partitions.name)
    return [dg.RunRequest(partition_key=k, run_key=None) for k in keys]
