"""Small inline-SVG charts for the HTML report: no JavaScript, no download, no CDN.

Each function returns one ``<svg>`` element as a string, sized by its
``viewBox`` so it scales with the page. Empty data gives a chart that says
so instead of an empty frame. Every chart has a title, one unit on its value
axis and a legend along its bottom edge, so it reads without the text around it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1")
WIDTH = 720
HEIGHT = 300
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 36, 64


def _nice_max(value: float) -> float:
    if value <= 0 or not math.isfinite(value):
        return 1.0
    exponent = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * exponent:
            return step * exponent
    return 10 * exponent


def _frame(title: str, y_max: float, unit: str) -> list[str]:
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'role="img" aria-label="{escape(title)}" class="chart">',
        f'<text x="{LEFT}" y="20" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    plot_h = HEIGHT - TOP - BOTTOM
    for i in range(5):
        value = y_max * i / 4
        y = TOP + plot_h - plot_h * i / 4
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" '
                     'stroke="#ddd"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" font-size="11" '
                     f'text-anchor="end">{value:g}</text>')
    parts.append(f'<text x="14" y="{TOP + plot_h / 2:.0f}" font-size="11" '
                 f'transform="rotate(-90 14 {TOP + plot_h / 2:.0f})" '
                 f'text-anchor="middle">{escape(unit)}</text>')
    return parts


def _legend(names: Sequence[str], target: str | None = None) -> list[str]:
    """Colour keys for ``names``; ``target`` is keyed as the dashed line it is drawn as."""
    parts = []
    x = LEFT
    for i, name in enumerate([*names, *([target] if target else [])]):
        if name == target and i == len(names):
            parts.append(f'<line x1="{x}" x2="{x + 10}" y1="{HEIGHT - 11}" y2="{HEIGHT - 11}" '
                         'stroke="#000" stroke-width="2" stroke-dasharray="4 2"/>')
        else:
            color = PALETTE[i % len(PALETTE)]
            parts.append(f'<rect x="{x}" y="{HEIGHT - 16}" width="10" height="10" '
                         f'fill="{color}"/>')
        parts.append(f'<text x="{x + 14}" y="{HEIGHT - 7}" font-size="11">{escape(name)}</text>')
        x += 24 + 7 * len(name)
    return parts


def _empty(title: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} 80" class="chart">'
            f'<text x="{LEFT}" y="20" font-size="14" font-weight="bold">{escape(title)}</text>'
            f'<text x="{LEFT}" y="50" font-size="12" fill="#777">no data this week</text></svg>')


def bars(title: str, categories: Sequence[str], series: dict[str, Sequence[float]],
         unit: str, marks: Sequence[float | None] | None = None) -> str:
    """Grouped bars, one group per category; ``marks`` draws a target tick per category."""
    if not categories or not series:
        return _empty(title)
    values = [v for vs in series.values() for v in vs]
    y_max = _nice_max(max([*values, *(m for m in (marks or []) if m is not None)], default=0))
    parts = _frame(title, y_max, unit)
    plot_w = WIDTH - LEFT - RIGHT
    plot_h = HEIGHT - TOP - BOTTOM
    group_w = plot_w / len(categories)
    bar_w = group_w * 0.8 / len(series)
    for c, category in enumerate(str(name) for name in categories):
        x0 = LEFT + c * group_w + group_w * 0.1
        for s, (name, vs) in enumerate(series.items()):
            h = plot_h * vs[c] / y_max
            parts.append(
                f'<rect x="{x0 + s * bar_w:.1f}" y="{TOP + plot_h - h:.1f}" '
                f'width="{max(bar_w - 1, 1):.1f}" height="{h:.1f}" '
                f'fill="{PALETTE[s % len(PALETTE)]}"><title>{escape(name)} {escape(category)}: '
                f'{vs[c]:,.1f} {escape(unit)}</title></rect>')
        if marks and marks[c] is not None:
            y = TOP + plot_h - plot_h * float(marks[c] or 0) / y_max
            parts.append(f'<line x1="{x0:.1f}" x2="{x0 + group_w * 0.8:.1f}" y1="{y:.1f}" '
                         f'y2="{y:.1f}" stroke="#000" stroke-width="2" stroke-dasharray="4 2"/>')
        label = category if len(category) <= 18 else category[:17] + "…"
        parts.append(f'<text x="{x0 + group_w * 0.4:.1f}" y="{TOP + plot_h + 14}" '
                     f'font-size="10" text-anchor="middle">{escape(label)}</text>')
    parts.extend(_legend(list(series), "target" if marks else None))
    parts.append("</svg>")
    return "".join(parts)


def lines(title: str, x_labels: Sequence[str], series: dict[str, Sequence[float]],
          unit: str, y_max: float | None = None) -> str:
    """One polyline per series over evenly spaced points; x labels thinned to fit."""
    if not x_labels or not series:
        return _empty(title)
    top = y_max or _nice_max(max((v for vs in series.values() for v in vs), default=0))
    parts = _frame(title, top, unit)
    plot_w = WIDTH - LEFT - RIGHT
    plot_h = HEIGHT - TOP - BOTTOM
    n = len(x_labels)

    def x(i: int) -> float:
        return LEFT + (plot_w * i / (n - 1) if n > 1 else plot_w / 2)

    for s, (name, vs) in enumerate(series.items()):
        points = " ".join(f"{x(i):.1f},{TOP + plot_h - plot_h * min(v, top) / top:.1f}"
                          for i, v in enumerate(vs))
        parts.append(f'<polyline points="{points}" fill="none" stroke-width="2" '
                     f'stroke="{PALETTE[s % len(PALETTE)]}"><title>{escape(name)}</title>'
                     '</polyline>')
    every = max(1, math.ceil(n / 8))
    for i in range(0, n, every):
        parts.append(f'<text x="{x(i):.1f}" y="{TOP + plot_h + 14}" font-size="10" '
                     f'text-anchor="middle">{escape(x_labels[i])}</text>')
    parts.extend(_legend(list(series)))
    parts.append("</svg>")
    return "".join(parts)


def _ramp(share: float) -> str:
    """White to the palette's first colour: darker is busier."""
    base = (0x4E, 0x79, 0xA7)
    r, g, b = (round(255 - (255 - c) * min(max(share, 0.0), 1.0)) for c in base)
    return f"#{r:02x}{g:02x}{b:02x}"


