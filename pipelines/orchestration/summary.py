"""summary: one partition per model, the demo's table of every recipe the model lists (state, size, top-1, KL, the
engine-side check, build id) and the size-against-quality chart, read from what the instance recorded.

It is downstream of the recipes' publish steps, so an onboarding run refreshes it last. A run in which a recipe
failed skips it (Dagster runs nothing downstream of a failure): `hive-aot onboard` then materializes it alone, and
in the UI a materialization of `summary` alone does the same at any time.
"""

import re
from typing import Any

import dagster as dg
from dagster._core.event_api import PartitionKeyFilter  # the check history's partition filter (not exported)

from ..config.registry import Config, Recipe
from ..validation.quality_view import SUMMARY_COLUMNS, RecipeRow, size_quality_svg
from .factories import PARITY_CHECK, SUMMARY_KEY, artifact_key, hardware_key, published_key
from .partitions import models_partitions
from .quality import chart, full_build_id
from .resources import HiveResource

__all__ = ["SUMMARY_KEY", "failure_line", "recipe_row", "summary_asset", "summary_metadata"]


def failure_line(error) -> str:
    """The first line of a step's error without the exception's module path: a Failure raised from a HiveError
    is the engine's one line; anything else keeps its exception name (`ValueError: ...`)."""
    first = (error.message.strip().splitlines() or [""])[0]
    return re.sub(r"^dagster\._core\.definitions\.events\.Failure: ", "", first)


def step_of(key: dg.AssetKey) -> str:
    """The step (op) Dagster derives from an asset key: artifact/gguf-f16 -> artifact__gguf_f16."""
    return "__".join(re.sub(r"\W", "_", part) for part in key.path)


class _Recorded:
    """The latest events the instance holds for one model partition."""

    def __init__(self, instance: dg.DagsterInstance, partition: str) -> None:
        self.instance, self.partition = instance, partition

    def materialization(self, key: dg.AssetKey | None):
        """The latest materialization's record (storage_id, event_log_entry), or None."""
        if key is None:
            return None
        records = self.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=key, asset_partitions=[self.partition]), limit=1).records
        return records[0] if records else None

    def failure(self, key: dg.AssetKey) -> str | None:
        """Why the latest finished run that planned `key` did not materialize it: its step's error, else (skipped
        behind a failure) the run's first step error; None when it did, or that run is still going."""
        planned = self.instance.get_latest_planned_materialization_info(key, partition=self.partition)
        done = self.materialization(key)
        if planned is None or (done is not None and done.storage_id > planned.storage_id):
            return None
        run = self.instance.get_run_by_id(planned.run_id)
        if run is None or not run.is_finished:
            return None
        failures = [e.dagster_event for e in self.instance.all_logs(planned.run_id, of_type=dg.DagsterEventType.STEP_FAILURE)]
        own = [f for f in failures if f.step_key == step_of(key)]
        first = (own or failures or [None])[0]
        return failure_line(first.event_specific_data.error) if first is not None else f"not built in run {run.run_id[:8]}"

    def check(self, key: dg.AssetKey):
        """The latest evaluation of the asset's parity check in this partition (an entry whose event data is the
        AssetCheckEvaluation), or None."""
        history = self.instance.event_log_storage.get_asset_check_execution_history(
            dg.AssetCheckKey(key, PARITY_CHECK), limit=1, partition_filter=PartitionKeyFilter(key=self.partition))
        event = history[0].event if history else None  # a planned execution has no evaluation yet
        return event if event is not None and event.dagster_event_type == dg.DagsterEventType.ASSET_CHECK_EVALUATION \
            else None


def _after(entry, record) -> bool:
    """Event log entry `entry` is later than the materialization `record` (there is an entry, and no record or an
    earlier one)."""
    return entry is not None and (record is None or entry.timestamp > record.event_log_entry.timestamp)


def recipe_row(recorded: _Recorded, recipe: Recipe) -> RecipeRow:
    """The state one recipe reached in its latest attempt: failed (with its step's line), staged (not validated
    yet), rejected by its check, validated but not published, or the publish step's (and hardware step's) state."""
    rid = recipe.id
    failed = recorded.failure(artifact_key(rid))
    if failed is not None:
        return RecipeRow(rid, "failed", note=failed)
    built = recorded.materialization(artifact_key(rid))
    if built is None:
        return RecipeRow(rid, "not built")
    md = built.event_log_entry.asset_materialization.metadata
    size = md["size_bytes"].value if "size_bytes" in md else None
    checked = recorded.check(artifact_key(rid))
    if not _after(checked, built):
        return RecipeRow(rid, "staged (not validated)", size=size, build_id=full_build_id(md))
    evaluation = checked.dagster_event.event_specific_data
    metrics = {k: v.value for k, v in evaluation.metadata.items() if isinstance(v.value, (int, float))}
    measured = dict(size=size, metrics=metrics, build_id=full_build_id(md), passed=evaluation.passed)
    if not evaluation.passed:
        return RecipeRow(rid, "rejected", note=evaluation.description or "", **measured)
    refused = recorded.failure(published_key(rid))
    if refused is not None:
        return RecipeRow(rid, "failed", note=refused, **measured)
    published = recorded.materialization(published_key(rid))
    if published is None or published.event_log_entry.timestamp < checked.timestamp:
        return RecipeRow(rid, "validated (not published)", **measured)
    finished = recorded.materialization(hardware_key(recipe))
    final = finished if finished is not None and finished.storage_id > published.storage_id else published
    return RecipeRow(rid, str(final.event_log_entry.asset_materialization.metadata["state"].value), **measured)


def summary_metadata(rows: list[RecipeRow]) -> dict[str, Any]:
    """The table (one row per recipe, in the registry's order), the chart, and how many recipes are published."""
    done = sum(r.state in ("published", "skipped", "compile_pending") for r in rows)
    md: dict[str, Any] = {
        "recipes": dg.MetadataValue.table(
            [dg.TableRecord(r.cells()) for r in rows],
            schema=dg.TableSchema(columns=[dg.TableColumn(c) for c in SUMMARY_COLUMNS])),
        "published": f"{done} of {len(rows)} recipes",
    }
    scatter = chart(lambda _: size_quality_svg(rows), "size against mean KL")
    if scatter is not None:
        md["size_vs_quality"] = scatter
    return md


def summary_asset(recipes: list[Recipe]) -> dg.AssetsDefinition:
    """The summary asset, downstream of the publish (and hardware) steps of the recipes in the code location."""
    deps = sorted({published_key(r.id) for r in recipes} | {k for r in recipes if (k := hardware_key(r)) is not None},
                  key=lambda k: k.to_user_string())

    @dg.asset(key=SUMMARY_KEY, deps=deps, partitions_def=models_partitions, group_name="summary",
              description="Every recipe the model lists, side by side: state, size, top-1, KL, the engine-side check "
                          "and build id (what `make demo` prints), with size against quality as a chart. "
                          "Materialize it alone to refresh it after a run in which a recipe failed.")
    def summary(context: dg.AssetExecutionContext, hive: HiveResource) -> dg.MaterializeResult:
        config: Config = hive.config()
        entry = hive.model(context.partition_key)
        recorded = _Recorded(context.instance, context.partition_key)
        rows = [recipe_row(recorded, config.recipe(rid)) for rid in entry.recipes if rid in config.recipes]
        return dg.MaterializeResult(metadata=summary_metadata(rows))

    return summary
