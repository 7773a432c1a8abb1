"""Asset factories: the per-stage assets and, for each recipe, an artifact asset, its blocking
numerical check and a publish asset. `assets/` instantiates them from registry.yaml + recipes/.

Each step re-derives what it needs from small values (pinned source, build id, store URI):
weights never pass through an IO manager, so the same code runs on any executor.
"""


import warnings
from collections.abc import Iterable
from typing import Any

import dagster as dg

from ..compat import classify_snapshot
from ..config.kinds import target_for
from ..config.registry import Config, ModelEntry, Recipe
from ..core import meter
from ..core.errors import HiveError, ResourceError
from ..core.units import human_bytes
from ..engine import build as engine
from ..source.fetch import fetch, resolve_revision
from .executors import CELERY_QUEUE_TAG
from .partitions import models_partitions
from .pools import LARGE_MEMORY_POOL
from .quality import build_entries, check_metadata, files_table, gated_numbers, quality_observation
from .resources import HiveResource
from .step_log import forward_step_lines

# Partition-aware asset checks are what gate publishing per model; Dagster 1.13 labels them
# "preview". We depend on them deliberately, so the warning is noise at every definitions load.
warnings.filterwarnings("ignore", category=dg.PreviewWarning, message=".*partitions_def on an AssetCheckSpec.*")
# Output(data_version=...) records the source content digest / build id as the asset's version.
warnings.filterwarnings("ignore", category=dg.BetaWarning, message=".*data_version.*")
# The upstream revision is a partitioned observable source (beta in 1.13): its data version per model is what
# makes a snapshot stale when the upstream commit moves, without downloading anything.
warnings.filterwarnings("ignore", category=dg.BetaWarning, message=".*observable_source_asset.*")

forward_step_lines()  # each build step's start and end lines into the log of the run that builds

UPSTREAM_KEY = dg.AssetKey(["upstream_revision"])
SNAPSHOT_KEY = dg.AssetKey(["snapshot"])
COMPAT_KEY = dg.AssetKey(["compatibility"])
SUMMARY_KEY = dg.AssetKey(["summary"])  # the per-model table of its recipes (summary.py)
PARITY_CHECK = "numerical_parity"
INTEGRITY_CHECK = "integrity"


def artifact_key(recipe_id: str) -> dg.AssetKey:
    return dg.AssetKey(["artifact", recipe_id])


def published_key(recipe_id: str) -> dg.AssetKey:
    return dg.AssetKey(["published", recipe_id])


def hardware_key(recipe: Recipe) -> dg.AssetKey | None:
    """The asset of the recipe's hardware step (qpc/<recipe> for an AI 100 compile); None when its kind has none."""
    step = target_for(recipe.kind).hardware_step
    return dg.AssetKey([step.name, recipe.id]) if step else None


def model_asset_keys(config: Config, entry: ModelEntry) -> list[dg.AssetKey]:
    """What onboarding one model materializes: its sources, the artifact, publish (and compile) assets of the
    recipes it lists and the inputs they are built from, and its summary last. A run of these schedules no step
    that builds nothing."""
    keys = [SNAPSHOT_KEY, COMPAT_KEY]
    for rid in sorted(config.requested_recipes(entry)):
        keys += [artifact_key(rid), published_key(rid)]
        finished = hardware_key(config.recipe(rid))
        if finished is not None:
            keys.append(finished)
    return keys + [SUMMARY_KEY]


def _sizes(files: list[dict]) -> dict[str, Any]:
    total = sum(f["size"] for f in files)
    return {"size_bytes": dg.MetadataValue.int(total), "size": human_bytes(total)}


# Fetch and publish talk to the Hub and the store: an unexpected error there (a reset connection, S3 throttling)
# is retried with backoff. A HiveError is a verdict on the input and fails at once (Failure(allow_retries=False)).
TRANSIENT_RETRY = dg.RetryPolicy(max_retries=2, delay=5, backoff=dg.Backoff.EXPONENTIAL)


def _failure(e: HiveError) -> dg.Failure:
    # The engine's one-line message is what the UI shows; no stack trace noise for bad input. A refusal by the
    # memory plan carries the plan, so the failure shows each step's estimate beside the line.
    metadata = {}
    if isinstance(e, ResourceError):
        metadata["error"] = dg.MetadataValue.text(str(e))
        if e.plan:
            metadata.update(_memory_metadata(e.plan))
    return dg.Failure(description=str(e), allow_retries=False, metadata=metadata)


def _memory_metadata(plan: dict[str, Any] | None) -> dict[str, Any]:
    """The memory plan as asset metadata: the whole plan (JSON) and its peak once, in binary units."""
    if not plan:
        return {}
    return {"memory_plan": dg.MetadataValue.json(plan),
            "peak_memory": dg.MetadataValue.text(f"{plan['peak_memory_human']} (step {plan['peak_step']}, budget "
                                                 f"{plan['budget_human']}: {plan['budget_source']})")}


