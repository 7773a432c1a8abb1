"""A build's quality and identity as Dagster metadata, readable at a glance in the UI.

The parity check's result shows each gate's value against its threshold as plain text (the check page renders
text and numbers inline; tables, JSON and Markdown wait behind a [Show ...] link there). The same check records
an observation of the artifact's partition with the gate table and the KL-by-position chart: the partition page
of artifact/<recipe> lists it above the materialization's own entries, rendered inline (a Markdown entry only
while it is under INLINE_MARKDOWN characters, so the charts are compact SVG). Numbers stay plain floats, which
Dagster plots across executions by itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dagster as dg

from ..config.thresholds import Thresholds
from ..core.units import human_bytes
from ..validation.quality_view import Gate, gates, kl_by_position_svg
from ..validation.svg_chart import data_uri

SHORT_ID = 12  # hex digits of a build id or digest shown in a cell: what every command prints
# Dagster 1.13's UI renders a Markdown metadata entry in place only below this many characters; a longer one waits
# behind a [Show Markdown] link
INLINE_MARKDOWN = 1000
KL_BINS = (40, 32, 24, 16)  # runs of positions in the KL chart, finest first: the first that fits in place is used


def markdown_image(svg: str, alt: str) -> str:
    """The SVG as a Markdown image with a `data:` URI. The destination in angle brackets may hold the SVG's spaces
    as they are (its `<` and `>` escaped), which keeps the entry shorter than percent-encoding or base64 would."""
    uri = data_uri(svg).replace("\\", "\\\\").replace("<", "\\<").replace(">", "\\>")
    return f"![{alt}](<{uri}>)"


def chart(render: Callable[[int], str | None], alt: str, resolutions: tuple[int, ...] = (0,)):
    """A chart as Markdown metadata, drawn by `render(resolution)` at the finest of `resolutions` that keeps the
    entry in place (under INLINE_MARKDOWN characters), else at the coarsest; None when there is nothing to draw."""
    md = None
    for resolution in resolutions:
        svg = render(resolution)
        if svg is None:
            return None
        md = markdown_image(svg, alt)
        if len(md) < INLINE_MARKDOWN:
            break
    return dg.MetadataValue.md(md)


def kl_chart(validation: dict[str, Any]):
    """KL by position (mean and worst of the parity prompts), or None when no profile was recorded."""
    return chart(lambda bins: kl_by_position_svg(validation.get("per_prompt", []), bins), "KL by position", KL_BINS)


def gate_table(found: list[Gate]) -> dg.TableMetadataValue:
    """metric | value | threshold | pass, one row per enabled gate of the recipe."""
    return dg.MetadataValue.table(
        [dg.TableRecord({"metric": g.label, "value": g.value_text, "threshold": g.threshold_text, "pass": g.passed})
         for g in found],
        schema=dg.TableSchema(columns=[dg.TableColumn("metric"), dg.TableColumn("value"),
                                       dg.TableColumn("threshold"), dg.TableColumn("pass", "bool")]))


def gate_lines(found: list[Gate]) -> dict[str, str]:
    """`gate: mean KL` -> `0.00012 ≤ 0.001: pass`: each value against its threshold as a visible line."""
    return {f"gate: {g.label}": g.verdict for g in found}


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The measured numbers as floats (booleans and text left out): what Dagster plots."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _parity_table(validation: dict[str, Any]) -> dg.TableMetadataValue:
    rows = [dg.TableRecord({"prompt": i, **{k: float(v) for k, v in p.items()
                                            if k in ("top1_agreement", "mean_kl", "max_abs_logit_delta")}})
            for i, p in enumerate(validation.get("per_prompt", []))]
    return dg.MetadataValue.table(rows, schema=dg.TableSchema(columns=[
        dg.TableColumn("prompt", "int"), dg.TableColumn("top1_agreement", "float"),
        dg.TableColumn("mean_kl", "float"), dg.TableColumn("max_abs_logit_delta", "float")]))


def check_metadata(validation: dict[str, Any], thresholds: Thresholds) -> dict[str, Any]:
    """The parity check's metadata: every gate as `value vs threshold` text, the measured numbers, the per-prompt
    table, the generation, the KL-by-position chart and the per-target detail sections (the AI 100 quality
    prediction, onnxruntime parity runs)."""
    metrics = validation.get("metrics", {})
    found = gates(thresholds, metrics)
    measured = {k: v for k, v in metrics.items() if isinstance(v, (int, float, bool))}  # vllm_loaded is a bool
    md: dict[str, Any] = {**gate_lines(found), **measured, "parity": _parity_table(validation),
                          "generation": dg.MetadataValue.json(validation.get("generation", {}))}
    md.update({k: dg.MetadataValue.json(validation[k]) for k in ("mxfp6", "fp16", "ort") if k in validation})
    profile = kl_chart(validation)
    if profile is not None:  # where along the prompts the artifact drifts from the reference
        md["kl_by_position"] = profile
    return md


def quality_observation(asset_key: dg.AssetKey, partition: str, validation: dict[str, Any], thresholds: Thresholds,
                        verdict: str) -> dg.AssetObservation:
    """What the check measured, recorded on the artifact's partition: its gate table, the headline numbers, the
    verdict and the KL-by-position chart, shown on the artifact page beside the build's own metadata."""
    metrics = validation.get("metrics", {})
    found = gates(thresholds, metrics)
    md: dict[str, Any] = {"validation": verdict, "quality": gate_table(found)}
    profile = kl_chart(validation)
    if profile is not None:
        md["kl_by_position"] = profile
    md.update(gated_numbers(metrics, thresholds))
    return dg.AssetObservation(asset_key=asset_key, partition=partition, metadata=md)


def gated_numbers(metrics: dict[str, Any], thresholds: Thresholds) -> dict[str, float]:
    """The measured numbers the recipe's gates read (top1_agreement, mean_kl, ...), as floats."""
    gated = {g.metric for g in gates(thresholds, metrics)}
    return {k: v for k, v in numbers(metrics).items() if k in gated}


def files_table(files: list[dict[str, Any]]) -> dg.TableMetadataValue:
    """A build's files: path, size in binary units and bytes, the first digits of the sha256."""
    return dg.MetadataValue.table(
        [dg.TableRecord({"path": f["path"], "size": human_bytes(f["size"]), "bytes": int(f["size"]),
                         "sha256": f["sha256"][:SHORT_ID]}) for f in files],
        schema=dg.TableSchema(columns=[dg.TableColumn("path"), dg.TableColumn("size"), dg.TableColumn("bytes", "int"),
                                       dg.TableColumn("sha256", description="first 12 hex digits")]))


def build_entries(build_id: str, **identity: Any) -> dict[str, Any]:
    """The build id cut to 12 hex digits (what every command prints), and the full id with the build's other
    identifiers (manifest or candidate URI, store) in one JSON entry."""
    return {"build_id": build_id[:SHORT_ID], "build": dg.MetadataValue.json({"build_id": build_id, **identity})}


def full_build_id(metadata: dict[str, Any]) -> str:
    """The full build id of a materialization's metadata: from `build` where build_entries wrote it, else the
    `build_id` entry itself (the published asset keeps the full id)."""
    if "build" in metadata:
        return str(metadata["build"].value["build_id"])
    return str(metadata["build_id"].value) if "build_id" in metadata else ""
