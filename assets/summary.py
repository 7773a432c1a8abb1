"""summary: per model, every recipe it lists side by side (the demo's table) and size against quality."""

from pipelines.orchestration.summary import summary_asset

from .artifacts import RECIPES

model_summary = summary_asset(RECIPES)
