"""What the Dagster UI shows about quality, made without Dagster: each gate's value against its threshold (agreeing
with the check that decides), the demo's per-model row, and the two charts as SVG a browser can draw."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from pipelines.config.thresholds import check_thresholds
from pipelines.targets.gguf import GgufThresholds
from pipelines.targets.vllm import VllmThresholds
from pipelines.validation import quality_view, svg_chart

SVG = "{http://www.w3.org/2000/svg}"
GATES = GgufThresholds(min_top1_agreement=0.99, max_mean_kl=0.001, max_abs_logit_delta=2.0)
MEASURED = {"top1_agreement": 0.9961, "mean_kl": 0.00002, "max_abs_logit_delta": 0.5, "token_parity": 1.0}


@pytest.mark.parametrize("change", [
    {},  # every gate met
    {"mean_kl": 0.0123},  # one gate missed
    {"top1_agreement": 0.98, "token_parity": 0.9},  # two
    {"max_abs_logit_delta": float("nan")},  # NaN meets no bound
    {"top1_agreement": None},  # not measured
    {"top1_agreement": 0.99, "mean_kl": 0.001},  # exactly on the bounds: met
])
def test_gates_pass_and_fail_as_the_check_that_decides(change):
    metrics = {k: v for k, v in {**MEASURED, **change}.items() if v is not None}
    found = quality_view.gates(GATES, metrics)
    assert [g.metric for g in found] == ["top1_agreement", "mean_kl", "max_abs_logit_delta", "token_parity"]
    failed_here = {g.label for g in found if not g.passed}
    failed_there = {line.split(" ")[0] for line in check_thresholds(metrics, GATES)}  # the label's first word
    assert {label.split(" ")[0] for label in failed_here} == failed_there


def test_a_gate_reads_as_its_value_against_its_threshold():
    top1, kl, delta, tokens = quality_view.gates(GATES, {**MEASURED, "mean_kl": 0.0123})
    assert (top1.value_text, top1.threshold_text, top1.verdict) == ("0.9961", "≥ 0.99", "0.9961 ≥ 0.99: pass")
    assert (kl.value_text, kl.threshold_text, kl.verdict) == ("0.01230", "≤ 0.001", "0.01230 > 0.001: FAIL")
    assert tokens.threshold_text == "= 1 (required)" and tokens.verdict == "1.000 (required: 1): pass"
    (missing, *_) = quality_view.gates(GATES, {"mean_kl": 0.0})
    assert (missing.value_text, missing.passed) == ("not measured", False)
    assert missing.verdict == "not measured (needs ≥ 0.99): FAIL"
    # a disabled gate (None) is not shown: vLLM's optional engine gates left unset
    vllm = VllmThresholds(min_top1_agreement=0.99, max_mean_kl=0.001)
    assert [g.metric for g in quality_view.gates(vllm, {})] == ["top1_agreement", "mean_kl", "token_parity",
                                                               "vllm_loaded"]


def test_a_recipe_row_is_printed_as_the_demo_prints_it():
    row = quality_view.RecipeRow("gguf-q8_0", "published", 145 << 20, {**MEASURED}, "ab" * 32, True)
    assert row.cells() == {"recipe": "gguf-q8_0", "state": "published", "size": "145.0 MiB", "top1": "0.9961",
                           "kl": "0.00002", "engine check": "-", "build id": "ab" * 6, "note": ""}
    assert quality_view.RecipeRow("gguf-x", "failed", note="boom").cells()["size"] == "-"
    compiled = {"predicted_top1": 0.981, "predicted_kl": 0.0042, "predicted_ppl_delta": 0.012}
    assert quality_view.headline(compiled) == (0.981, 0.0042)
    assert quality_view.engine_check(compiled) == "AI 100 predicted: top-1 0.981, KL 0.004, ppl +1.2%"
    assert quality_view.engine_check({"vllm_loaded": False}) == "not loaded here (needs a GPU host)"


def _parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)  # well-formed XML, as an <img> of an SVG requires
    assert root.tag == f"{SVG}svg"
    return root


def _curve(path: str) -> list[tuple[int, int]]:
    """The absolute points of an `Mx,y` `l dx,dy dx-dy ...` path."""
    start, _, rest = path[1:].partition("l")
    x, y = map(int, start.split(","))
    points = [(x, y)]
    for step in rest.split():
        dx, dy = map(int, re.fullmatch(r"(-?\d+),?(-?\d+)", step).groups())
        x, y = x + dx, y + dy
        points.append((x, y))
    return points


def test_kl_by_position_is_the_mean_and_the_worst_prompt_per_run_of_positions():
    flat = {"positions": 8, "kl_profile": [0.01] * 8}
    rising = {"positions": 8, "kl_profile": [0.0, 0.0, 0.0, 0.0, 0.02, 0.02, 0.04, 0.04]}
    root = _parse(quality_view.kl_by_position_svg([flat, rising, {"positions": 3}], bins=4))
    # the y axis up to the worst value, the x axis to the longest prompt's end
    assert {t.text for t in root.iter(f"{SVG}text")} >= {"mean of 2 prompts", "worst", "0.04", "8 tokens"}
    mean, worst = [_curve(p.get("d")) for p in root.iter(f"{SVG}path") if p.get("stroke") != "gray"]
    assert len(mean) == len(worst) == 4
    # runs of 2 positions: mean 0.005, 0.005, 0.015, 0.025; worst 0.01, 0.01, 0.02, 0.04 (the top of the plot)
    assert worst[-1][1] == svg_chart.TOP and worst[0][1] == worst[1][1] > worst[2][1] > worst[3][1]
    assert mean[0][1] == mean[1][1] > mean[2][1] > mean[3][1] > worst[3][1]
    assert [x for x, _ in mean] == [x for x, _ in worst] and mean[0][0] < mean[1][0] < mean[2][0] < mean[3][0]
    assert quality_view.kl_by_position_svg([{"positions": 4}]) is None  # no profile recorded: no chart


def test_size_against_quality_marks_failures_and_puts_zero_kl_on_the_floor():
    rows = [quality_view.RecipeRow("gguf-f32", "published", 540 << 20, {"top1_agreement": 1.0, "mean_kl": 0.0}, "", True),
            quality_view.RecipeRow("gguf-q8_0", "published", 145 << 20, {"top1_agreement": 0.99, "mean_kl": 1.3e-4}, "",
                                   True),
            quality_view.RecipeRow("gguf-q2_k", "rejected", 60 << 20, {"top1_agreement": 0.7, "mean_kl": 0.3}, "",
                                   False),
            quality_view.RecipeRow("vllm-bf16", "failed", note="no engine")]  # nothing measured: not drawn
    root = _parse(quality_view.size_quality_svg(rows))
    labels = {t.text for t in root.iter(f"{SVG}text")}
    assert {"gguf-f32 (0)", "gguf-q8_0", "gguf-q2_k", "1e0", "1e-5", "621 MiB"} <= labels and "vllm-bf16" not in labels
    dots = {p.get("stroke"): p.get("d").count("M") for p in root.iter(f"{SVG}path") if p.get("stroke-linecap")}
    assert dots == {svg_chart.PASS_COLOUR: 2, svg_chart.FAIL_COLOUR: 1}
    assert quality_view.size_quality_svg(rows[3:]) is None


def test_log_floor_and_labels_are_short():
    assert [svg_chart.short_number(v) for v in (0, 0.5, 12, 3e-4, 2.5e6, 0.018)] == ["0", "0.5", "12", "3e-4", "2e6",
                                                                                     "0.018"]
    assert svg_chart.data_uri("<svg fill='#fff'>50%</svg>") == "data:image/svg+xml,<svg fill='%23fff'>50%25</svg>"
