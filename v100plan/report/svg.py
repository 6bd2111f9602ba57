"""Small hand-written SVG helpers for the HTML report: scales, axes, frames, the "not measured" box.

Every function returns markup as a string and escapes every text it is given;
nothing here reads a document. Coordinates are SVG user units (1 unit = 1 CSS
pixel at the page's natural size); plots scale with the page through viewBox.
"""

from __future__ import annotations

import html
import math
import re
import textwrap
from collections.abc import Iterable, Sequence

# XML 1.0 forbids these even escaped; a log line can carry them (ANSI colours, NUL).
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")

PALETTE = {
    "passed": "#1a7f37", "warned": "#b26a00", "failed": "#cf222e", "error": "#8250df", "waived": "#6e7781",
    "axis": "#57606a", "grid": "#d8dee4", "ink": "#24292f", "accent": "#0969da", "accent2": "#bf3989",
    "detect": "#d4a72c", "recover": "#1a7f37",
}


def esc(value: object) -> str:
    """Text safe inside an element or a double-quoted attribute (control characters become U+FFFD)."""
    return html.escape(_CONTROL.sub("\ufffd", str(value)), quote=True)


def num(v: float) -> str:
    """A coordinate with at most two decimals, no trailing zeros."""
    s = f"{v:.2f}".rstrip("0").rstrip(".")
    return "0" if s == "-0" else s


def fmt(v: float | None, unit: str = "", digits: int = 3) -> str:
    """A figure for a label: ``digits`` significant digits (trailing zeros dropped), the unit after a space."""
    if v is None:
        return "n/a"
    if v == 0:
        text = "0"
    else:
        mag = math.floor(math.log10(abs(v)))
        decimals = max(0, digits - 1 - mag)
        text = f"{v:.{decimals}f}"
        if "." in text:
            text = text.rstrip("0").rstrip(".")
    return f"{text} {unit}".rstrip()


class Scale:
    """Linear map of [lo, hi] onto [a, b] (b < a for a y axis that grows upwards)."""

    def __init__(self, lo: float, hi: float, a: float, b: float):
        if hi <= lo:
            hi = lo + (abs(lo) or 1.0)
        self.lo, self.hi, self.a, self.b = lo, hi, a, b

    def __call__(self, v: float) -> float:
        return self.a + (v - self.lo) / (self.hi - self.lo) * (self.b - self.a)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]: steps of 1, 2 or 5 x 10^n."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(count, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks, v = [], first
    while v <= hi + step * 1e-9:
        ticks.append(round(v, 12))
        v += step
    return ticks


def nice_max(hi: float) -> float:
    """The first nice tick at or above ``hi`` (axis ends on a labelled value)."""
    if hi <= 0:
        return 1.0
    ticks = nice_ticks(0.0, hi)
    return ticks[-1] if ticks[-1] >= hi else ticks[-1] + (ticks[-1] - ticks[-2] if len(ticks) > 1 else hi)


def text(x: float, y: float, content: object, anchor: str = "start", size: int = 11,
         fill: str | None = None, weight: str | None = None, css: str | None = None) -> str:
    attrs = [f'x="{num(x)}"', f'y="{num(y)}"', f'font-size="{size}"']
    if anchor != "start":
        attrs.append(f'text-anchor="{anchor}"')
    attrs.append(f'fill="{fill or PALETTE["ink"]}"')
    if weight:
        attrs.append(f'font-weight="{weight}"')
    if css:
        attrs.append(f'class="{css}"')
    return f"<text {' '.join(attrs)}>{esc(content)}</text>"


def line(x1: float, y1: float, x2: float, y2: float, stroke: str, width: float = 1,
         dash: str | None = None, tip: str | None = None) -> str:
    extra = f' stroke-dasharray="{dash}"' if dash else ""
    body = f"<title>{esc(tip)}</title>" if tip else ""
    return (f'<line x1="{num(x1)}" y1="{num(y1)}" x2="{num(x2)}" y2="{num(y2)}" stroke="{stroke}" '
            f'stroke-width="{num(width)}"{extra}>{body}</line>')


def rect(x: float, y: float, w: float, h: float, fill: str, tip: str | None = None,
         stroke: str | None = None, css: str | None = None, opacity: float | None = None,
         dash: str | None = None) -> str:
    extra = f' stroke="{stroke}"' if stroke else ""
    extra += f' stroke-dasharray="{dash}"' if dash else ""
    extra += f' class="{css}"' if css else ""
    extra += f' fill-opacity="{num(opacity)}"' if opacity is not None else ""
    body = f"<title>{esc(tip)}</title>" if tip else ""
    return (f'<rect x="{num(x)}" y="{num(y)}" width="{num(max(w, 0))}" height="{num(max(h, 0))}" '
            f'fill="{fill}"{extra}>{body}</rect>')


