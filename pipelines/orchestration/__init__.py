"""Dagster layer: partitions, resources and asset factories over the engine. Only this package,
`pipelines.definitions` and `assets/` import Dagster."""
