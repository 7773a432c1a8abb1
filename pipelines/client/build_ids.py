"""Build ids as people type them: the full 64 hex digits, or a unique prefix of at least 8 (every human output
prints the first 12), resolved against the manifests a store publishes for one model.

A store's manifest keys are `manifests/<slug>/<recipe>/<build id>.json`: one listing of the model's own keys
(on OCI, its repository's tags) answers which builds exist, so resolving a prefix costs no manifest reads. The
same build id published under two recipes is one build id; a recipe, where given, narrows the choice first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..core.errors import HiveError
from ..store.layout import is_digest

MIN_PREFIX = 8  # 4 bytes: a collision among one model's builds is then a one-in-billions event
SHORT = 12  # the form every human output prints
_PREFIX = re.compile(rf"[0-9a-f]{{{MIN_PREFIX},64}}")
_LISTED = 8  # published builds named in a "no match" line; the rest are counted


def check_build_ref(text: str, hint: str = "") -> str:
    """`text` when it is a full build id or a prefix long enough to resolve; else one line saying why."""
    if _PREFIX.fullmatch(text):
        return text
    shown = text if len(text) <= 80 else text[:77] + "..."
    if re.fullmatch(rf"[0-9a-f]{{1,{MIN_PREFIX - 1}}}", text):
        raise HiveError(f"{shown!r} is too short for a build id: give at least {MIN_PREFIX} of its hex digits{hint}")
    raise HiveError(f"{shown!r} is not a build id (lowercase hex digits: all 64, or a unique prefix of at least "
                    f"{MIN_PREFIX}){hint}")


def published_builds(keys: Iterable[str]) -> dict[str, list[str]]:
    """Build id -> the recipes it is published under, from a store's keys below `manifests/<slug>/`. Keys of
    any other shape (a signature, a foreign tag) are not builds."""
    builds: dict[str, list[str]] = {}
    for key in keys:
        parts = key.split("/")
        if len(parts) == 4 and parts[3].endswith(".json") and is_digest(build := parts[3][:-len(".json")]):
            builds.setdefault(build, []).append(parts[2])
    return {b: sorted(set(r)) for b, r in sorted(builds.items())}


def resolve_build_id(given: str, keys: Iterable[str], *, model_id: str, where: str, recipe: str | None = None) -> str:
    """The full build id `given` names among the model's manifest `keys` (of store `where`). A full id is
    returned as it is: whether it is published is the caller's question, answered in its own words. A prefix
    must match exactly one build (of `recipe`, where given): none or several is one line naming them."""
    check_build_ref(given)
    if is_digest(given):
        return given
    builds = published_builds(keys)
    if recipe is not None:
        builds = {b: rs for b, rs in builds.items() if recipe in rs}
    of = f" of {recipe}" if recipe else ""
    matches = [b for b in builds if b.startswith(given)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise HiveError(f"{model_id}: no published build{of} starts with {given} in {where} "
                        f"(published: {_listing(builds)})")
    named = ", ".join(f"{b} ({', '.join(builds[b])})" for b in matches)
    by_recipe = recipe is None and len({r for b in matches for r in builds[b]}) > 1
    raise HiveError(f"{model_id}: build {given} is ambiguous, {len(matches)} published builds{of} start with it: "
                    f"{named}; give more of its digits" + (" or --recipe" if by_recipe else ""))


def _listing(builds: dict[str, list[str]]) -> str:
    if not builds:
        return "none"
    shown = [f"{b[:SHORT]} ({', '.join(rs)})" for b, rs in list(builds.items())[:_LISTED]]
    more = len(builds) - _LISTED
    return ", ".join(shown) + (f" and {more} more (hive-aot ls)" if more > 0 else "")


__all__ = ["MIN_PREFIX", "check_build_ref", "published_builds", "resolve_build_id"]