def circle(cx: float, cy: float, r: float, fill: str, tip: str | None = None) -> str:
    body = f"<title>{esc(tip)}</title>" if tip else ""
    return f'<circle cx="{num(cx)}" cy="{num(cy)}" r="{num(r)}" fill="{fill}">{body}</circle>'


def polyline(points: Iterable[tuple[float, float]], stroke: str, width: float = 1.5,
             dash: str | None = None) -> str:
    pts = " ".join(f"{num(x)},{num(y)}" for x, y in points)
    extra = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<polyline points="{pts}" fill="none" stroke="{stroke}" stroke-width="{num(width)}"'
            f' stroke-linejoin="round"{extra}/>')


def x_axis(scale: Scale, y: float, ticks: Sequence[float], label: str, unit: str = "") -> str:
    """Baseline, ticks with values and the axis label under them."""
    parts = [line(scale.a, y, scale.b, y, PALETTE["axis"])]
    for t in ticks:
        x = scale(t)
        parts.append(line(x, y, x, y + 4, PALETTE["axis"]))
        parts.append(text(x, y + 15, fmt(t, digits=3) if t else "0", anchor="middle", size=10, fill=PALETTE["axis"]))
    parts.append(text((scale.a + scale.b) / 2, y + 30, f"{label} ({unit})" if unit else label, anchor="middle",
                      size=11, fill=PALETTE["axis"]))
    return "".join(parts)


def y_axis(scale: Scale, x: float, ticks: Sequence[float], label: str, right: bool = False,
           grid_to: float | None = None, color: str | None = None) -> str:
    """Vertical axis at ``x`` with tick values; optional horizontal grid lines to ``grid_to``."""
    color = color or PALETTE["axis"]
    d = 4 if right else -4
    parts = [line(x, scale.a, x, scale.b, color)]
    for t in ticks:
        y = scale(t)
        if grid_to is not None:
            parts.append(line(x, y, grid_to, y, PALETTE["grid"]))
        parts.append(line(x, y, x + d, y, color))
        parts.append(text(x + d * 1.5, y + 3.5, fmt(t, digits=3) if t else "0",
                          anchor="start" if right else "end", size=10, fill=color))
    top = min(scale.a, scale.b)
    parts.append(text(x, top - 8, label, anchor="end" if not right else "start", size=11, fill=color))
    return "".join(parts)


TITLE_H = 26
PLOT_WIDTH = 1040  # the page's content width (html.py: main max-width), so a plot is drawn at its natural size


def wrapped(x: float, y: float, label: str, width: float, size: int = 12, fill: str | None = None,
            leading: float = 1.35) -> tuple[str, int]:
    """``label`` broken at spaces into lines that fit ``width`` (never cut mid-word); (markup, line count)."""
    per_line = max(20, int(width / (size * 0.6)))  # a conservative glyph width: 0.6 em
    lines = textwrap.wrap(label, per_line, break_long_words=False, break_on_hyphens=False) or [""]
    markup = "".join(text(x, y + i * size * leading, ln, size=size, fill=fill) for i, ln in enumerate(lines))
    return markup, len(lines)


def frame(name: str, width: int, height: int, body: str, title: str, css: str = "plot") -> str:
    """One plot: an <svg> carrying data-plot=name with its title on top, sized by viewBox so it scales."""
    h = height + TITLE_H
    return (f'<svg data-plot="{esc(name)}" class="{css}" xmlns="http://www.w3.org/2000/svg" role="img" '
            f'viewBox="0 0 {width} {h}" width="{width}" height="{h}" '
            f'font-family="system-ui, sans-serif"><title>{esc(title)}</title>'
            f'<rect x="0" y="0" width="{width}" height="{h}" fill="#ffffff"/>'
            + text(12, 18, title, size=13, weight="600")
            + f'<g transform="translate(0,{TITLE_H})">{body}</g></svg>')


def not_measured(name: str, reason: str, title: str, width: int = PLOT_WIDTH) -> str:
    """The visible box a plot becomes when its data is absent: never an empty frame. A long reason wraps
    at spaces and the box grows with it."""
    lines, n = wrapped(20, 20, f"not measured: {reason}", width - 48, size=12, fill=PALETTE["waived"])
    height = 24 + round(n * 12 * 1.35)
    body = rect(8, 2, width - 16, height - 8, "#f6f8fa", stroke=PALETTE["waived"], css="not-measured-box", dash="6 4")
    return frame(name, width, height, body + lines, title, css="plot not-measured")


def legend(x: float, y: float, items: Sequence[tuple[str, str]], step: float = 130) -> str:
    """Coloured squares with labels in one row starting at (x, y)."""
    parts = []
    for i, (color, label) in enumerate(items):
        parts.append(rect(x + i * step, y - 9, 10, 10, color))
        parts.append(text(x + i * step + 14, y, label, size=10))
    return "".join(parts)
