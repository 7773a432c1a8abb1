"""Dagster assets, checks, sensors and schedules: thin instantiations of pipelines.orchestration
factories from registry.yaml and recipes/ (found through $HIVE_AOT_REGISTRY or ./registry.yaml)."""
