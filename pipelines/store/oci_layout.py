"""Where each store key lives in an OCI registry under `oci://HOST/REPOSITORY` (the mapping both ways).

    blobs/sha256/<2>/<hex>                     blob sha256:<hex> of REPOSITORY/blobs (the pool), plus a holder tag
                                               `<hex>` there: an artifact whose one layer is the blob, so the
                                               registry's own garbage collection keeps it, and `gc` can list it
    refs/<slug>/<recipe>/<tag>                 REPOSITORY/<slug>:<recipe>.<tag>       a ModelPack artifact
    manifests/<slug>/<recipe>/<build>.json     REPOSITORY/<slug>:_m.<recipe>.<build>  a ModelPack artifact
    signatures/<slug>/<recipe>/<build>.json.sig an OMS bundle attached as an OCI referrer to the build's `_m.`
                                               artifact and to each ref artifact naming it (oci_signed.py); stores
                                               signed before OMS: REPOSITORY/<slug>:_s.<recipe>.<build>
    staging/<build>.json                       REPOSITORY/hive-aot:staging.<build>    a document artifact
    profiles.json                              REPOSITORY/hive-aot:profiles.json      a document artifact

Every blob a model's artifacts name is also in the model's repository (mounted from the pool when its artifact is
pushed), so that repository alone, copied to any registry and name, pulls and verifies. Modelcar images
(`hive-aot modelcar`, oci_modelcar.py) sit beside them in the model's repository under tags that
are no store key: `<recipe>.<tag>-modelcar` for a ref, `<recipe>.<build>-modelcar` for a build (a ref tag
ending in `-modelcar` is refused, so the two never meet), or a tag the operator names that maps onto no key.

`<slug>` is the model slug lowercased (repository names are lowercase; Hugging Face ids are case-insensitive
too): the original spelling travels in each artifact's `io.hive-aot.key` annotation and comes back from there
when the registry is listed. A recipe id holds no '.', so `<recipe>.<tag>` splits at its first '.'; hive-aot's
own tags start with '_', which no ref tag can. A slug is `org--name`, so it never collides with the two
one-word repositories `blobs` and `hive-aot`. What does not fit OCI's grammar (a repository component
`[a-z0-9]+((.|_|__|-+)[a-z0-9]+)*`, a tag `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`) is refused in one line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..core.errors import StoreError

POOL, META = "blobs", "hive-aot"
MODELCAR_SUFFIX = "-modelcar"
# a Modelcar image's annotation naming the manifest key it was made of: retire finds the images of what it takes down
MODELCAR_OF = "io.hive-aot.modelcar.of"
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Place:
    kind: str  # "blob", "ref", "manifest", "signature", "meta"
    repo: str  # the repository under REPOSITORY (POOL, META or a slug, lowercased)
    tag: str  # the tag that holds the document (for a blob: its holder)
    slug: str = ""  # the model slug as the key spells it
    digest: str = ""  # a blob's sha256:<hex>


def check_repository(path: str, uri: str) -> str:
    for part in path.split("/"):
        if not _COMPONENT.fullmatch(part):
            raise StoreError(f"{uri}: {path!r} is not an OCI repository name (lowercase letters and digits, "
                             f"separated by '.', '_', '__' or '-', components joined by '/')")
    return path


def _tag(tag: str, key: str) -> str:
    if not _TAG.fullmatch(tag):
        raise StoreError(f"cannot map store key {key!r} onto an OCI tag: {tag!r} is not a valid tag "
                         "(at most 128 of A-Z a-z 0-9 _ . -)")
    return tag


def _slug_repo(slug: str, key: str) -> str:
    repo = slug.lower()
    if not _COMPONENT.fullmatch(repo) or repo in (POOL, META):
        raise StoreError(f"cannot map store key {key!r} onto an OCI repository: {repo!r} is not a valid "
                         "repository component")
    return repo


def _recipe(recipe: str, key: str) -> str:
    if "." in recipe or not recipe:
        raise StoreError(f"cannot map store key {key!r} onto an OCI tag: recipe {recipe!r} holds a '.' "
                         "(the separator of <recipe>.<tag>)")
    return recipe


def place(key: str) -> Place | None:
    """Where `key` lives; None for a key no backend writes (reads of it find nothing)."""
    parts = key.split("/")
    if parts[0] == "blobs":
        if len(parts) == 4 and parts[1] == "sha256" and _HEX.fullmatch(parts[3]) and parts[2] == parts[3][:2]:
            return Place("blob", POOL, parts[3], digest=f"sha256:{parts[3]}")
        return None
    if parts[0] in ("refs", "manifests", "signatures") and len(parts) == 4:
        _, slug, recipe, last = parts
        repo, recipe = _slug_repo(slug, key), _recipe(recipe, key)
        if parts[0] == "refs":
            if last.endswith(MODELCAR_SUFFIX):
                raise StoreError(f"cannot map store key {key!r} onto an OCI tag: tags ending in {MODELCAR_SUFFIX!r} "
                                 "are the Modelcar images' (hive-aot modelcar)")
            return Place("ref", repo, _tag(f"{recipe}.{last}", key), slug)
        suffix = ".json" if parts[0] == "manifests" else ".json.sig"
        build = last[:-len(suffix)] if last.endswith(suffix) else ""
        if not _HEX.fullmatch(build):
            return None
        return Place(parts[0][:-1], repo, _tag(f"_{parts[0][0]}.{recipe}.{build}", key), slug)
    if parts[0] == "staging" and len(parts) == 2 and parts[1].endswith(".json") and _HEX.fullmatch(parts[1][:-5]):
        return Place("meta", META, f"staging.{parts[1][:-5]}")
    if key == "profiles.json":
        return Place("meta", META, "profiles.json")
    return None


def key_of(repo: str, tag: str, slug: str) -> str | None:
    """The store key a tag of a repository holds (`slug`: the model slug as written, for a model repository);
    None for a tag that is none of hive-aot's."""
    if repo == POOL:
        return f"blobs/sha256/{tag[:2]}/{tag}" if _HEX.fullmatch(tag) else None
    if repo == META:
        if tag.startswith("staging.") and _HEX.fullmatch(tag[8:]):
            return f"staging/{tag[8:]}.json"
        return "profiles.json" if tag == "profiles.json" else None
    if tag.startswith(("_m.", "_s.")):
        recipe, _, build = tag[3:].partition(".")
        if not (recipe and _HEX.fullmatch(build)):
            return None
        return (f"manifests/{slug}/{recipe}/{build}.json" if tag[1] == "m"
                else f"signatures/{slug}/{recipe}/{build}.json.sig")
    recipe, dot, ref = tag.partition(".")
    if tag.endswith(MODELCAR_SUFFIX):
        return None  # a Modelcar image, no store key
    return f"refs/{slug}/{recipe}/{ref}" if dot and recipe and ref and not tag.startswith("_") else None


