"""The one resource every asset uses: where the registry and the store are."""

from __future__ import annotations

from functools import cached_property

import dagster as dg

from ..config.registry import Config, ModelEntry
from ..core import settings
from ..store import Store, default_store_uri, open_store


class HiveResource(dg.ConfigurableResource):
    """Registry file and store URI. Steps exchange store URIs and build ids, never local paths."""

    registry: str = ""
    recipes: str = ""
    store: str = ""

    @cached_property
    def _config(self) -> Config:
        # tolerant as the code location is: a broken recipe file must not fail the steps of the others
        return Config.load_tolerant(self.registry or None, self.recipes or None)[0]

    def config(self) -> Config:
        return self._config

    def current_config(self) -> tuple[Config, dict[str, str]]:
        """The registry and recipes as the files say now, and the recipes left out as broken (id -> reason):
        sensors and schedules run in a code server that lives for days, and an edit to registry.yaml must reach
        their next tick."""
        return Config.load_tolerant(self.registry or None, self.recipes or None)

    def store_uri(self) -> str:
        return self.store or default_store_uri()

    def open_store(self) -> Store:
        return open_store(self.store_uri())

    def model(self, model_id: str) -> ModelEntry:
        entry = self.config().registry.model(model_id)
        if entry is None:
            raise dg.Failure(f"model {model_id} is not in {self.config().origin}")
        return entry

    def source(self, model_id: str) -> str:
        return self.config().model_source(self.model(model_id))


def default_resource() -> HiveResource:
    # Resolved when definitions load; step processes load the same definitions with the same env.
    return HiveResource(registry=settings.REGISTRY.get() or "", recipes=settings.RECIPES.get() or "",
                        store=settings.STORE.get() if settings.STORE.is_set() else "")
