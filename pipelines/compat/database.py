"""The architecture database: the generated snapshot (`data/architectures.json`, from vLLM's
registry and transformers' auto mappings) merged with the curated overrides of `registry.yaml`
(the seeds' tested rows and throughput, notes, aliases, the AI 100 validated matrix).

Data only; the routing rules live in `check.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config.registry import Registry

@dataclass(frozen=True)
class Architecture:
    name: str
    family: str
    task: str
    active: bool
    vllm_support: str | None  # "native" | "transformers-backend" | None
    vllm_last_version: str | None = None
    transformers_model_type: str | None = None
    tested: dict[str, int | None] = field(default_factory=dict)  # profile -> tok/s (None: tested, no figure)
    benchmark_model: str | None = None
    notes: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    qaic: bool = False  # in the Cloud AI 100 AOT validated matrix
    trust_remote_code: bool = False
    llama_cpp_arch: str | None = None  # what the pinned llama.cpp's converter makes of it (None: not converted)
    llama_cpp_mmproj: bool = False  # ... and whether it converts a vision projector too

    @property
    def transformers_known(self) -> bool:
        return self.transformers_model_type is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "family": self.family, "task": self.task, "active": self.active,
            "vllm_support": self.vllm_support, "vllm_last_version": self.vllm_last_version,
            "transformers_model_type": self.transformers_model_type, "tested": self.tested,
            "benchmark_model": self.benchmark_model, "notes": list(self.notes), "aliases": list(self.aliases),
            "qaic": self.qaic, "trust_remote_code": self.trust_remote_code, "llama_cpp_arch": self.llama_cpp_arch,
            "llama_cpp_mmproj": self.llama_cpp_mmproj,
        }


@dataclass
class Database:
    architectures: dict[str, Architecture]
    aliases: dict[str, str]
    sources: dict[str, str]

    def lookup(self, name: str) -> Architecture | None:
        return self.architectures.get(self.aliases.get(name, name))

    def active(self) -> list[Architecture]:
        return [a for a in self.architectures.values() if a.active]


@lru_cache(maxsize=1)
def _snapshot() -> dict[str, Any]:
    text = resources.files(__package__).joinpath("data/architectures.json").read_text(encoding="utf-8")
    return json.loads(text)


def _from_snapshot(rec: dict[str, Any]) -> Architecture:
    vllm = rec.get("vllm") or {}
    tf = rec.get("transformers") or {}
    llama_cpp = rec.get("llama_cpp") or {}
    support = vllm.get("support")
    # Active: the serving platform can run it somewhere - vLLM (natively or through its Transformers
    # backend) or the transformers fallback. Archs vLLM dropped and transformers never had are kept,
    # inactive, with the last vLLM version that ran them.
    active = support is not None or tf.get("model_type") is not None
    return Architecture(name=rec["name"], family=rec["family"], task=rec["task"], active=active, vllm_support=support,
                        vllm_last_version=vllm.get("last_version"), transformers_model_type=tf.get("model_type"),
                        llama_cpp_arch=llama_cpp.get("arch"), llama_cpp_mmproj=bool(llama_cpp.get("mmproj")))


def _same_class_spelled_otherwise(archs: dict[str, Architecture]) -> None:
    """vLLM and transformers sometimes spell one class differently (vLLM's PhiMoEForCausalLM is transformers'
    PhimoeForCausalLM): a record transformers does not know under its own name takes the model type of the
    record that differs from it only in case."""
    by_folded: dict[str, Architecture] = {}
    for a in archs.values():
        if a.transformers_model_type is not None:
            by_folded.setdefault(a.name.casefold(), a)
    for name, a in list(archs.items()):
        twin = by_folded.get(name.casefold())
        if a.transformers_model_type is None and twin is not None and twin.name != name:
            archs[name] = replace(a, transformers_model_type=twin.transformers_model_type, active=True)


def build(registry: Registry | None = None) -> Database:
    snap = _snapshot()
    archs = {name: _from_snapshot(rec) for name, rec in snap["architectures"].items()}
    _same_class_spelled_otherwise(archs)
    aliases: dict[str, str] = {}
    overrides = registry.architectures if registry is not None else {}
    for name, ov in overrides.items():
        base = archs.get(name) or Architecture(name=name, family=ov.family or "other", task=ov.task or "causal-lm",
                                               active=True, vllm_support=None)
        changes = {k: v for k, v in ov.model_dump(exclude_unset=True).items() if k in Architecture.__dataclass_fields__}
        if "notes" in changes:
            changes["notes"] = tuple(changes["notes"])
        if "aliases" in changes:
            changes["aliases"] = tuple(changes["aliases"])
        archs[name] = replace(base, **changes)
        for alias in archs[name].aliases:
            aliases[alias] = name
    return Database(architectures=dict(sorted(archs.items())), aliases=aliases, sources=dict(snap["sources"]))




_CACHE: dict[int, tuple[Any, Database]] = {}


def cached(registry: Registry | None) -> Database:
    """build() once per registry object (the check runs per model; the merge need not)."""
    key = id(registry)
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not registry:
        hit = _CACHE[key] = (registry, build(registry))
    return hit[1]
