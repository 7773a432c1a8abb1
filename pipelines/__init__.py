"""hive-aot: the ahead-of-time model artifact factory.

The engine modules in this package never import Dagster or torch at module level, so the pull
client stays light; only `pipelines.orchestration` and `pipelines.definitions` import Dagster.
"""

__version__ = "0.1.0"
