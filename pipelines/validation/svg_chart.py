"""Small charts as compact standalone SVG documents: lines over positions, labelled points against a size.

Hand-written so that no plotting library is needed where the charts are made (a Dagster step, the CLI). Compact
by design: integer pixel coordinates, relative path commands, one path per colour, two labels per axis. The
Dagster UI renders a Markdown metadata entry inline only while it is under 1,000 characters (longer ones wait
behind a [Show Markdown] link), and the chart travels inside it as a `data:` URI.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# plot area: room for the y labels on the left, the x labels below, the legend above
LEFT, TOP, BOTTOM_PAD = 34, 14, 14
COLOURS = ("steelblue", "darkorange", "seagreen", "purple")  # named: a `#` would end a data: URI
PASS_COLOUR, FAIL_COLOUR = "seagreen", "crimson"


@dataclass(frozen=True)
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]


@dataclass(frozen=True)
class Point:
    label: str
    x: float
    y: float
    passed: bool


def data_uri(svg: str) -> str:
    """The SVG as a `data:` URI, percent-encoded only where a URI must be (`%`, and `#`, which would start a
    fragment): shorter than base64 for this kind of text."""
    return "data:image/svg+xml," + svg.replace("%", "%25").replace("#", "%23")


def short_number(v: float) -> str:
    """An axis label in few characters: 0, 0.5, 12, 3e-4, 2e+6."""
    if v == 0:
        return "0"
    if 1e-2 <= abs(v) < 1e4:
        return f"{v:.2g}" if abs(v) < 10 else f"{v:.0f}"
    return f"{v:.0e}".replace("e-0", "e-").replace("e+0", "e")


def _text(x: float, y: float, text: str, colour: str = "") -> str:
    safe = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("'", "&apos;")
    return f"<text x='{x:.0f}' y='{y:.0f}'" + (f" fill='{colour}'" if colour else "") + f">{safe}</text>"


def _relative_path(points: list[tuple[int, int]]) -> str:
    """M x,y then one relative l run: `M34,80l5-3 5,2 ...` (a minus sign separates numbers by itself)."""
    (x0, y0), rest = points[0], points[1:]
    steps, (px, py) = [], (x0, y0)
    for x, y in rest:
        dx, dy = x - px, y - py
        steps.append(f"{dx}{dy}" if dy < 0 else f"{dx},{dy}")
        px, py = x, y
    return f"M{x0},{y0}" + ("l" + " ".join(steps) if steps else "h0")


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.right, self.bottom = width - 6, height - BOTTOM_PAD
        self.parts: list[str] = [f"<path d='M{LEFT},{TOP}V{self.bottom}H{self.right}' fill='none' stroke='gray'/>"]
        self.right_aligned: list[str] = []  # labels that end at their x, drawn in one group

    def px(self, frac_x: float) -> int:
        return round(LEFT + min(max(frac_x, 0.0), 1.0) * (self.right - LEFT))

    def py(self, frac_y: float) -> int:
        return round(self.bottom - min(max(frac_y, 0.0), 1.0) * (self.bottom - TOP))

    def axis_labels(self, y_top: str, y_bottom: str, x_left: str, x_right: str) -> None:
        self.parts.append(_text(LEFT, self.height - 3, x_left))
        self.right_aligned += [_text(LEFT - 3, TOP + 4, y_top), _text(LEFT - 3, self.bottom, y_bottom),
                               _text(self.right, self.height - 3, x_right)]

    def document(self) -> str:
        # drawn on a small grid (short coordinates), shown half as large again
        return (f"<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 {self.width} {self.height}' "
                f"width='{self.width * 3 // 2}' height='{self.height * 3 // 2}' font-size='9' "
                f"font-family='sans-serif'>" + "".join(self.parts)
                + "<g text-anchor='end'>" + "".join(self.right_aligned) + "</g></svg>")


def line_chart(series: Sequence[Series], x_label: str, x_max: float | None = None, width: int = 320,
               height: int = 90) -> str:
    """Polylines on shared linear axes from 0 to `x_max` (else the largest x) and the largest y, labelled with those
    ends, the series' labels as a legend in their colours above the plot; `x_label` follows the x end (`64 tokens`)."""
    if not series or not any(s.xs for s in series):
        raise ValueError("a line chart needs at least one point")
    top_x = x_max or max(max(s.xs) for s in series if s.xs) or 1.0
    top_y = max(max(s.ys) for s in series if s.ys)
    top_y = top_y if top_y > 0 else 1.0
    canvas = _Canvas(width, height)
    canvas.axis_labels(short_number(top_y), "0", "0", f"{short_number(top_x)} {x_label}".strip())
    legend_x = canvas.right
    for i, s in enumerate(reversed(series)):  # right-aligned legend, first series leftmost
        colour = COLOURS[(len(series) - 1 - i) % len(COLOURS)]
        canvas.right_aligned.append(_text(legend_x, TOP - 4, s.label, colour))
        legend_x -= 6 * len(s.label) + 8
    for i, s in enumerate(series):
        if not s.xs:
            continue
        points = [(canvas.px(x / top_x), canvas.py(y / top_y)) for x, y in zip(s.xs, s.ys)]
        canvas.parts.append(f"<path d='{_relative_path(points)}' fill='none' stroke='{COLOURS[i % len(COLOURS)]}'/>")
    return canvas.document()


def scatter_chart(points: Sequence[Point], x_unit: str, width: int = 320, height: int = 120) -> str:
    """Labelled dots, green where `passed` and red where not, against x from 0 and y on a log scale (a value at or
    below 0 sits on the floor, a decade under the smallest positive one); axes labelled with their ends."""
    if not points:
        raise ValueError("a scatter chart needs at least one point")
    positive = [p.y for p in points if p.y > 0]
    low = math.floor(math.log10(min(positive) / 10 if positive else 1e-9))
    high = max(math.ceil(math.log10(max(positive))) if positive else low + 1, low + 1)
    top_x = max(p.x for p in points) * 1.15 or 1.0  # room for the rightmost label
    canvas = _Canvas(width, height)
    canvas.axis_labels(f"1e{high}", f"1e{low}", "0", f"{short_number(top_x)} {x_unit}".strip())
    dots: dict[str, list[str]] = {PASS_COLOUR: [], FAIL_COLOUR: []}
    for p in sorted(points, key=lambda p: p.x):
        x = canvas.px(p.x / top_x)
        y = canvas.py((math.log10(p.y) - low) / (high - low) if p.y > 0 else 0.0)
        dots[PASS_COLOUR if p.passed else FAIL_COLOUR].append(f"M{x},{y}h0")
        canvas.parts.append(_text(x + 5, y - 3, p.label if p.y > 0 else f"{p.label} (0)"))
    for colour, moves in dots.items():  # a dot is a zero-length segment with a round cap: one path per colour
        if moves:
            canvas.parts.append(f"<path d='{''.join(moves)}' stroke='{colour}' stroke-width='7' "
                                "stroke-linecap='round'/>")
    return canvas.document()
