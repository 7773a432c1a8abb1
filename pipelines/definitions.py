"""The Dagster code location: assets and checks from the top-level `assets/` package."""

from __future__ import annotations

import dagster as dg

import assets
from assets import artifacts, automation
from pipelines.orchestration.executors import executor_from_env
from pipelines.orchestration.resources import default_resource

defs = dg.Definitions(
    # AssetSpecs (the broken recipes) are not collected by the package loader: listed explicitly
    assets=[*dg.load_assets_from_package_module(assets), *artifacts.broken_recipes],
    asset_checks=dg.load_asset_checks_from_package_module(assets),
    jobs=[automation.onboard_job, automation.observe_revisions_job],
    sensors=[automation.registry_sensor, automation.revision_sensor, automation.recipe_sensor],
    schedules=[automation.revisions_schedule],
    resources={"hive": default_resource()},
    executor=executor_from_env(),
)
