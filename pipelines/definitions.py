"""The Dagster code location: assets and checks from the top-level `assets/` package."""

from __future__ import annotations

import dagster as dg

import assets
from assets import automation
from pipelines.orchestration.resources import default_resource

defs = dg.Definitions(
    assets=dg.load_assets_from_package_module(assets),
    asset_checks=dg.load_asset_checks_from_package_module(assets),
    jobs=[automation.onboard_job],
    sensors=[automation.registry_sensor],
    schedules=[automation.revisions_schedule],
    resources={"hive": default_resource()},
)