def heatmap(title: str, rows: Sequence[str], columns: Sequence[str],
            values: Sequence[Sequence[float | None]], unit: str, top: float = 100.0) -> str:
    """A grid of cells, ``values[row][column]`` from 0 (white) to ``top`` (darkest);
    None (nothing allocated) is left grey."""
    if not rows or not columns:
        return _empty(title)
    height = TOP + 18 * len(rows) + 50
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" '
        f'role="img" aria-label="{escape(title)}" class="chart">',
        f'<text x="{LEFT}" y="20" font-size="14" font-weight="bold">{escape(title)}</text>']
    cell_w = (WIDTH - LEFT - RIGHT) / len(columns)
    for r, name in enumerate(rows):
        y = TOP + 18 * r
        parts.append(f'<text x="{LEFT - 6}" y="{y + 13}" font-size="11" '
                     f'text-anchor="end">{escape(name)}</text>')
        for c, value in enumerate(values[r]):
            fill = "#e8e8e8" if value is None else _ramp(value / top)
            label = "nothing allocated" if value is None else f"{value:.0f} {unit}"
            parts.append(f'<rect x="{LEFT + c * cell_w:.1f}" y="{y}" width="{cell_w - 1:.1f}" '
                         f'height="17" fill="{fill}"><title>{escape(name)} '
                         f'{escape(columns[c])}: {escape(label)}</title></rect>')
    every = max(1, math.ceil(len(columns) / 12))
    for c in range(0, len(columns), every):
        parts.append(f'<text x="{LEFT + (c + 0.5) * cell_w:.1f}" y="{TOP + 18 * len(rows) + 12}"'
                     f' font-size="10" text-anchor="middle">{escape(columns[c])}</text>')
    # The legend: the colour scale in steps, then grey for no allocation.
    x, y = LEFT, height - 16
    for step in range(5):
        share = step / 4
        parts.append(f'<rect x="{x}" y="{y}" width="10" height="10" fill="{_ramp(share)}" '
                     'stroke="#999" stroke-width="0.5"/>')
        parts.append(f'<text x="{x + 14}" y="{y + 9}" font-size="11">'
                     f'{top * share:g}{escape(" " + unit if step == 4 else "")}</text>')
        x += 44 if step < 4 else 80
    parts.append(f'<rect x="{x}" y="{y}" width="10" height="10" fill="#e8e8e8"/>'
                 f'<text x="{x + 14}" y="{y + 9}" font-size="11">nothing allocated</text>')
    parts.append("</svg>")
    return "".join(parts)


