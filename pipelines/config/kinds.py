"""The registry of artifact kinds: a kind's name -> the class that builds it.

Every kind is an entry point of the `hive_aot.targets` group, the three hive-aot ships as much as a plug-in's:
hive-aot's own are declared in its pyproject (`[project.entry-points."hive_aot.targets"]`), so the code names
no module in a string and a target is imported only when its kind is used. Another package adds a kind without
editing hive-aot by declaring one in the same group (`mlx = "hive_aot_mlx:MlxTarget"`): recipes may then name it,
and the planner, the engine, the compatibility check, Dagster and pull treat it as they treat the built-in ones.
A built-in kind's name belongs to hive-aot: an entry point of that name from another package is ignored.

This module imports nothing of hive-aot's but its error type: the configuration validates a recipe's `kind`
against it, and importing a target module stays cheap (its engines load inside its methods).
"""

from __future__ import annotations

from functools import lru_cache
from importlib import import_module, metadata
from typing import Any

from ..core.errors import ConfigError

ENTRY_POINT_GROUP = "hive_aot.targets"

# hive-aot's own kinds, in the order they are listed (their classes: pyproject's entry points).
BUILTIN = ("gguf", "vllm", "qaic-export", "qaic")
# The top-level package an entry point's module must be in to be hive-aot's own.
OWN_PACKAGE = __name__.partition(".")[0]


@lru_cache(maxsize=1)
def known() -> dict[str, str]:
    """Every kind this process can build ("module:Class"): the built-in ones, then the installed plug-ins'."""
    own: dict[str, str] = {}
    plugins: dict[str, str] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in BUILTIN:
            if ep.module.partition(".")[0] == OWN_PACKAGE:
                own[ep.name] = ep.value
            continue  # a built-in kind is never replaced by whatever happens to be installed
        plugins.setdefault(ep.name, ep.value)
    missing = [kind for kind in BUILTIN if kind not in own]
    if missing:
        raise ConfigError(f"hive-aot's own target kinds {', '.join(missing)} are not in the installed package's "
                          f"{ENTRY_POINT_GROUP} entry points: install hive-aot (pip install -e . in a checkout)")
    return {**{kind: own[kind] for kind in BUILTIN}, **plugins}


def refresh() -> None:
    """Read the installed plug-ins again (after sys.path changed in this process)."""
    known.cache_clear()
    _instances.clear()


# What a kind's class declares besides its methods (targets.Target's class attributes without a default).
DECLARED = ("kind", "format_version", "Thresholds", "build_step")


def target_class(kind: str) -> type:
    """The class of a kind, checked as it is loaded: a plug-in that leaves a Target method unimplemented or a
    declaration out is refused here, in one line, when the configuration first names its kind, not mid-build."""
    try:
        spec = known()[kind]
    except KeyError:
        raise ConfigError(f"unknown target kind {kind!r} (known: {', '.join(known())})") from None
    module, _, name = spec.partition(":")
    cls = getattr(import_module(module), name, None)
    if not isinstance(cls, type):
        raise ConfigError(f"target kind {kind!r}: {spec} is not a class")
    unimplemented = sorted(getattr(cls, "__abstractmethods__", ()))
    undeclared = [attr for attr in DECLARED if not hasattr(cls, attr)]
    if unimplemented or undeclared:
        lacks = [f"does not implement {', '.join(unimplemented)}"] if unimplemented else []
        lacks += [f"does not declare {', '.join(undeclared)}"] if undeclared else []
        raise ConfigError(f"target kind {kind!r}: {spec} {' and '.join(lacks)}")
    if cls.kind != kind:
        raise ConfigError(f"target kind {kind!r}: {spec} declares kind {cls.kind!r}")
    return cls


_instances: dict[str, Any] = {}


def target_for(kind: str) -> Any:
    """The target object of a kind (one per process: targets keep no per-build state)."""
    if kind not in _instances:
        _instances[kind] = target_class(kind)()
    return _instances[kind]
