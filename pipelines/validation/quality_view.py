"""What an operator reads about a build's quality, as plain data: each gate's measured value beside its threshold,
the engine-side check in one line, a model's recipes side by side (the demo's table), and the two charts (KL by
position along each parity prompt, size against quality across recipes) as SVG.

The orchestration wraps these in Dagster metadata (pipelines/orchestration/quality.py); nothing here knows Dagster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config.thresholds import Thresholds, enabled_gates
from ..core.units import human_bytes
from . import svg_chart


@dataclass(frozen=True)
class Gate:
    """One gate of a recipe's validation: the metric it reads, its bound and whether the measured value meets it
    (None: not measured, which fails the validation)."""

    metric: str
    label: str
    value: float | None
    bound: str  # ">=", "<=" or "required"
    threshold: float
    passed: bool
    fmt: str

    @property
    def value_text(self) -> str:
        if self.value is None:
            return "not measured"
        return format(self.value, self.fmt) if self.value == self.value else "NaN"

    @property
    def threshold_text(self) -> str:
        return "= 1 (required)" if self.bound == "required" else f"{'≥' if self.bound == '>=' else '≤'} {self.threshold:g}"

    @property
    def verdict(self) -> str:
        """`0.99900 ≥ 0.99: pass`, `0.01234 > 0.001: FAIL`: the value against its threshold in one line."""
        if self.value is None:
            return f"not measured (needs {self.threshold_text}): FAIL"
        if self.bound == "required":
            return f"{self.value_text} (required: 1): {'pass' if self.passed else 'FAIL'}"
        sign = {(">=", True): "≥", (">=", False): "<", ("<=", True): "≤", ("<=", False): ">"}[self.bound, self.passed]
        return f"{self.value_text} {sign} {self.threshold:g}: {'pass' if self.passed else 'FAIL'}"


def gates(thresholds: Thresholds, metrics: dict[str, Any]) -> list[Gate]:
    """The enabled gates of `thresholds` with the measured `metrics`, in the schema's order. Pass and fail follow
    thresholds.check_thresholds (a value that is missing, NaN or infinite fails)."""
    out = []
    for spec in enabled_gates(thresholds):
        raw = metrics.get(spec.metric)
        value = float(raw) if isinstance(raw, (int, float)) else None
        finite = value is not None and value == value and abs(value) != float("inf")
        threshold = 1.0 if spec.bound == "required" else float(spec.limit)
        passed = finite and (value >= threshold if spec.bound in (">=", "required") else value <= threshold)
        out.append(Gate(metric=spec.metric, label=spec.label, value=value, bound=spec.bound, threshold=threshold,
                        passed=bool(passed), fmt=spec.fmt))
    return out


def engine_check(metrics: dict[str, Any]) -> str:
    """The engine-side validation in one cell: vLLM for prepared weights, the predicted device quality (MXFP6 /
    MXINT8 emulated) for AI 100 compiles, "-" for the others."""
    if "predicted_kl" in metrics:
        return (f"AI 100 predicted: top-1 {metrics['predicted_top1']:.3f}, KL {metrics['predicted_kl']:.3f}, "
                f"ppl {metrics['predicted_ppl_delta']:+.1%}")
    if "vllm_loaded" not in metrics:
        return "-"
    if not metrics["vllm_loaded"]:
        return "not loaded here (needs a GPU host)"
    return (f"top-1 {metrics['vllm_top1_agreement']:.4f}, greedy {metrics['vllm_greedy_agreement']:.0%}, "
            f"dlogp {metrics['vllm_max_logprob_delta']:.0e}")


def headline(metrics: dict[str, Any]) -> tuple[float | None, float | None]:
    """(top-1 agreement, mean KL) of a validation: measured in the target's engine, else the AI 100 prediction."""
    def first(*keys: str) -> float | None:
        return next((float(metrics[k]) for k in keys if isinstance(metrics.get(k), (int, float))), None)

    return first("top1_agreement", "predicted_top1", "ort_top1_agreement"), first("mean_kl", "predicted_kl")


def kl_by_position_svg(per_prompt: list[dict[str, Any]], bins: int = 48) -> str | None:
    """KL(reference || artifact) along the token positions of the parity prompts, in `bins` runs of positions:
    the mean over the prompts that reach each run, and the worst of them. None when the validation recorded no
    per-position profile. A profile point of a long prompt stands for a run of its positions (parity.kl_profile)
    and is placed at the run's middle."""
    samples = []  # (position, KL)
    prompts, end = 0, 0
    for p in per_prompt:
        profile = p.get("kl_profile") or []
        if not profile:
            continue
        prompts += 1
        positions = max(int(p.get("positions") or len(profile)), len(profile))
        end = max(end, positions)
        samples += [(positions / len(profile) * (k + 0.5), float(v)) for k, v in enumerate(profile)]
    if not samples:
        return None
    width = end / bins
    grouped: dict[int, list[float]] = {}
    for x, v in samples:
        grouped.setdefault(min(int(x / width), bins - 1), []).append(v)
    xs = [(b + 0.5) * width for b in sorted(grouped)]
    mean = svg_chart.Series(f"mean of {prompts} prompts", xs, [sum(grouped[b]) / len(grouped[b]) for b in sorted(grouped)])
    worst = svg_chart.Series("worst", xs, [max(grouped[b]) for b in sorted(grouped)])
    return svg_chart.line_chart([mean, worst], "tokens", x_max=end)


@dataclass(frozen=True)
class RecipeRow:
    """One recipe of a model as the demo prints it: what state its latest build reached and what it measured."""

    recipe: str
    state: str
    size: int | None = None
    metrics: dict[str, Any] | None = None
    build_id: str = ""
    passed: bool | None = None
    note: str = ""

    def cells(self) -> dict[str, Any]:
        """The row's table cells, formatted as every command prints them (sizes in binary units, ids cut)."""
        top1, kl = headline(self.metrics or {})
        return {"recipe": self.recipe, "state": self.state,
                "size": human_bytes(self.size) if self.size is not None else "-",
                "top1": f"{top1:.4f}" if top1 is not None else "-", "kl": f"{kl:.5f}" if kl is not None else "-",
                "engine check": engine_check(self.metrics or {}), "build id": self.build_id[:12], "note": self.note}


SUMMARY_COLUMNS = ("recipe", "state", "size", "top1", "kl", "engine check", "build id", "note")


def size_quality_svg(rows: list[RecipeRow]) -> str | None:
    """Each recipe's size against its mean KL (log scale), green where its validation passed: the trade-off in one
    picture. None when no recipe has both numbers."""
    points = []
    for r in rows:
        _top1, kl = headline(r.metrics or {})
        if r.size is not None and kl is not None:
            points.append(svg_chart.Point(r.recipe, float(r.size), kl, bool(r.passed)))
    if not points:
        return None
    # the x axis in the unit of the largest artifact, so its label is a round number of that unit
    unit, name = next(((1 << s, n) for s, n in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB"))
                       if max(p.x for p in points) >= 1 << s), (1, "bytes"))
    return svg_chart.scatter_chart([svg_chart.Point(p.label, p.x / unit, p.y, p.passed) for p in points], name)
