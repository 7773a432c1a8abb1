"""The engines an artifact was validated with, against the serving container's (pull warns, `--strict` refuses)."""

from __future__ import annotations

from typing import Any

from ..core import settings
from ..store.manifest import Manifest

ENGINE_VERSIONS_ENV = settings.ENGINE_VERSIONS.name


def engine_check(m: Manifest) -> list[dict[str, Any]]:
    """The engines the artifact was validated with (manifest `validation.engines`) against this environment's:
    the installed Python distribution of that name, or $HIVE_AOT_ENGINE_VERSIONS."""
    from importlib import metadata

    validated = (m.validation or {}).get("engines") or {}
    given = dict(item.split("=", 1) for item in settings.ENGINE_VERSIONS.items() if "=" in item)
    out = []
    for package, version in sorted(validated.items()):
        here = given.get(package)
        if here is None:
            try:
                here = metadata.version(package)
            except metadata.PackageNotFoundError:
                here = None
        here = here.split("+")[0] if here else None
        status = "not installed here" if here is None else "same" if here == str(version) else "differs"
        out.append({"engine": package, "validated_with": version, "here": here, "status": status})
    return out