def area_of(prefix: str) -> tuple[str, str | None]:
    """(first key component, the model slug the prefix names or None) of a list() prefix."""
    parts = prefix.split("/")
    slug = parts[1] if len(parts) > 1 and parts[1] and parts[0] in ("refs", "manifests", "signatures") else None
    return parts[0], slug


def modelcar_tag(recipe: str, name: str, given: str | None = None) -> str:
    """The tag of a Modelcar image of `<recipe>.<name>` (a ref's tag or a build id), or the operator's `given`
    one, refused when it would be a store key's tag (the image would replace a ref or a build's artifact)."""
    tag = given if given is not None else f"{recipe}.{name}{MODELCAR_SUFFIX}"
    if not _TAG.fullmatch(tag):
        raise StoreError(f"{tag[:140]!r} is not a valid OCI tag (at most 128 of A-Z a-z 0-9 _ . -, not starting "
                         "with '.' or '-')" + ("" if given is not None else ": name one with --image-tag"))
    if key_of("model", tag, "model") is not None:
        raise StoreError(f"image tag {tag!r} is of the form of the store's own tags (<recipe>.<tag>, _m., _s.): end "
                         f"it in {MODELCAR_SUFFIX!r} or leave out the '.'")
    return tag


def json_object(raw: bytes, what: str) -> dict[str, Any]:
    """The JSON object a registry document (manifest, config) holds; one line naming `what` when it holds none."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        raise StoreError(f"{what} is not JSON")
    return doc
