"""What a build (or a hardware step after it) reports: the build id, the state it reached and its numbers.

A leaf: the engine returns it, the targets' hardware steps return it too, the CLI and Dagster read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class BuildResult:
    build_id: str
    model_id: str
    recipe: str
    manifest: str
    skipped: bool
    state: str  # published | skipped | repaired | staged | rejected | compile_pending
    validation: dict[str, Any] | None = None
    files: list[dict[str, Any]] = field(default_factory=list)
    compatibility: dict[str, Any] | None = None
    format: str | None = None
    reason: str | None = None  # why a build stopped where it did (compile_pending)
    input: BuildResult | None = None  # the build of the recipe's input, for derived recipes
    bundle: BuildResult | None = None  # the export bundle a QPC was compiled from
    memory_plan: dict[str, Any] | None = None  # each step's estimated memory and disk (memory.MemoryPlan)
    memory_measured: dict[str, int] | None = None  # each step's measured peak, all its processes (meter.py)
    step_seconds: dict[str, float] | None = None  # each step's wall time (meter.py)
    step_rates: dict[str, dict[str, float]] | None = None  # work done per step and its rate (meter.rates)

    def to_json(self) -> dict[str, Any]:
        doc = {
            "build_id": self.build_id, "model_id": self.model_id, "recipe": self.recipe, "manifest": self.manifest,
            "skipped": self.skipped, "state": self.state, "format": self.format, "validation": self.validation,
            "files": self.files, "memory_plan": self.memory_plan, "memory_measured": self.memory_measured,
            "step_seconds": self.step_seconds, "step_rates": self.step_rates,
        }
        if self.reason:
            doc["reason"] = self.reason
        for name in ("input", "bundle"):
            sub = getattr(self, name)
            if sub is not None:
                doc[name] = {"recipe": sub.recipe, "build_id": sub.build_id, "state": sub.state, "format": sub.format,
                             "manifest": sub.manifest, "memory_plan": sub.memory_plan,
                             "memory_measured": sub.memory_measured, "step_seconds": sub.step_seconds,
                             "step_rates": sub.step_rates}
        return doc
