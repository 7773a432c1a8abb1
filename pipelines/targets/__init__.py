"""Build targets. Each kind (gguf, later vllm and qaic) implements the same small interface."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..config import Recipe
    from ..sources import Snapshot


@dataclass
class BuiltArtifact:
    """Files written by a build, relative to its output directory, plus what the manifest records."""

    root: Path
    files: list[str]
    format: str
    info: dict[str, Any] = field(default_factory=dict)
    serving: dict[str, Any] = field(default_factory=dict)


@dataclass
class ValidationReport:
    passed: bool
    failures: list[str]
    metrics: dict[str, Any]
    details: dict[str, Any] = field(default_factory=dict)


class Target(Protocol):
    kind: str
    format: str
    format_version: int

    @staticmethod
    def option_problems(options: dict[str, Any]) -> list[str]: ...

    def supports(self, architecture: str, config: dict[str, Any]) -> bool: ...

    def toolchain(self) -> dict[str, str]: ...

    def build(self, snapshot: "Snapshot", recipe: "Recipe", out_dir: Path) -> BuiltArtifact: ...

    def validate(self, snapshot: "Snapshot", recipe: "Recipe", artifact_dir: Path, files: list[str]) -> ValidationReport: ...


_KINDS = {"gguf": "pipelines.targets.gguf:GgufTarget"}


def target_for(kind: str) -> Target:
    try:
        mod, cls = _KINDS[kind].split(":")
    except KeyError:
        raise ValueError(f"unknown target kind {kind!r}") from None
    return getattr(import_module(mod), cls)()


def check_thresholds(metrics: dict[str, Any], thresholds) -> list[str]:
    """Shared gate: which recipe thresholds the measured metrics miss (empty = pass)."""
    failures = []
    if not metrics.get("finite", True):
        failures.append("logits are not finite (NaN/Inf in weights or activations)")
        return failures
    if metrics["top1_agreement"] < thresholds.min_top1_agreement:
        failures.append(f"top-1 agreement {metrics['top1_agreement']:.4f} < {thresholds.min_top1_agreement}")
    if metrics["mean_kl"] > thresholds.max_mean_kl:
        failures.append(f"mean KL {metrics['mean_kl']:.5f} > {thresholds.max_mean_kl}")
    if thresholds.max_abs_logit_delta is not None and metrics["max_abs_logit_delta"] > thresholds.max_abs_logit_delta:
        failures.append(f"max |delta logit| {metrics['max_abs_logit_delta']:.4f} > {thresholds.max_abs_logit_delta}")
    if thresholds.require_token_parity and metrics.get("token_parity", 1.0) < 1.0:
        failures.append(f"tokenizer id parity {metrics['token_parity']:.3f} < 1.0")
    return failures
