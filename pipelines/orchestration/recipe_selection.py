"""Which recipes the code location makes assets for.

By default only those some registry model lists, with the inputs they are built from: a recipe no model uses
would only add nodes that no run materializes to the lineage and to "Materialize all". HIVE_AOT_DAGSTER_RECIPES=all
gives every recipe file its assets (a catalog of everything the platform can build).

Assets are made when the code location loads: a model added to registry.yaml that lists a recipe no other model
used needs a reload of the code location (the registry sensor says so and waits) before it can be onboarded.
"""

from __future__ import annotations

from ..config.registry import Config, Recipe
from ..core import settings

CHOICES = ("used", "all")


def recipes_in_code_location(config: Config) -> list[Recipe]:
    """The recipes that get assets, by id: every recipe with `all`, else those the registry's models request."""
    if settings.DAGSTER_RECIPES.choice(CHOICES) == "all":
        wanted = set(config.recipes)
    else:
        wanted = {rid for entry in config.registry.models for rid in config.requested_recipes(entry)}
    return [config.recipes[rid] for rid in sorted(wanted)]
