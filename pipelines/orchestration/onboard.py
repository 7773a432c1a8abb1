"""`hive-aot onboard`: run the Dagster onboarding job headless, one run per registry model.

Uses the persistent instance in $DAGSTER_HOME (default ./.dagster, SQLite), so the runs, checks
and metadata appear in the UI (`make ui`) afterwards.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg

from ..config.registry import Config
from ..core.errors import ConfigError
from ..core.settings import DAGSTER_HOME
from ..store import open_store
from .factories import INTEGRITY_CHECK, PARITY_CHECK, SUMMARY_KEY, artifact_key, hardware_key, model_asset_keys, published_key
from .partitions import models_partitions, partition_key
from .pools import apply_pool_limits, process_tags, release_dead_claims
from .quality import full_build_id
from .resources import HiveResource
from .summary import failure_line

if TYPE_CHECKING:
    from ..engine.planning import Plan


@dataclass
class OnboardedRecipe:
    """One recipe of an onboarded model: what its run (or the check before it) left. `state`: published, skipped
    (unchanged since its published build), compile_pending (an AI 100 bundle waiting for the SDK), rejected (its
    parity check failed) or failed (`error` says why); `run_id`: the Dagster run to open, or why there was none."""

    model_id: str
    recipe: str
    state: str = "failed"
    build_id: str = ""
    run_id: str = ""
    manifest: str | None = None
    size: int | None = None
    skipped: bool = False
    bundle_build_id: str | None = None  # the export bundle a compiled QPC was made from
    error: str | None = None
    check: dict[str, Any] = field(default_factory=dict)  # the parity check's metrics

    def to_json(self) -> dict[str, Any]:
        """As `onboard --json` writes it: what was not recorded is left out."""
        return {k: v for k, v in asdict(self).items() if v is not None and v != {}}


@dataclass
class OnboardReport:
    success: bool  # every recipe published, skipped or waiting for its hardware step
    dagster_home: str
    results: list[OnboardedRecipe]

    def to_json(self) -> dict[str, Any]:
        return {"success": self.success, "dagster_home": self.dagster_home,
                "results": [r.to_json() for r in self.results]}


INSTANCE_SETTINGS = Path(__file__).with_name("dagster.yaml")

# Step events, tracebacks included, go to the instance (and the UI), not to the terminal: `hive-aot onboard`
# prints one line per failed step itself, with the run id to open in the UI.
QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


# the validation metrics a result row carries (the parity check's metadata, or a skipped build's manifest)
CHECK_METRICS = ("top1_agreement", "mean_kl", "max_abs_logit_delta", "token_parity", "vllm_loaded",
                 "vllm_top1_agreement", "vllm_greedy_agreement", "vllm_max_logprob_delta", "ort_top1_agreement",
                 "ort_max_abs_delta", "ort_min_cosine", "predicted_top1", "predicted_kl", "predicted_ppl_delta",
                 "predicted_cosine")


def _instance() -> dg.DagsterInstance:
    if not DAGSTER_HOME.is_set():
        os.environ[DAGSTER_HOME.name] = str(Path(".dagster").resolve())
    home = Path(DAGSTER_HOME.get())
    home.mkdir(parents=True, exist_ok=True)
    settings = home / "dagster.yaml"
    if not settings.exists():
        # The committed settings (no telemetry, pool default, run retries); an operator's own file is kept.
        shutil.copyfile(INSTANCE_SETTINGS, settings)
    instance = dg.DagsterInstance.get()
    apply_pool_limits(instance)  # validate_large: one at a time (pools.py)
    release_dead_claims(instance)  # slots a killed onboard left would block every later validation
    return instance


def _definitions(config: Config, store: str | None, recipes: str | None = None) -> dg.Definitions:
    # The same factories the code location uses (assets/ instantiates them from the ambient registry).
    from .automation import observe_revisions_job, onboard_job
    from .factories import all_recipe_assets, source_assets
    from .recipe_selection import recipes_in_code_location
    from .summary import summary_asset

    defined = recipes_in_code_location(config)
    recipe_assets, checks = all_recipe_assets(defined)
    return dg.Definitions(
        assets=source_assets() + recipe_assets + [summary_asset(defined)], asset_checks=checks,
        jobs=[onboard_job, observe_revisions_job],
        resources={"hive": HiveResource(registry=str(config.registry_file or ""), recipes=recipes or "",
                                        store=store or "")},
    )


def step_name(recipe_id: str) -> str:
    """The part of a step key Dagster derives from a recipe id (artifact/gguf-f16 -> artifact__gguf_f16)."""
    return re.sub(r"\W", "_", recipe_id)


def _summarize(result: dg.ExecuteInProcessResult, config: Config, model_id: str, recipes: list[str]) -> list[dict[str, Any]]:
    mats = {ev.asset_key: ev.materialization for ev in result.get_asset_materialization_events()
            if ev.asset_key is not None}
    evaluations = [e.event_specific_data for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"]
    checks = {ev.asset_check_key.asset_key: ev for ev in evaluations if ev.asset_check_key.name == PARITY_CHECK}
    broken = {ev.asset_check_key.asset_key: ev for ev in evaluations
              if ev.asset_check_key.name == INTEGRITY_CHECK and not ev.passed}
    failures = {e.step_key: failure_line(e.event_specific_data.error)
                for e in result.all_events if e.event_type_value == "STEP_FAILURE"}
    rows = []
    for rid in recipes:
        row = OnboardedRecipe(model_id, rid)
        pub = mats.get(published_key(rid))
        art = mats.get(artifact_key(rid))
        chk = checks.get(artifact_key(rid))
        finished_key = hardware_key(config.recipe(rid))
        compiled = mats.get(finished_key) if finished_key is not None else None
        if pub is not None:
            md = (compiled or pub).metadata
            row = replace(row, state=md["state"].value, build_id=md["build_id"].value, manifest=md["manifest"].value,
                          size=md["size_bytes"].value,
                          # a bundle reused by build id is skipped although its state stays compile_pending
                          skipped=bool(md["skipped"].value) if "skipped" in md else md["state"].value == "skipped")
            if compiled is not None:
                row.bundle_build_id = pub.metadata["build_id"].value
        elif (chk is not None and not chk.passed) or artifact_key(rid) in broken:
            failed = chk if chk is not None and not chk.passed else broken[artifact_key(rid)]
            row = replace(row, state="rejected", build_id=full_build_id(art.metadata) if art else "",
                          error=failed.description)
        else:
            # its own step's error, else the first failure upstream of it (snapshot, compatibility, its input)
            own = [m for k, m in failures.items() if k.split("__", 1)[-1] == step_name(rid)]
            err = (own or list(failures.values()) or ["not built"])[0]
            row = replace(row, state="failed", error=err)
        if chk is not None:
            row.check = {k: v.value for k, v in chk.metadata.items() if k in CHECK_METRICS}
        rows.append(row)
    return rows


def _plans(config: Config, entry) -> tuple[dict[str, Plan], dict[str, str]]:
    """The plans of a model's recipes, and the refusal line of each recipe that does not apply: one planning
    (one fetch, config and weight headers read, digests cached by file identity) answers both `_unchanged`
    and `_inapplicable`."""
    from ..engine.planning import plan_each

    refused: dict[str, str] = {}
    return plan_each(config.model_source(entry), entry.recipes, config, entry.id, refused=refused), refused


def _inapplicable(config: Config, entry, refused: dict[str, str]) -> list[OnboardedRecipe]:
    """Recipes a model with a local source cannot take, found before any Dagster run by the planning `_plans`
    did (`refused`: recipe -> its refusal's line): one failed row each, with that line. Hub sources are left to
    the run, whose step reports the refusal, as they were when answering here meant asking the Hub again."""
    from ..source.fetch import parse_source

    if parse_source(config.model_source(entry)).kind == "hf":
        return []
    return [OnboardedRecipe(entry.id, rid, error=refused[rid], run_id="none: refused before the run")
            for rid in entry.recipes if rid in refused]


def _unchanged(entry, plans: dict[str, Plan], store) -> list[OnboardedRecipe]:
    """Recipes of a model whose build would be a no-op (build.unchanged: the build id of its inputs as they are
    now published, intact, finished): one skipped row each, and no Dagster run for them. A run spends about a
    second per model storing its step events; deciding this costs the plan (`_plans`) and a few store reads."""
    from ..engine.build import unchanged

    rows = []
    for rid, p in plans.items():
        res = unchanged(p, store)
        if res is None:
            continue
        metrics = (res.validation or {}).get("metrics") or {}
        rows.append(OnboardedRecipe(entry.id, rid, "skipped", res.build_id, "none: unchanged since its published build",
                                    res.manifest, sum(f["size"] for f in res.files), skipped=True,
                                    check={k: v for k, v in metrics.items() if k in CHECK_METRICS}))
    return rows


def onboard(registry: str | None = None, store: str | None = None, models: list[str] | None = None,
            recipes: str | None = None) -> OnboardReport:
    config = Config.load(registry, recipes)
    entries = [m for m in config.registry.models if not models or m.id in models]
    missing = set(models or []) - {m.id for m in entries}
    if missing:
        raise ConfigError(f"{config.origin}: no model(s) {', '.join(sorted(missing))}")
    instance = _instance()
    defs = _definitions(config, store, recipes)
    job = defs.resolve_job_def("onboard")
    keys = [partition_key(m.id) for m in entries]
    known = set(instance.get_dynamic_partitions(models_partitions.name))
    new = [k for k in keys if k not in known]
    if new:
        instance.add_dynamic_partitions(models_partitions.name, new)
    results, success = [], True
    opened = open_store(store)
    for entry, key in zip(entries, keys):
        plans, refusals = _plans(config, entry)
        done = _unchanged(entry, plans, opened)
        results += done
        refused = _inapplicable(config, entry, refusals) if len(done) < len(entry.recipes) else []
        results += refused
        success &= not refused
        settled = {x.recipe for x in done + refused}
        entry = entry.model_copy(update={"recipes": [r for r in entry.recipes if r not in settled]})
        if not entry.recipes:
            continue
        print(f"onboarding {entry.id}: {', '.join(entry.recipes)}", file=sys.stderr, flush=True)
        # Only the assets of the recipes the model lists: no step of another recipe is scheduled to build nothing.
        res = job.execute_in_process(partition_key=key, instance=instance, raise_on_error=False,
                                     asset_selection=model_asset_keys(config, entry),
                                     tags={"hive-aot/trigger": "cli-onboard", **process_tags()}, run_config=QUIET)
        rows = _summarize(res, config, entry.id, entry.recipes)
        if not any(e.asset_key == SUMMARY_KEY for e in res.get_asset_materialization_events()):
            # a failed recipe made the run skip the model's summary: it reads what the instance recorded, so a
            # run of it alone shows the failure in the UI's table too
            job.execute_in_process(partition_key=key, instance=instance, raise_on_error=False,
                                   asset_selection=[SUMMARY_KEY], tags={"hive-aot/trigger": "cli-onboard-summary",
                                                                        **process_tags()}, run_config=QUIET)
        # compile_pending: the AI 100 export bundle is published and waits for a host with the SDK.
        success &= res.success and all(r.state in ("published", "skipped", "compile_pending") for r in rows)
        results += [replace(r, run_id=res.run_id) for r in rows]
    return OnboardReport(success, DAGSTER_HOME.get() or "", results)
