"""Every GGUF family, one module each: a module of this package that defines `FAMILY` (or `FAMILIES`) is
registered. Adding a family is adding a module; nothing else lists them.

Two modules are not families: `spec` is the vocabulary the declarations are written in (and the one-line
refusals they share), `shared` holds the rules, transforms and constants several families reuse (the Llama
layout most of them descend from, and the blocks families of different lineages have in common): a family
module declares its family, not a library for the others. A family imports spec and shared, and at most
the family it is a variant of (gemma2 and gemma3 from gemma, gemma3 from gemma2, granitemoe from granite);
tests/test_import_contracts.py holds that."""

from __future__ import annotations

import importlib
import pkgutil
import re

from ....core.errors import ModelFormatError
from .spec import Family, HParams, Rule

_NOT_FAMILIES = {"shared", "spec"}  # the vocabulary and the shared declarations, not families


MODULE_OF: dict[str, str] = {}  # family name -> the module that declares it (docs/gguf.md's table reads its docstring)


def _discover() -> tuple[Family, ...]:
    found: list[Family] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name in _NOT_FAMILIES or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        declared = [module.FAMILY] if hasattr(module, "FAMILY") else list(getattr(module, "FAMILIES", ()))
        for family in declared:
            if family.name not in MODULE_OF:  # a variant declared beside its base keeps the base's module
                MODULE_OF[family.name] = module.__name__
        found += [f for f in declared if f not in found]
    return tuple(found)


FAMILIES: tuple[Family, ...] = _discover()
BY_ARCHITECTURE: dict[str, Family] = {}
for _family in FAMILIES:
    for _arch in _family.architectures:
        if _arch in BY_ARCHITECTURE:
            raise RuntimeError(f"{_arch} is declared by GGUF families {BY_ARCHITECTURE[_arch].name} and {_family.name}")
        BY_ARCHITECTURE[_arch] = _family


def family_for(architecture: str | None) -> Family:
    try:
        return BY_ARCHITECTURE[architecture or ""]
    except KeyError:
        supported = ", ".join(sorted(BY_ARCHITECTURE))
        raise ModelFormatError(f"no GGUF converter for {architecture} (supported: {supported})") from None


def is_ignored(family: Family, name: str) -> bool:
    return any(re.fullmatch(p, name) for p in family.ignored)


__all__ = ["BY_ARCHITECTURE", "FAMILIES", "MODULE_OF", "Family", "HParams", "Rule", "family_for", "is_ignored"]
