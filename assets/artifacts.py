"""One artifact asset, blocking parity check and publish asset per recipe in recipes/."""

from pipelines.orchestration.factories import all_recipe_assets

from ._config import CONFIG

artifact_assets, artifact_checks = all_recipe_assets(CONFIG.recipes.values())
