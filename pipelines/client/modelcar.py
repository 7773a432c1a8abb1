"""`hive-aot modelcar`: which published build a Modelcar image is made of, then store/oci_modelcar.py pushes it.

The build is named as pull names it: a tag of a recipe (`--tag`, default latest; the recipe may be left out
when only one recipe has that tag), or a build id (`--build`, or MODEL@BUILD). The manifest is read as pull
reads it (its sha256 against the ref's, bound to model, recipe and build), so the image holds exactly what
`hive-aot pull` would have fetched. Base install only: no torch, no Dagster.
"""

from __future__ import annotations

from typing import Any

from ..core.errors import HiveError, StoreError
from ..core.paths import model_slug
from ..store import manifest_key, open_store, ref_key
from ..store.documents import load_manifest


def modelcar(model: str, *, store_uri: str | None, recipe: str | None = None, build: str | None = None,
             tag: str = "latest", image_tag: str | None = None, base: str | None = None) -> dict[str, Any]:
    from ..store import default_store_uri
    from .operations import find_build
    from .pull import parse_model

    uri = store_uri or default_store_uri()
    if not uri.startswith("oci://"):
        raise StoreError(f"modelcar needs an oci:// store (got {uri[:120]!r}): the image is pushed to the "
                         "registry beside the artifact")
    from ..store.oci_modelcar import push_modelcar

    model_id, build_id = parse_model(model if build is None else f"{model.partition('@')[0]}@{build}")
    store = open_store(uri)
    if build_id is not None:
        recipe_id, m = find_build(store, model_id, build_id, recipe)
        name = m.build_id  # the full id, whatever prefix named it
    else:
        recipe_id = recipe or _only_recipe(store, model_id, tag)
        ref = store.read_ref(ref_key(model_id, recipe_id, tag))
        if ref is None:
            raise HiveError(f"{model_id}: nothing published with tag {tag!r}" + (f" for {recipe}" if recipe else "")
                            + f" in {store.uri}")
        m = load_manifest(store, manifest_key(model_id, recipe_id, ref["build_id"]), ref.get("manifest_sha256"),
                          model_id)
        name = tag
    if m.build.get("state") == "compile_pending":
        raise HiveError(f"{model_id} {recipe_id} build {m.build_id[:12]} is an export bundle (compile pending): "
                        "nothing a server loads; compile it first")
    labels = {"io.hive-aot.model": model_id, "io.hive-aot.recipe": recipe_id, "io.hive-aot.build": m.build_id}
    res = push_modelcar(store, manifest_key(model_id, recipe_id, m.build_id),
                        [(f.path, f.sha256, f.size) for f in m.files], m.build_id, labels=labels, name=name,
                        image_tag=image_tag, base_ref=base)
    return {"model_id": model_id, "recipe": recipe_id, "store": store.uri, **res,
            "storage_uri": f"oci://{res['image']}"}


def _only_recipe(store, model_id: str, tag: str) -> str:
    recipes = sorted({k.split("/")[2] for k in store.list(f"refs/{model_slug(model_id)}/") if k.endswith(f"/{tag}")})
    if not recipes:
        raise HiveError(f"{model_id}: nothing published with tag {tag!r} in {store.uri}")
    if len(recipes) > 1:
        raise HiveError(f"{model_id}: several recipes are published with tag {tag!r} ({', '.join(recipes)}): "
                        "give --recipe")
    return recipes[0]