def _rate_metadata() -> dict[str, Any]:
    """The work this step's build steps did and the rate they reached (meter.rates): a reference's FLOP/s beside
    the host's GEMM rate, a conversion's bytes/s beside a copy's. Empty when no step was credited with work."""
    rates = meter.rates()
    return {"step_rates": dg.MetadataValue.json(rates)} if rates else {}


def source_assets() -> list[dg.AssetsDefinition]:
    @dg.observable_source_asset(key=UPSTREAM_KEY, partitions_def=models_partitions, group_name="sources",
                                description="Each registered model's upstream commit as its data version (one Hub "
                                            "call per model, nothing downloaded). A new one makes the model's "
                                            "snapshot stale; revision_sensor requests its onboarding.")
    def upstream_revision(context, hive: HiveResource) -> dg.DataVersionsByPartition:
        config = hive.config()
        known = set(context.instance.get_dynamic_partitions(models_partitions.name))
        versions = {}
        for entry in config.registry.models:
            if entry.id not in known:
                continue  # not onboarded yet: the registry sensor adds it
            try:
                versions[entry.id] = resolve_revision(config.model_source(entry), entry.id)
            except HiveError as e:  # a revision that disappeared: reported, the model's builds left as they are
                context.log.warning(f"{entry.id}: revision not observed: {e}")
        return dg.DataVersionsByPartition(versions)

    @dg.asset(key=SNAPSHOT_KEY, deps=[UPSTREAM_KEY], partitions_def=models_partitions, group_name="sources",
              kinds={"huggingface"}, retry_policy=TRANSIENT_RETRY,
              description="The model's files at a pinned commit (safetensors only), with sha256 per file.")
    def snapshot(context: dg.AssetExecutionContext, hive: HiveResource) -> dg.Output[dict]:
        model_id = context.partition_key
        try:
            snap = fetch(hive.source(model_id), model_id)
        except HiveError as e:
            raise _failure(e) from None
        value = {"model_id": model_id, "source": snap.pinned_source, "commit": snap.commit,
                 "revision": snap.revision, "content_digest": snap.content_digest}
        return dg.Output(value, data_version=dg.DataVersion(snap.content_digest[:16]), metadata={
            # `commit` is what the upstream_revision observation reports for the same source (revision_sensor)
            "commit": snap.commit, "revision": snap.revision,
            "license": str(snap.license), "gated": str(snap.gated),
            "total_bytes": dg.MetadataValue.int(snap.total_bytes), "size": human_bytes(snap.total_bytes),
            "files": dg.MetadataValue.table(
                [dg.TableRecord({"path": f.path, "size": f.size, "sha256": f.sha256}) for f in snap.files],
                schema=dg.TableSchema(columns=[dg.TableColumn("path"), dg.TableColumn("size", "int"), dg.TableColumn("sha256")])),
        })

    @dg.asset(key=COMPAT_KEY, ins={"snapshot": dg.AssetIn(SNAPSHOT_KEY)}, partitions_def=models_partitions,
              group_name="sources", description="The platform's compatibility object for the model.")
    def compatibility(context: dg.AssetExecutionContext, hive: HiveResource, snapshot: dict) -> dg.Output[dict]:
        try:
            snap = fetch(snapshot["source"], snapshot["model_id"])
            cfg = hive.config()
            compat = classify_snapshot(snap, cfg.recipes.values(), registry=cfg.registry, reviewed=cfg.reviewed(snap.model_id))
        except HiveError as e:
            raise _failure(e) from None
        doc = compat.model_dump()
        return dg.Output(doc, metadata={
            "status": compat.status, "runtime_profile_id": str(compat.runtime_profile_id),
            "recipes": ", ".join(compat.recipes) or "none",
            "parameters": compat.estimated_requirements.get("parameters", 0),
            "compatibility": dg.MetadataValue.json(doc),
        })

    return [upstream_revision, snapshot, compatibility]


