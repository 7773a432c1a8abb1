"""Validation gates: the base of every target's threshold schema and the check of measured metrics against it.

Imports nothing of hive-aot's: the configuration validates a recipe's `validation:` with its kind's schema
before any target engine is loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict


class Thresholds(BaseModel):
    """Base of every target's validation schema. Each field gates one metric, declared in the field's
    `json_schema_extra`: `metric` (key in the measured metrics), `label` (for messages), `fmt`. The bound
    is the field name's prefix: `min_*` (metric >= value), `max_*` (metric <= value), `require_*`
    (metric == 1.0 when true). None / false disables a gate."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def gate(metric: str, label: str, fmt: str = ".4f") -> dict[str, Any]:
    return {"metric": metric, "label": label, "fmt": fmt}


class GateSpec(NamedTuple):
    """One enabled gate of a recipe: the metric it reads, how it is named and formatted in messages, its bound
    (">=", "<=", or "required": the metric must be 1.0) and its limit as the recipe wrote it (true when required)."""

    metric: str
    label: str
    fmt: str
    bound: str
    limit: Any


def enabled_gates(thresholds: Thresholds) -> Iterator[GateSpec]:
    """The gates `thresholds` sets, in the schema's order (None / false disables one)."""
    for name, info in type(thresholds).model_fields.items():
        limit = getattr(thresholds, name)
        if limit is None or limit is False:
            continue
        spec = info.json_schema_extra or {}
        bound = ">=" if name.startswith("min_") else "<=" if name.startswith("max_") else "required"
        yield GateSpec(spec["metric"], spec.get("label", spec["metric"]), spec.get("fmt", ".4f"), bound, limit)


def check_thresholds(metrics: dict[str, Any], thresholds: Thresholds) -> list[str]:
    """Which gates of a recipe the measured metrics miss (empty = pass). A gated metric that was not
    measured is a failure, never a pass."""
    if not metrics.get("finite", True):
        return ["logits are not finite (NaN/Inf in weights or activations)"]
    failures = []
    for gate_ in enabled_gates(thresholds):
        label, fmt, limit = gate_.label, gate_.fmt, gate_.limit
        value = metrics.get(gate_.metric)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            failures.append(f"{label} was not measured")
            continue
        if value != value or value in (float("inf"), float("-inf")):  # NaN passes every comparison
            failures.append(f"{label} is not finite ({value})")
        elif gate_.bound == ">=" and value < limit:
            failures.append(f"{label} {value:{fmt}} < {limit}")
        elif gate_.bound == "<=" and value > limit:
            failures.append(f"{label} {value:{fmt}} > {limit}")
        elif gate_.bound == "required" and value < 1.0:
            failures.append(f"{label} {value:{fmt}} < 1.0")
    return failures


def metric_text(value: Any, spec: str) -> str:
    """A metric for a summary line; one a broken artifact left unmeasured (None, NaN) reads as such."""
    return format(value, spec) if isinstance(value, (int, float)) and value == value else f"{value} (not measured)"
