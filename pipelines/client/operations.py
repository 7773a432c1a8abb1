"""Operators' changes to what a store serves: point a tag at a build (promote, roll back), retire a model.

Both are base-install commands (no torch, no Dagster), like pull. The store's invariant holds throughout:
a ref only ever names a manifest that exists, so `tag` writes the ref last, and `retire` deletes every ref
of the model before any of its manifests; the blobs they named are left to `gc`, which collects those no
remaining manifest references (a blob another model shares stays).
"""

from __future__ import annotations

from typing import Any

from ..core.errors import HiveError
from ..core.paths import model_slug
from ..store import manifest_key, open_store, ref_key
from ..store.layout import BUNDLE_TAG_PREFIX, check_binding, check_recipe_id, ref_document
from ..store.manifest import Manifest
from .build_ids import resolve_build_id


def find_build(store, model_id: str, build_id: str, recipe: str | None = None) -> tuple[str, Manifest]:
    """(recipe, manifest) of a published build of the model (`build_id`: a full id or a unique prefix); one line
    when there is none (or it is ambiguous)."""
    keys = store.list(f"manifests/{model_slug(model_id)}/")
    build_id = resolve_build_id(build_id, keys, model_id=model_id, where=store.uri, recipe=recipe)
    found = [k for k in keys if k.endswith(f"/{build_id}.json")
             and (recipe is None or k == manifest_key(model_id, recipe, build_id))]
    if not found:
        raise HiveError(f"{model_id}: no published build {build_id}" + (f" of {recipe}" if recipe else "")
                        + f" in {store.uri}")
    if len(found) > 1:
        recipes = ", ".join(k.split("/")[2] for k in found)
        raise HiveError(f"{model_id}: build {build_id[:12]} is published for several recipes ({recipes}): give --recipe")
    key = found[0]
    raw = store.read_bytes(key)
    if raw is None:
        raise HiveError(f"{model_id}: manifest {key} disappeared while reading it")
    m = Manifest.parse(raw, f"{store.uri}: {key}")
    check_binding(m, key, model_id, store.uri)
    return key.split("/")[2], m


def tag(model: str, tag_name: str, *, recipe: str | None = None, store_uri: str | None = None) -> dict[str, Any]:
    """Point `tag_name` of MODEL@BUILD_ID's recipe at that build (promote it, or roll `latest` back to it). An
    export bundle takes only `bundle-*` tags and a servable artifact never does, so `latest` always names
    something a server can load."""
    from .pull import parse_model

    model_id, build_id = parse_model(model)
    if build_id is None:
        raise HiveError(f"name the build to tag: {model_id}@<build id> (see `hive-aot profiles {model_id}` or `ls`)")
    store = open_store(store_uri)
    store.check_exists()
    recipe_id, m = find_build(store, model_id, build_id, recipe)
    pending = m.build.get("state") == "compile_pending"
    if pending != tag_name.startswith(BUNDLE_TAG_PREFIX):
        raise HiveError(f"{model_id}@{m.build_id[:12]} is " + (
            f"an export bundle (compile pending): it takes only {BUNDLE_TAG_PREFIX}* tags" if pending else
            f"a servable artifact: {BUNDLE_TAG_PREFIX}* tags are for export bundles"))
    key = ref_key(model_id, recipe_id, tag_name)
    before = store.read_ref(key)
    store.write_bytes(key, ref_document(model_id, recipe_id, m))
    return {"model_id": model_id, "recipe": recipe_id, "tag": tag_name, "build_id": m.build_id,
            "previous_build_id": before.get("build_id") if before else None, "store": store.uri}


def retire(model_id: str, *, recipe: str | None = None, store_uri: str | None = None,
           dry_run: bool = False) -> dict[str, Any]:
    """Take a model (or one recipe of it) off the store: every ref first, then every manifest, so nothing can
    pull it, not even by build id; its blobs wait for `gc`."""
    from ..core.paths import check_model_id

    check_model_id(model_id)
    if recipe is not None:  # '' or '.' must not widen the scope to every recipe of the model
        check_recipe_id(recipe)
    store = open_store(store_uri)
    store.check_exists()
    slug = model_slug(model_id)
    scope = f"{slug}/{recipe}/" if recipe is not None else f"{slug}/"
    refs, manifests = store.list(f"refs/{scope}"), store.list(f"manifests/{scope}")
    if not refs and not manifests:
        raise HiveError(f"{model_id}: nothing published" + (f" for {recipe}" if recipe else "") + f" in {store.uri}")
    digests = set()
    for key in manifests:
        raw = store.read_bytes(key)
        if raw is not None:
            digests.update(f.sha256 for f in Manifest.parse(raw, f"{store.uri}: {key}").files)
    # images made from these builds first (an OCI store's Modelcars): a retire killed after them is run again,
    # one killed after the manifests would leave them with nothing that names them
    images = store.delete_derived(manifests, dry_run=dry_run)
    if not dry_run:
        for key in refs:  # refs first: none is ever left naming a deleted manifest
            store.delete(key)
        for key in manifests:
            store.delete(key)
    return {"model_id": model_id, "recipe": recipe, "refs": refs, "manifests": manifests, "images": images,
            "blobs_left_for_gc": len(digests), "dry_run": dry_run, "store": store.uri}


__all__ = ["find_build", "retire", "tag"]
