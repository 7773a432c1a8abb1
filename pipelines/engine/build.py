"""The build engine: fetch -> classify -> build -> stage -> validate -> publish, without Dagster.

The same three steps run from the CLI (`build_and_publish`) and as separate Dagster assets
(`stage`, `validate_staged`, `publish_staged`), which exchange only the store URI and build id.
Nothing unvalidated becomes visible: a build stages its candidate manifest under
`staging/<build-id>.json`; only a validated candidate is written to `manifests/` and then the
refs (the commit point). A rejected candidate's staging record is removed; its blobs are left for gc.

Before any work, the memory plan (memory.py) of every recipe to build is checked: a model that cannot fit
this host's memory or disk is refused in one line, with nothing built or published. A disk that fills up
anyway is the same kind of line (`DiskFull`), naming the step; the work dir goes with its partial files.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from ..config.registry import Config
from ..core import meter, progress
from ..core.errors import DiskFull, HiveError, IntegrityError, StoreError, ValidationFailed
from ..core.host import disk_full_cause, disk_full_error
from ..core.paths import reclaim_work, work_dir
from ..model.memory import MemoryPlan, model_facts, plan_build
from ..store import Store, blob_key, manifest_key, open_store, staging_key, staging_lease
from ..store.documents import commit_manifest, materialize_blobs, publish_profiles, repair_commit
from ..store.layout import check_binding
from ..store.manifest import FileEntry, Manifest, ModelInfo, RecipeInfo
from ..targets import InputArtifact, ValidationReport
from ..targets.build_result import BuildResult
from .model_description import describe_build
from .planning import Plan, plan, recipe_hardware  # noqa: F401 - re-exported: the engine's entry points


def _reported(engine_step):
    """An engine entry point whose build steps are named by the recipe in their progress lines (progress.py)."""
    @functools.wraps(engine_step)
    def run(p: Plan, *args, **kwargs):
        with progress.subject(p.recipe.id):
            return engine_step(p, *args, **kwargs)
    return run


def _measured_as(step: str):
    """An engine entry point that is a build step of its own (meter.py): measured, and reported wherever it runs
    (the CLI's build, a Dagster asset)."""
    def wrap(engine_step):
        @functools.wraps(engine_step)
        def run(*args, **kwargs):
            with meter.step(step):
                return engine_step(*args, **kwargs)
        return run
    return wrap


def published_manifest(p: Plan, store: Store) -> Manifest | None:
    """The manifest already published for this build id, if any (then the build is skipped)."""
    key = manifest_key(p.model_id, p.recipe.id, p.build_id)
    raw = store.read_bytes(key)
    if raw is None:
        return None
    m = Manifest.parse(raw, f"{store.uri}: {key}")
    check_binding(m, key, p.model_id, store.uri)  # a manifest moved there is no reason to skip the build
    return m


def _result(p: Plan, store: Store, state: str, manifest: Manifest, skipped: bool) -> BuildResult:
    key = (manifest_key(p.model_id, p.recipe.id, p.build_id) if state in ("published", "skipped", "repaired")
           else staging_key(p.build_id))
    return BuildResult(
        build_id=p.build_id, model_id=p.model_id, recipe=p.recipe.id, manifest=f"{store.uri.rstrip('/')}/{key}",
        skipped=skipped, state=state, validation=manifest.validation,
        files=[f.model_dump() for f in manifest.files], compatibility=p.compatibility.model_dump(),
        format=manifest.format,
    )


def input_artifact(p: Plan, store: Store, work: Path) -> InputArtifact:
    """The published artifact of a derived build's input, placed under `work` (verified)."""
    assert p.parent is not None
    m = published_manifest(p.parent, store)
    if m is None:
        raise StoreError(f"{p.recipe.id} is built from {p.parent.recipe.id} build {p.parent.build_id[:12]}, which is "
                         f"not published in {store.uri}: build it first (hive-aot build SOURCE --recipe {p.parent.recipe.id})")
    materialize_blobs(store, m.files, work)
    return InputArtifact(recipe=p.parent.recipe.id, build_id=p.parent.build_id, manifest=m, root=work)


def resource_plan(p: Plan, store: Store) -> MemoryPlan:
    """Each step's estimated peak memory and disk for this build, against this host (memory.py)."""
    return plan_build(p, store)


def _reported_plan(p: Plan, store: Store) -> dict[str, Any] | None:
    """The plan for a result that does not depend on it (a skipped build): never a reason to fail."""
    try:
        return resource_plan(p, store).to_json()
    except HiveError:
        return None


def check_resources(p: Plan, store: Store) -> None:
    """Refuse, before any work, a build chain whose steps cannot fit this host: every recipe of it that is
    not published yet (published ones are skipped, whatever their size)."""
    chain = []
    while p is not None:
        chain.insert(0, p)
        p = p.parent
    for q in chain:
        if published_manifest(q, store) is None:
            resource_plan(q, store).check()


def _label(p: Plan) -> str:
    return f"{p.recipe.id} of {p.model_id}"


def _published_intact(p: Plan, store: Store, existing: Manifest | None) -> BuildResult | None:
    """The skipped result of a build whose `existing` published manifest has every blob intact (its commit
    finished: signature, missing refs), else None: the build has work to do (build, or repair)."""
    if existing is None or not all(store.blob_intact(f.sha256, f.size) for f in existing.files):
        return None
    repair_commit(store, existing, pending=p.pending(existing))
    return _result(p, store, "skipped", existing, skipped=True)


def unchanged(p: Plan, store: Store) -> BuildResult | None:
    """The result `build_and_publish` would return for plan `p` without doing anything, or None when it has work
    to do: the build id (its inputs as they are now) published, intact and in its finished format. A bundle that
    waits for a compile is never unchanged (this host may compile it now). What a no-op onboarding asks per
    recipe before it starts a run (planning.plan_each: config and headers read, digests cached by file identity;
    then a manifest and its blobs' sizes from the store)."""
    res = _published_intact(p, store, published_manifest(p, store))
    if res is None or res.format != p.target.artifact_format(p.recipe.options):
        return None
    return res


@_reported
def stage(p: Plan, store: Store) -> BuildResult:
    """Check the memory plan, build the artifact, upload its blobs and write the staging record.

    An already published build is skipped only if the blobs its manifest names are intact (the store's
    `blob_intact` policy: full sha256 locally, remembered per file stamp; size + recorded sha256 on S3).
    Otherwise it is rebuilt (builds are deterministic) and the damaged blobs are uploaded again:
    state "repaired", nothing else changes.
    """
    existing = published_manifest(p, store)
    res = _published_intact(p, store, existing)
    if res is not None:
        res.memory_plan = _reported_plan(p, store)
        return res
    resources = resource_plan(p, store)
    resources.check()  # nothing is built for a model this host cannot hold
    store.check_writable()
    reclaim_work()  # what killed builds left behind
    step = "input"
    with work_dir(f"build-{p.build_id[:12]}-") as work:
        try:
            if p.parent is not None:
                with meter.step(p.target.build_step, label="input"):  # the plan's build step places its input
                    p.context.input = input_artifact(p, store, work / "input")
                (work / "out").mkdir()
                work = work / "out"
            step = p.target.build_step
            with meter.step(step):
                art = p.target.build(p.context, work)
                if p.parent is None:  # read from the source: its rate is comparable with a copy of the source
                    meter.work(nbytes=p.context.snapshot.weight_bytes)
            step = "publish"
            entries = []
            total = sum((art.root / rel).stat().st_size for rel in art.files)
            with meter.step(step, label="upload"), progress.bar(total, "upload") as uploaded:
                for rel in art.files:
                    path = art.root / rel
                    # Files copied unchanged from the source come with the digest the snapshot recorded (checked
                    # on upload); the others are hashed once, by put_blob. Replaces a damaged copy. The work dir
                    # goes right after: a local store may take the file itself.
                    digest = store.put_blob(path, art.known_digests.get(rel), handover=True)
                    entries.append(FileEntry(path=rel, sha256=digest, size=path.stat().st_size))
                    uploaded.update(entries[-1].size)
                meter.work(nbytes=total)
        except OSError as e:  # DiskFull (a HiveError) from the store or a child process, or the OS's ENOSPC
            cause = disk_full_cause(e, work)
            if cause is None:
                raise
            # Made here, before the work dir and its partial files go: the free space at the failure.
            raise _disk_full(e, p, step, work, store, cause) from None
        except DiskFull as e:
            raise _disk_full(e, p, step, work, store) from None
    if existing is not None:
        if entries != existing.files:
            raise IntegrityError(f"{store.uri}: build {p.build_id[:12]} has damaged blobs and rebuilding it gave other "
                                 "bytes than its manifest records: cannot repair (was the build not deterministic?)")
        repair_commit(store, existing, pending=p.pending(existing))
        res = _result(p, store, "repaired", existing, skipped=False)
        res.memory_plan = resources.to_json()
        return res
    s = p.snapshot
    serving = p.target.serving(p.context, [e.path for e in entries])
    manifest = Manifest(
        build_id=p.build_id,
        model=ModelInfo(id=s.model_id, revision=s.revision, commit=s.commit,
                        source=s.pinned_source if s.source.startswith("hf://") else "local",
                        license=s.license, gated=s.gated, content_digest=s.content_digest),
        recipe=RecipeInfo(id=p.recipe.id, kind=p.recipe.kind, digest=p.recipe.digest, options=p.recipe.options),
        runtime_profiles=list(serving), format=art.format or p.target.artifact_format(p.recipe.options), files=entries,
        toolchain=p.target.toolchain(), build=art.info, serving=serving,
        describe=describe_build(s.config(), (resources.facts or model_facts(s)).parameters, p.target, p.recipe.options),
    )
    try:
        store.write_bytes(staging_key(p.build_id),
                          json.dumps({"state": "staged", "manifest": manifest.model_dump(mode="json")}).encode())
    except DiskFull as e:
        raise _disk_full(e, p, "publish", None, store) from None
    res = _result(p, store, "staged", manifest, skipped=False)
    res.memory_plan = resources.to_json()
    return res


def _disk_full(e: OSError | DiskFull, p: Plan, step: str, work: Path | None, store: Store,
               cause: int | None = None) -> DiskFull:
    """A full disk during a build step as one DiskFull line naming the build, the step and the file system."""
    if isinstance(e, DiskFull):
        if e.path is None:  # from a child process (the quantizer): its line names the step; add the build
            return e if str(e).startswith(_label(p)) else DiskFull(f"{_label(p)}: {e}")
        return disk_full_error(e.errno_code, e.path, subject=_label(p), step=step)
    where = e.filename if isinstance(e.filename, str) else work
    if where is None:
        where = getattr(store, "root", None) or "."
    return disk_full_error(cause or e.errno, where, subject=_label(p), step=step)


def _staged(store: Store, p: Plan) -> tuple[str, Manifest]:
    key = staging_key(p.build_id)
    doc = store.read_json(key)
    if doc is None:
        raise StoreError(f"no staged candidate for build {p.build_id[:12]} in {store.uri}")
    if not isinstance(doc, dict) or not isinstance(doc.get("manifest"), dict):
        raise IntegrityError(f"{store.uri}: {key} is not a staging record: the store is damaged")
    return str(doc.get("state")), Manifest.parse(doc["manifest"], f"{store.uri}: {key}")


def integrity_problems(p: Plan, store: Store) -> list[str]:
    """What is wrong with a build's files in the store, one line each (empty: intact): every blob its published
    manifest (or, before publishing, its staged candidate) names must be there and intact by the store's
    verification policy (local: size and a sha256 cached per file stamp; S3: size and the uploaded digest)."""
    manifest = published_manifest(p, store)
    if manifest is None:
        _state, manifest = _staged(store, p)
    if manifest.build_id != p.build_id:
        return [f"the manifest names build {manifest.build_id[:12]}, not {p.build_id[:12]}"]
    problems = []
    for f in manifest.files:
        if store.size(blob_key(f.sha256)) is None:
            problems.append(f"{f.path}: blob {f.sha256[:12]} is missing from {store.uri}")
        elif not store.blob_intact(f.sha256, f.size):
            problems.append(f"{f.path}: blob {f.sha256[:12]} in {store.uri} does not hold its {f.size} bytes and sha256")
    return problems


@_reported
def validate_staged(p: Plan, store: Store) -> ValidationReport:
    """Validate the staged candidate numerically; the result is recorded in the staging record.

    The reference and validation steps of the memory plan are checked again first: Dagster may run this on
    another host than the build. A refusal leaves the candidate staged (a larger host can validate it)."""
    _state, manifest = _staged(store, p)
    resource_plan(p, store).check(steps=("reference", "validate"), outcome="nothing was published")
    try:
        with staging_lease.held(store, staging_key(p.build_id)), work_dir(f"validate-{p.build_id[:12]}-") as work, \
                meter.step("validate"):
            try:
                materialize_blobs(store, manifest.files, work)
                report = p.target.validate(p.context, work, {f.path: f.sha256 for f in manifest.files})
            except OSError as e:
                cause = disk_full_cause(e, work)
                if cause is None:
                    raise
                raise _disk_full(e, p, "validate", work, store, cause) from None
            except DiskFull as e:
                raise _disk_full(e, p, "validate", work, store) from None
    except BaseException:
        # Validation itself failed (engine crash, interrupt): the candidate can never be published as
        # it is, so its record goes; its blobs are left for gc.
        store.delete(staging_key(p.build_id))
        raise
    manifest.validation = validation_record(p, report)
    if report.passed:
        store.write_bytes(staging_key(p.build_id),
                          json.dumps({"state": "validated", "manifest": manifest.model_dump(mode="json")}).encode())
    else:
        # Nothing of a rejected build stays visible; its blobs are unreferenced and left for gc.
        store.delete(staging_key(p.build_id))
    return report


def validation_record(p: Plan, report: ValidationReport) -> dict[str, Any]:
    return {"passed": report.passed, "failures": report.failures, "metrics": report.metrics,
            "thresholds": p.recipe.validation.model_dump(mode="json"), **report.details}


@_reported
@_measured_as("publish")
def publish_staged(p: Plan, store: Store, config: Config | None = None) -> BuildResult:
    """Manifest, then refs: the `latest` ref write is the commit point."""
    existing = published_manifest(p, store)
    if existing is not None:
        repair_commit(store, existing, pending=p.pending(existing))
        store.delete(staging_key(p.build_id))  # a concurrent builder's candidate of the same build
        return _result(p, store, "skipped", existing, skipped=True)
    state, manifest = _staged(store, p)
    if state != "validated":
        raise ValidationFailed(f"build {p.build_id[:12]} is {state}, not validated: refusing to publish")
    # Once the manifest is written, every gc keeps its blobs (staging_lease.py): check they outlived the wait.
    commit_manifest(store, manifest, pending=p.pending(manifest),
                    before_refs=lambda mkey: _refuse_missing_blobs(store, p, manifest, mkey))
    store.delete(staging_key(p.build_id))
    if config is not None:
        publish_profiles(store, config.registry.runtime_profiles)
    return _result(p, store, "published", manifest, skipped=False)


def _refuse_missing_blobs(store: Store, p: Plan, manifest: Manifest, mkey: str) -> None:
    """The manifest is written but no ref names it yet: if a blob it names is gone (a gc took a candidate whose
    lease had run out), take the manifest and the candidate back and fail, rather than publish it."""
    gone = [f for f in manifest.files if store.size(blob_key(f.sha256)) != f.size]
    if not gone:
        return
    store.delete(mkey)
    store.delete(staging_key(p.build_id))
    raise StoreError(f"{store.uri}: build {p.build_id[:12]} of {p.model_id} ({p.recipe.id}) lost {len(gone)} blob(s) "
                     f"before publishing ({gone[0].path}: {gone[0].sha256[:12]}; a gc ran while it was staged?): "
                     f"nothing was published, build it again")


def build_and_publish(source: str, recipe_id: str, config: Config, store_uri: str | None = None,
                      model_id: str | None = None) -> BuildResult:
    """One recipe from a source to the furthest state this host can reach: its inputs first (built, or
    reused by build id), then the recipe; an AI 100 compile recipe then compiles where the SDK is."""
    store = open_store(store_uri)
    store.check_writable()  # fail before spending build time
    p = plan(source, recipe_id, config, model_id)
    check_resources(p, store)  # the whole chain, before its first step builds anything
    return _build_chain(p, store, config)


def _build_chain(p: Plan, store: Store, config: Config) -> BuildResult:
    upstream = None
    if p.parent is not None:
        upstream = _build_chain(p.parent, store, config)
        if upstream.state == "rejected":
            return BuildResult(build_id=p.build_id, model_id=p.model_id, recipe=p.recipe.id, manifest="", skipped=False,
                               state="rejected", validation=upstream.validation, input=upstream,
                               reason=f"its input {upstream.recipe} was rejected")
    res = _build_one(p, store, config)
    res.input = upstream
    if res.state != "rejected" and res.format != p.target.artifact_format(p.recipe.options):
        # Published short of the recipe's format (an AI 100 export bundle): the target finishes it where
        # this host can (the compile, given the SDK) or says why it is pending.
        return p.target.complete(res, store, config)
    return res


def _published_meanwhile(p: Plan, store: Store, error: StoreError) -> BuildResult:
    """The skipped result when a concurrent builder of the same build published it while this one validated or
    published (its commit deletes the staging record both share: this one then finds none); otherwise `error`,
    the store's, stands."""
    res = _published_intact(p, store, published_manifest(p, store))
    if res is None:
        raise error
    return res


def _build_one(p: Plan, store: Store, config: Config) -> BuildResult:
    meter.reset()
    staged = stage(p, store)
    if staged.state in ("skipped", "repaired"):  # published before: nothing to validate or publish
        return staged
    try:
        report = validate_staged(p, store)
    except StoreError as e:
        return _published_meanwhile(p, store, e)
    if not report.passed:
        return BuildResult(build_id=p.build_id, model_id=p.model_id, recipe=p.recipe.id, manifest="", skipped=False,
                           state="rejected", validation=validation_record(p, report), files=staged.files,
                           memory_plan=staged.memory_plan, memory_measured=meter.measured(),
                           step_seconds=meter.seconds(), step_rates=meter.rates())
    try:
        res = publish_staged(p, store, config)  # a step of its own (measured and reported)
    except StoreError as e:
        return _published_meanwhile(p, store, e)
    res.memory_plan = staged.memory_plan
    res.memory_measured = meter.measured()
    res.step_seconds = meter.seconds()
    res.step_rates = meter.rates()
    return res


