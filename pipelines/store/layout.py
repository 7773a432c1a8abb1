"""Key names inside a store (the same for every backend)."""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from ..core.errors import HiveError, IntegrityError
from ..core.paths import model_slug

if TYPE_CHECKING:
    from .manifest import Manifest

_HEX64 = re.compile(r"[0-9a-f]{64}")


def is_digest(value: object) -> bool:
    """A bare lowercase sha256 hex digest (blob names and build ids)."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def check_digest(digest: str) -> str:
    if not is_digest(digest):
        raise IntegrityError(f"{digest!r} is not a bare lowercase sha256 hex digest")
    return digest


def blob_key(digest: str) -> str:
    check_digest(digest)
    return f"blobs/sha256/{digest[:2]}/{digest}"


# The grammar config/registry.py holds recipe ids to (a key level: never empty, '.', '..' or with a slash).
RECIPE_ID_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


def check_recipe_id(recipe: str) -> str:
    if not isinstance(recipe, str) or RECIPE_ID_RE.fullmatch(recipe) is None:
        shown = repr(recipe)[:80]
        raise HiveError(f"{shown} is not a recipe id (lowercase letters, digits, '.', '_' and '-', starting with a "
                        f"letter or digit)")
    return recipe


def manifest_key(model_id: str, recipe: str, build_id: str) -> str:
    return f"manifests/{model_slug(model_id)}/{check_recipe_id(recipe)}/{check_digest(build_id)}.json"


def check_binding(m: Manifest, key: str, model_id: str, where: str) -> None:
    """A manifest describes exactly what its key names: model, recipe and build id. A signature covers the
    manifest's bytes, not where it is stored, so a signed manifest of build v1 copied under v2's key (or a
    gguf-f16 one under gguf-q8_0) would otherwise be served as what was asked for."""
    parts = key.split("/")  # manifests/<slug>/<recipe>/<build id>.json
    recipe, build_id = (parts[2], parts[3].removesuffix(".json")) if len(parts) == 4 else (None, None)
    for what, found, wanted in (("model", m.model.id, model_id), ("recipe", m.recipe.id, recipe),
                                ("build", m.build_id, build_id)):
        if found != wanted:
            raise IntegrityError(f"{where}: manifest {key} is for {what} {str(found)[:80]!r}, not {wanted!r}: "
                                 f"it was copied or moved there (refusing to serve it)")


def ref_key(model_id: str, recipe: str, tag: str) -> str:
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", tag):
        raise IntegrityError(f"{tag!r} is not a valid tag")
    return f"refs/{model_slug(model_id)}/{check_recipe_id(recipe)}/{tag}"


BUNDLE_TAG_PREFIX = "bundle-"  # tags of artifacts that stop short of their recipe's format (export bundles)


def publish_tags(commit: str, pending: bool) -> tuple[str, str]:
    """The tags a publish writes: `<commit>` and `latest`, or `bundle-<commit>` and `bundle-latest` for an
    export bundle, so `latest` only ever names what a server can load."""
    prefix = BUNDLE_TAG_PREFIX if pending else ""
    return f"{prefix}{commit}", f"{prefix}latest"


def staging_key(build_id: str) -> str:
    return f"staging/{check_digest(build_id)}.json"


PROFILES_KEY = "profiles.json"


def ref_document(model_id: str, recipe_id: str, manifest: Manifest, **extra: str) -> bytes:
    """A ref's bytes: which build a tag names, its manifest and that manifest's sha256 (checked by pull), when."""
    return json.dumps({
        "build_id": manifest.build_id,
        "manifest": manifest_key(model_id, recipe_id, manifest.build_id),
        "manifest_sha256": hashlib.sha256(manifest.to_bytes()).hexdigest(),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        **extra,
    }, indent=1).encode()
