"""Pull a prebuilt artifact into a serving container: ref -> manifest -> verified blobs -> DIR.

Light by design: no Dagster, no torch, no transformers. Blobs land in a content-addressed local
cache (verified by sha256, written to a partial file and renamed), then DIR is assembled in a
sibling temporary directory and renamed into place, so a DIR that exists is always complete.
Pulls of one DIR are serialized by a lock file next to it, so concurrent pulls wait and then find it complete.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import HiveError, IntegrityError, ResourceError
from ..core.paths import check_model_id, exclusive_lock, model_slug, safe_relpath
from ..core.progress import bar
from ..store import Store, manifest_key, open_store, ref_key
from ..store.documents import load_manifest
from ..store.layout import BUNDLE_TAG_PREFIX, PROFILES_KEY
from ..store.manifest import Manifest
from ..store.signing import signature_key, trusted_keys, verify_signature
from .blob_batch import fetch_blobs
from .blob_cache import TransferStats, check_cache_dirs, missing_bytes
from .blob_leftovers import reclaim_partials
from .build_ids import check_build_ref, resolve_build_id
from .engine_versions import engine_check
from .pull_result import AutoTarget, PullResult, Transfer
from .pulled_dir import FILE_MODE, MARKER, assemble, present
from .serve_policy import serving_summary


@dataclass
class Candidate:
    recipe: str
    manifest: Manifest
    ref: dict[str, Any] | None


def parse_model(spec: str) -> tuple[str, str | None]:
    """(model id, build id or a prefix of one, else None); `candidates` resolves a prefix against the store."""
    model, at, build = spec.partition("@")
    check_model_id(model, hint=" (pull takes org/name[@build_id])")
    if at:
        check_build_ref(build, hint="; pull takes org/name[@build_id]")
    return model, build or None


def candidates(store: Store, model_id: str, tag: str, build_id: str | None,
               recipe: str | None = None) -> list[Candidate]:
    """The published builds `tag` names (one per recipe), or those of `build_id` (a full id or a unique prefix;
    `recipe` only settles which build a prefix names: the caller still chooses among the recipes)."""
    slug = model_slug(model_id)
    out = []
    if build_id:
        keys = store.list(f"manifests/{slug}/")
        build_id = resolve_build_id(build_id, keys, model_id=model_id, where=store.uri, recipe=recipe)
        for key in keys:
            if key.endswith(f"/{build_id}.json"):
                out.append(Candidate(key.split("/")[2], load_manifest(store, key, None, model_id), None))
        return out
    for recipe_id in sorted({k.split("/")[2] for k in store.list(f"refs/{slug}/")}):
        ref = store.read_ref(ref_key(model_id, recipe_id, tag))
        if ref is None:
            continue
        out.append(Candidate(recipe_id, load_manifest(store, manifest_key(model_id, recipe_id, ref["build_id"]),
                                                       ref.get("manifest_sha256"), model_id), ref))
    return out


def _profiles(store: Store, registry: str | None) -> dict[str, dict[str, Any]]:
    """Runtime profiles: a deployment registry wins (over the packaged defaults), else the copy the
    publisher left in the store, else the packaged defaults."""
    from ..config.registry import load_registry, registry_path

    if registry_path(registry) is None:
        doc = store.read_json(PROFILES_KEY)
        if doc:
            profiles = doc.get("runtime_profiles") if isinstance(doc, dict) else None
            if not isinstance(profiles, list) or not all(
                    isinstance(p, dict) and isinstance(p.get("id"), str) and isinstance(p.get("serving", {}), dict)
                    and isinstance(p.get("recipe_preference", []), list) and isinstance(p.get("loads", []), list)
                    for p in profiles):
                raise IntegrityError(f"{store.uri}: {PROFILES_KEY} is not a list of runtime profiles: the store is "
                                     f"damaged (a deployment registry, --registry, does without it)")
            if profiles:
                return {p["id"]: p for p in profiles}
    reg, _ = load_registry(registry)
    return {p.id: p.model_dump(mode="json") for p in reg.runtime_profiles}


def choose(cands: list[Candidate], profile: str, recipe: str | None, preference: list[str]) -> Candidate:
    serving = [c for c in cands if profile in c.manifest.runtime_profiles]
    if recipe:
        match = [c for c in serving if c.recipe == recipe]
        if not match:
            have = ", ".join(c.recipe for c in cands) or "none"
            raise HiveError(f"no published {recipe} artifact serves {profile} (published recipes: {have})")
        return match[0]
    if not serving:
        have = ", ".join(f"{c.recipe} ({', '.join(c.manifest.runtime_profiles)})" for c in cands) or "none"
        raise HiveError(f"no published artifact serves {profile} (published: {have})")
    rank = {r: i for i, r in enumerate(preference)}
    return sorted(serving, key=lambda c: (rank.get(c.recipe, len(rank)), c.recipe))[0]


def profiles_report(model: str, *, tag: str = "latest", store_uri: str | None = None,
                    registry: str | None = None) -> dict[str, Any]:
    """What is published for a model, per runtime profile: the recipes that serve it (build, format, size),
    the one `pull --target <profile>` would take, pending AI 100 bundles, and what `--target auto` would choose
    on this host."""
    from .accelerators import choose_profile, detect

    store = open_store(store_uri)
    model_id, build_id = parse_model(model)
    store.check_exists()
    profiles = _profiles(store, registry)
    cands = candidates(store, model_id, tag, build_id)
    bundles = [] if build_id else candidates(store, model_id, BUNDLE_TAG_PREFIX + tag, None)
    if not cands and not bundles:
        what = f"build {build_id}" if build_id else f"tag {tag!r}"
        raise HiveError(f"{model_id}: nothing published with {what} in {store.uri}")
    rows = []
    for pid, prof in sorted(profiles.items(), key=lambda kv: (kv[1].get("vendor", ""), kv[0])):
        serving = [c for c in cands if pid in c.manifest.runtime_profiles]
        if not serving:
            continue
        pick = choose(serving, pid, None, prof.get("recipe_preference", [])) if serving else None
        rows.append({"profile": pid, "vendor": prof.get("vendor"), "role": prof.get("role"),
                     "image": prof.get("image"), "pull_picks": pick.recipe if pick else None,
                     "artifacts": [{"recipe": c.recipe, "build_id": c.manifest.build_id, "format": c.manifest.format,
                                    "size": c.manifest.total_size} for c in serving]})
    detected = detect()
    served = {pid for c in cands for pid in c.manifest.runtime_profiles}
    try:
        auto_profile, why = choose_profile(detected, profiles, served)
    except HiveError as e:
        auto_profile, why = None, str(e)
    # export bundles serve no profile until an SDK host compiles them (their manifests name none)
    pending = [{"recipe": c.recipe, "build_id": c.manifest.build_id, "format": c.manifest.format,
                "needs": c.manifest.pending_needs} for c in bundles]
    return {"model_id": model_id, "tag": tag, "store": store.uri, "profiles": rows, "pending_bundles": pending,
            "auto": {"found": detected.describe(), "profile": auto_profile, "why": why}}


def _finishes_as(c: Candidate) -> str | None:
    """The format a bundle's recipe finishes as (its target's artifact format), None when unknown here."""
    from ..config.kinds import target_class

    try:
        return target_class(c.manifest.recipe.kind).artifact_format(c.manifest.recipe.options)
    except Exception:  # noqa: BLE001 - a kind this install does not know
        return None


def _refuse_bundle_only(store: Store, model_id: str, profile: dict[str, Any], recipe: str | None, tag: str,
                        build_id: str | None, cands: list[Candidate]) -> None:
    """Where only an export bundle (a compile still pending) is published for what was asked, say so in one
    line naming it: a bundle is never handed to a server. Only a bundle whose finished form the profile loads
    counts: for any other profile, nothing is published (and the caller lists what is)."""
    profile_id = profile.get("id")
    bundles = [c for c in cands if c.manifest.build.get("state") == "compile_pending"] if build_id else \
        candidates(store, model_id, BUNDLE_TAG_PREFIX + tag, None)
    loads = profile.get("loads")
    bundles = [c for c in bundles if (recipe is None or c.recipe == recipe) and (not loads or _finishes_as(c) in loads)]
    if not bundles:
        return
    b = bundles[0]
    raise HiveError(f"{model_id}: {b.recipe} is only an export bundle so far (build {b.manifest.build_id[:12]}, "
                    f"{b.manifest.format}): nothing {profile_id} can load is published; compile it on a host with "
                    f"{b.manifest.pending_needs}: hive-aot compile {model_id} --recipe {b.recipe}")


def pull(model: str, target: str, dest: Path, *, recipe: str | None = None, tag: str = "latest",
         store_uri: str | None = None, registry: str | None = None, strict: bool = False,
         trusted: str | None = None, fetch: bool = True, allow_stand_in: bool = False) -> PullResult:
    """`trusted`: public key files (comma-separated; default $HIVE_AOT_TRUSTED_KEYS) whose signature the
    manifest must carry (signing.py); none: no signature is required. An artifact a stand-in made (manifest
    `build.stand_in`: a test compiler's placeholder) is refused unless `allow_stand_in`. `fetch=False` (serve --dry-run): the
    same choice and checks of the manifest, and what DIR would hold, without downloading or writing it."""
    store = open_store(store_uri)
    model_id, build_id = parse_model(model)
    store.check_exists()
    profiles = _profiles(store, registry)
    cands = candidates(store, model_id, tag, build_id, recipe)
    auto = None
    if target == "auto":
        from .accelerators import choose_profile, detect

        detected = detect()
        served = {pid for c in cands if recipe is None or c.recipe == recipe for pid in c.manifest.runtime_profiles}
        # with nothing published for the model, the vendor's own first profile names what is missing below
        profile_id, why = choose_profile(detected, profiles, served if cands else set(profiles))
        auto = AutoTarget(detected=detected.vendor, devices=detected.devices, evidence=list(detected.evidence),
                          found=detected.describe(), profile=profile_id, why=why)
    else:
        profile_id = target
    if profiles and profile_id not in profiles:
        raise HiveError(f"unknown runtime profile {profile_id!r} (known: {', '.join(sorted(profiles))})")
    profile = profiles.get(profile_id, {"id": profile_id})
    if not cands and not build_id:
        _refuse_bundle_only(store, model_id, profile, recipe, tag, build_id, cands)
    if not cands:
        what = f"build {build_id}" if build_id else f"tag {tag!r}"
        raise HiveError(f"{model_id}: nothing published with {what} in {store.uri}")
    if not any(profile_id in c.manifest.runtime_profiles and (recipe is None or c.recipe == recipe) for c in cands):
        _refuse_bundle_only(store, model_id, profile, recipe, tag, build_id, cands)
    chosen = choose(cands, profile_id, recipe, profile.get("recipe_preference", []))
    m = chosen.manifest
    for f in m.files:
        safe_relpath(f.path, what="manifest file path")
    if m.build.get("stand_in") and not allow_stand_in:
        raise HiveError(f"{model_id} {chosen.recipe} (build {m.build_id[:12]}) was made by a stand-in, not the real "
                        f"toolchain ({str(m.build['stand_in'])[:120]}): refusing to hand it to a server "
                        f"(--allow-stand-in pulls it for tests)")
    keys = trusted_keys(trusted)
    mkey = manifest_key(model_id, chosen.recipe, m.build_id)
    raw = store.read_bytes(mkey) or b""
    if Manifest.parse(raw, f"{store.uri}: manifest {mkey}") != m:  # what is verified is what is served
        raise IntegrityError(f"{store.uri}: manifest {mkey} changed while pulling")
    # tampering, not only damage: with trusted keys, the manifest and its files must carry a trusted signature
    signature = store.read_bytes(signature_key(mkey))  # read once: the bytes verified are the bytes DIR keeps
    signed_by = verify_signature(signature, raw, keys, f"{store.uri}: {mkey}") if keys else None
    beside = _beside(store, mkey, raw, m, signature)
    engines = engine_check(m)
    differs = [e for e in engines if e["status"] == "differs"]
    if strict and differs:
        raise HiveError(f"{model_id} {chosen.recipe} (build {m.build_id[:12]}) was validated with "
                        + ", ".join(f"{e['engine']} {e['validated_with']}" for e in differs) + "; this container has "
                        + ", ".join(f"{e['engine']} {e['here']}" for e in differs) + " (--strict): nothing was pulled")
    warnings = [f"{model_id} {chosen.recipe} was validated with {e['engine']} {e['validated_with']}, this container "
                f"has {e['here']}" for e in differs]

    dest = dest.resolve()
    if dest == dest.parent:  # DIR is replaced as a whole, and its lock file lives beside it
        raise HiveError(f"cannot pull into {dest}: name a directory below it")
    marker_doc = {"model_id": model_id, "build_id": m.build_id, "recipe": chosen.recipe, "runtime_profile": profile,
                  "serving": {**profile.get("serving", {}), **m.serving_for(profile_id)},
                  "manifest": m.model_dump(mode="json")}
    def result(**outcome: Any) -> PullResult:
        return PullResult(**serving_summary(marker_doc, dest, m, signed=signed_by is not None), auto_target=auto,
                          engines=engines, warnings=warnings, signed_by=signed_by, **outcome)

    if not fetch:
        return result(fetched=False, already_present=present(dest, m, beside))
    # Held from the "already present" check to the swap: a second pull of DIR waits, then finds it complete.
    with dest_lock(dest):
        if present(dest, m, beside):
            return result(already_present=True)
        check_cache_dirs({f.sha256 for f in m.files})
        # what dead pulls left in the cache, except the partials this pull resumes
        reclaim_partials(keep={f.sha256 for f in m.files})
        check_disk_for_pull(m, dest)
        stats = TransferStats()
        with bar(m.total_size, f"pull {chosen.recipe}") as pb:
            blobs = fetch_blobs(store.blobs_for(mkey), {f.sha256: f.size for f in m.files}, pb, stats=stats)
        try:
            assemble(dest, m, blobs, marker_doc, beside)
        except OSError as e:
            raise _cannot_write(dest, e) from None
    return result(already_present=False, transfer=Transfer(fetched_bytes=stats.fetched, resumed_bytes=stats.resumed,
                                                           cached_blobs=stats.cached_blobs))


def _beside(store: Store, mkey: str, raw: bytes, m: Manifest, signature: bytes | None) -> dict[str, bytes]:
    """What DIR holds besides the build's files: the manifest's exact bytes and, for a signed build, its OMS
    bundle as the standard signature file (`model_signing verify key --signature DIR/model.sig ... DIR` checks a
    pulled directory as it is). A legacy Ed25519 signature is not an OMS bundle: not written."""
    from ..store.oms import MANIFEST_FILE, SIGNATURE_FILE, is_bundle

    beside = {MANIFEST_FILE: raw}
    if signature is not None and is_bundle(signature):
        beside[SIGNATURE_FILE] = signature
    clash = sorted({f.path for f in m.files} & {MANIFEST_FILE, SIGNATURE_FILE, MARKER})
    if clash:
        raise IntegrityError(f"{store.uri}: manifest {mkey} lists {clash[0]!r}, a name hive-aot keeps for itself in a "
                             "pulled directory: refusing it")
    return beside


def check_disk_for_pull(m: Manifest, dest: Path) -> None:
    """Refuse in one line, before downloading, a pull whose blobs do not fit the cache's file system (what a
    killed pull already wrote counts as there), or whose files do not fit DIR's when it is on another one
    (copies there instead of hard links)."""
    from ..core.host import free_bytes
    from ..core.units import human_bytes
    from .blob_cache import blob_path

    cache_dir = blob_path("0" * 64).parent.parent
    need = sum(missing_bytes(f.sha256, f.size) for f in {f.sha256: f for f in m.files}.values())
    free = free_bytes(cache_dir)
    if need > free:
        raise ResourceError(f"pull of {m.model.id} needs {human_bytes(need)} more in the blob cache {cache_dir}, "
                            f"which has {human_bytes(free)} free; nothing was downloaded")
    if _device(dest.parent) != _device(cache_dir) and m.total_size > free_bytes(dest.parent):
        raise ResourceError(f"pull of {m.model.id} needs {human_bytes(m.total_size)} in {dest.parent} (another file "
                            f"system than the blob cache: files are copied), which has "
                            f"{human_bytes(free_bytes(dest.parent))} free; nothing was downloaded")


def _device(path: Path) -> int | None:
    while not path.exists() and path.parent != path:
        path = path.parent
    try:
        return path.stat().st_dev
    except OSError:
        return None


def _cannot_write(dest: Path, e: OSError) -> HiveError:
    return HiveError(f"cannot pull into {dest} ({e.filename or dest}: {e.strerror or type(e).__name__})")


@contextmanager
def dest_lock(dest: Path):
    """An exclusive flock on `<parent>/.<name>.lock` for the block (paths.exclusive_lock); a directory that
    cannot hold it is one line."""
    lock = dest.with_name(f".{dest.name}.lock")
    held = ExitStack()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        held.enter_context(exclusive_lock(lock, FILE_MODE))
    except OSError as e:  # /proc, a read-only volume, a regular file on the way
        raise _cannot_write(dest, e) from None
    with held:
        yield