def boxes(title: str, rows: Sequence[tuple[str, float, float, float, float, float]],
          unit: str, y_max: float = 100.0) -> str:
    """Box plots: per row a label and its p5, p25, p50, p75, p95."""
    if not rows:
        return _empty(title)
    parts = _frame(title, y_max, unit)
    plot_w = WIDTH - LEFT - RIGHT
    plot_h = HEIGHT - TOP - BOTTOM
    slot = plot_w / len(rows)

    def y(v: float) -> float:
        return TOP + plot_h - plot_h * min(max(v, 0.0), y_max) / y_max

    for i, (label, p5, p25, p50, p75, p95) in enumerate(rows):
        cx = LEFT + slot * (i + 0.5)
        w = min(slot * 0.6, 40)
        parts.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y(p95):.1f}" y2="{y(p5):.1f}" '
                     'stroke="#333"/>')
        parts.append(f'<rect x="{cx - w / 2:.1f}" y="{y(p75):.1f}" width="{w:.1f}" '
                     f'height="{max(y(p25) - y(p75), 1):.1f}" fill="{PALETTE[0]}" '
                     f'stroke="#333"><title>{escape(label)}: p5 {p5:.0f}, p25 {p25:.0f}, '
                     f'p50 {p50:.0f}, p75 {p75:.0f}, p95 {p95:.0f}</title></rect>')
        parts.append(f'<line x1="{cx - w / 2:.1f}" x2="{cx + w / 2:.1f}" y1="{y(p50):.1f}" '
                     f'y2="{y(p50):.1f}" stroke="#fff" stroke-width="2"/>')
        # Short enough that the slanted label ends above the legend.
        short = label if len(label) <= 10 else label[:9] + "…"
        parts.append(f'<text x="{cx:.1f}" y="{TOP + plot_h + 12}" font-size="9" '
                     f'text-anchor="end" transform="rotate(-30 {cx:.1f} {TOP + plot_h + 12})">'
                     f'{escape(short)}</text>')
    # Legend on the right of the bottom edge: the rotated labels fill its left.
    x = WIDTH - RIGHT - 330
    parts.append(f'<rect x="{x}" y="{HEIGHT - 16}" width="10" height="10" fill="{PALETTE[0]}"/>'
                 f'<text x="{x + 14}" y="{HEIGHT - 7}" font-size="11">p25-p75</text>'
                 f'<line x1="{x + 80}" x2="{x + 80}" y1="{HEIGHT - 18}" y2="{HEIGHT - 4}" '
                 f'stroke="#333"/><text x="{x + 86}" y="{HEIGHT - 7}" font-size="11">p5-p95'
                 f'</text><rect x="{x + 140}" y="{HEIGHT - 16}" width="10" height="10" '
                 f'fill="{PALETTE[0]}"/><line x1="{x + 140}" x2="{x + 150}" '
                 f'y1="{HEIGHT - 11}" y2="{HEIGHT - 11}" stroke="#fff" stroke-width="2"/>'
                 f'<text x="{x + 154}" y="{HEIGHT - 7}" font-size="11">median (p50)</text>')
    parts.append("</svg>")
    return "".join(parts)
