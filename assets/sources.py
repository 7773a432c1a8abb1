"""snapshot -> compatibility, one partition per model."""

from pipelines.orchestration.factories import source_assets

source_stage_assets = source_assets()