def recipe_assets(recipe: Recipe) -> tuple[list[dg.AssetsDefinition], list[dg.AssetChecksDefinition]]:
    """artifact/<recipe> -> blocking numerical_parity and integrity checks -> published/<recipe>."""
    rid = recipe.id
    akey = artifact_key(rid)

    # A derived recipe (an AI 100 compile) is built from its input's published artifact. Every kind's build
    # streams the model (memory about one tensor or layer), so builds have a pool per kind; the validations,
    # which hold a reference unit and the engines, share the large-memory pool.
    build_pool = f"build_{recipe.kind}"

    @dg.asset(key=akey, ins={"snapshot": dg.AssetIn(SNAPSHOT_KEY), "compatibility": dg.AssetIn(COMPAT_KEY)},
              deps=[published_key(recipe.input)] if recipe.input else None,
              partitions_def=models_partitions, group_name="artifacts", code_version=recipe.digest[:16],
              pool=build_pool, kinds={recipe.kind.split("-")[0]}, output_required=False,
              description=f"{rid}: the candidate built, uploaded and staged; pull sees it once published/{rid} has "
                          f"run. {recipe.description}".strip())
    def artifact(context: dg.AssetExecutionContext, hive: HiveResource, snapshot: dict, compatibility: dict):
        model_id = context.partition_key
        if rid not in hive.config().requested_recipes(hive.model(model_id)):
            context.log.info(f"{model_id} does not request {rid} (nor a recipe built from it); nothing to build")
            return
        meter.reset()  # this step's own measurements (an in-process executor runs several in one process)
        try:
            plan = engine.plan(snapshot["source"], rid, hive.config(), model_id)
            res = engine.stage(plan, hive.open_store())
        except HiveError as e:
            raise _failure(e) from None
        yield dg.Output(
            {"model_id": model_id, "recipe": rid, "source": snapshot["source"], "build_id": res.build_id,
             "store": hive.store_uri(), "state": res.state},
            data_version=dg.DataVersion(res.build_id[:16]),
            metadata={**build_entries(res.build_id, candidate=res.manifest), "state": res.state, "skipped": res.skipped,
                      "store_uri": hive.store_uri(), **_sizes(res.files), "files": files_table(res.files),
                      **_memory_metadata(res.memory_plan), **_rate_metadata()},
        )

    # Every validation holds a reference and an engine with the model: the large-memory pool (limit 1, see
    # pools.py), so two never run at once on a host.
    @dg.asset_check(asset=akey, name=PARITY_CHECK, blocking=True, partitions_def=models_partitions,
                    pool=LARGE_MEMORY_POOL,
                    description=f"Parity with the transformers fp32 reference on fixed token ids, measured in the "
                                f"{recipe.kind} target's engine, must meet {rid}'s thresholds.")
    def parity_check(context: dg.AssetCheckExecutionContext, hive: HiveResource, artifact: dict) -> dg.AssetCheckResult:
        meter.reset()
        try:
            plan = engine.plan(artifact["source"], rid, hive.config(), artifact["model_id"])
            if artifact["state"] in ("skipped", "repaired"):  # published before: its recorded validation
                validation = (engine.published_manifest(plan, hive.open_store()).validation or {})
                passed, failures = bool(validation.get("passed")), validation.get("failures", [])
            else:
                report = engine.validate_staged(plan, hive.open_store())
                validation = engine.validation_record(plan, report)
                passed, failures = report.passed, report.failures
        except HiveError as e:
            return dg.AssetCheckResult(passed=False, description=str(e),
                                       metadata=_memory_metadata(e.plan) if isinstance(e, ResourceError) else {})
        description = "; ".join(failures) or "within thresholds"
        # what was measured, also on the artifact's own page: its partition lists this beside the build's metadata
        context.op_execution_context.log_event(quality_observation(
            akey, context.partition_key, validation, plan.recipe.validation,
            "passed: " + description if passed else "rejected: " + description))
        return dg.AssetCheckResult(passed=passed, description=description,
                                   metadata={**check_metadata(validation, plan.recipe.validation), **_rate_metadata()})

    # Cheap (sizes and recorded digests, no model in memory): no pool, so it never waits behind a validation.
    @dg.asset_check(asset=akey, name=INTEGRITY_CHECK, blocking=True, partitions_def=models_partitions,
                    description=f"Every file of the {rid} build is in the store, intact (size and sha256), under the "
                                "build id its manifest names.")
    def integrity_check(context: dg.AssetCheckExecutionContext, hive: HiveResource, artifact: dict) -> dg.AssetCheckResult:
        try:
            plan = engine.plan(artifact["source"], rid, hive.config(), artifact["model_id"])
            problems = engine.integrity_problems(plan, hive.open_store())
        except HiveError as e:
            return dg.AssetCheckResult(passed=False, description=str(e))
        return dg.AssetCheckResult(passed=not problems, description="; ".join(problems) or "every blob intact",
                                   metadata={"build_id": plan.build_id, "problems": len(problems)})

    @dg.asset(key=published_key(rid), ins={"artifact": dg.AssetIn(akey)},
              partitions_def=models_partitions, group_name="publish", retry_policy=TRANSIENT_RETRY,
              description=f"{rid}: manifest and refs written; serving containers can pull it.")
    def published(context: dg.AssetExecutionContext, hive: HiveResource, artifact: dict) -> dg.MaterializeResult:
        try:
            plan = engine.plan(artifact["source"], rid, hive.config(), artifact["model_id"])
            res = engine.publish_staged(plan, hive.open_store(), hive.config())
        except HiveError as e:
            raise _failure(e) from None
        pending = res.format != plan.target.artifact_format(plan.recipe.options)
        return dg.MaterializeResult(metadata={
            "state": "compile_pending" if pending else res.state, "published": res.state, "skipped": res.skipped,
            "build_id": res.build_id, "manifest": res.manifest, "format": str(res.format),
            "store_uri": hive.store_uri(), **_sizes(res.files),
            # What a serving container runs for this build (pull, then exec the manifest's server). A pending
            # bundle is never served: its compiled form gets another build id and the recipe's `latest` tag.
            "serving_command": serving_command(artifact["model_id"], rid, None if pending else res.build_id,
                                               plan.recipe.runtime_profiles[0], hive.store_uri()),
            # the gated numbers of its validation: the asset's plots compare them across models (its partitions)
            **gated_numbers((res.validation or {}).get("metrics", {}), plan.recipe.validation),
        }, data_version=dg.DataVersion(res.build_id[:16]))

    assets = [artifact, published]
    if target_for(recipe.kind).hardware_step is not None:
        assets.append(_hardware_asset(recipe))
    return assets, [parity_check, integrity_check]


