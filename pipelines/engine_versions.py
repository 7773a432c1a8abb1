"""The engines an artifact was validated with, against the serving container's (pull warns, `--strict` refuses)."""

from __future__ import annotations

import os
from typing import Any

from .manifest import Manifest

ENGINE_VERSIONS_ENV = "HIVE_AOT_ENGINE_VERSIONS"  # e.g. "llama_cpp_python=0.3.36,vllm=0.33.0" for engines not installed as Python packages


def engine_check(m: Manifest) -> list[dict[str, Any]]:
    """The engines the artifact was validated with (manifest `validation.engines`) against this environment's:
    the installed Python distribution of that name, or $HIVE_AOT_ENGINE_VERSIONS."""
    from importlib import metadata

    validated = (m.validation or {}).get("engines") or {}
    given = dict(item.split("=", 1) for item in os.environ.get(ENGINE_VERSIONS_ENV, "").split(",") if "=" in item)
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
