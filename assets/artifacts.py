"""One artifact asset, blocking parity check and publish asset per recipe a registry model uses (every recipe with
HIVE_AOT_DAGSTER_RECIPES=all); a broken recipe as a non-materializable asset that says why it is broken."""

from pipelines.orchestration.factories import all_recipe_assets, broken_recipe_specs
from pipelines.orchestration.recipe_selection import recipes_in_code_location

from ._config import BROKEN_RECIPES, CONFIG

RECIPES = recipes_in_code_location(CONFIG)
artifact_assets, artifact_checks = all_recipe_assets(RECIPES)
broken_recipes = broken_recipe_specs(BROKEN_RECIPES)