def serving_command(model_id: str, recipe_id: str, build_id: str | None, profile: str, store_uri: str) -> str:
    """`hive-aot serve` pinned to a build, or (build_id None: a bundle whose compile is pending) to the recipe's
    `latest`, which names the compiled artifact once there is one."""
    what = f"{model_id}@{build_id}" if build_id else f"{model_id} --recipe {recipe_id}"
    return f"hive-aot serve {what} --target {profile} --dest /models --store {store_uri}"


def _hardware_asset(recipe: Recipe) -> dg.AssetsDefinition:
    """<step>/<recipe> (qpc/qaic-mxfp6): the published artifact finished by its kind's hardware step on a host
    that has the hardware (the step's pool and Celery queue, so such hosts are never oversubscribed). Elsewhere
    the step records why it is pending and materializes nothing: the artifact waits in the store for
    `hive-aot compile` or a worker on such a host."""
    rid = recipe.id
    step = target_for(recipe.kind).hardware_step
    assert step is not None

    @dg.asset(key=hardware_key(recipe), deps=[published_key(rid)], partitions_def=models_partitions,
              group_name="publish", pool=step.pool, kinds={recipe.kind.split("-")[0]}, output_required=False,
              op_tags={CELERY_QUEUE_TAG: step.pool},
              description=f"{rid}: the published build finished by {step.name} on a host with {step.needs}, and "
                          f"published with its serving binding.")
    def finished(context: dg.AssetExecutionContext, hive: HiveResource):
        model_id = context.partition_key
        if rid not in hive.model(model_id).recipes:
            context.log.info(f"{model_id} does not request {rid}; nothing to finish")
            return
        missing = step.missing()
        if missing is not None:
            context.log.warning(f"{model_id} {rid}: published, {step.name} pending: {missing}")
            return
        try:
            (res,) = step.finish_published(model_id, hive.config(), hive.open_store(), rid)
        except HiveError as e:
            raise _failure(e) from None
        # numbers the step recorded beside the validation (the QPC's program size and compile time)
        numbers = {k: v for k, v in (res.validation or {}).get(step.name, {}).items() if isinstance(v, (int, float))}
        yield dg.Output(None, data_version=dg.DataVersion(res.build_id[:16]), metadata={
            "state": res.state, "build_id": res.build_id, "manifest": res.manifest, "format": str(res.format),
            **_sizes(res.files), **numbers})

    return finished


def all_recipe_assets(recipes: Iterable[Recipe]) -> tuple[list[dg.AssetsDefinition], list[dg.AssetChecksDefinition]]:
    assets: list[dg.AssetsDefinition] = []
    checks: list[dg.AssetChecksDefinition] = []
    for r in sorted(recipes, key=lambda r: r.id):
        a, c = recipe_assets(r)
        assets += a
        checks += c
    return assets, checks


def broken_recipe_specs(broken: dict[str, str]) -> list[dg.AssetSpec]:
    """A recipe left out of the code location (Config.load_tolerant), visible in the catalog with its reason."""
    return [dg.AssetSpec(key=dg.AssetKey(["broken_recipe", rid]), group_name="broken_recipes",
                         description=f"Recipe {rid} is broken and was left out: {why}",
                         metadata={"reason": why}) for rid, why in sorted(broken.items())]
