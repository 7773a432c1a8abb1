"""One artifact asset, blocking parity check and publish asset per recipe in recipes/; a broken recipe as a
non-materializable asset that says why it is broken."""

from pipelines.orchestration.factories import all_recipe_assets, broken_recipe_specs

from ._config import BROKEN_RECIPES, CONFIG

artifact_assets, artifact_checks = all_recipe_assets(CONFIG.recipes.values())
broken_recipes = broken_recipe_specs(BROKEN_RECIPES)
