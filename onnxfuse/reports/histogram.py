"""Absolute-error histograms rendered as inline SVG (no JS, no matplotlib); the histograms themselves are
computed by :mod:`onnxfuse.runtime.histogram`, next to the comparator that fills them.
"""

from __future__ import annotations

import math
from html import escape


def _exp_label(x: float) -> str:
    e = math.log10(x)
    return f"1e{round(e)}" if abs(e - round(e)) < 1e-9 else f"{x:.1e}"


def histogram_svg(hist: dict | None, atol: float | None = None, width: int = 560, height: int = 180,
                  title: str = "") -> str:
    """Inline ``<svg>`` bar chart of an :func:`error_histogram` result (a zero-error bar first).

    A dashed line marks ``atol`` when it lies inside the plotted range.
    """
    if hist is None:
        return '<p class="muted">no histogram (shapes differ)</p>'
    labels = ["0"] + [_exp_label(e) for e in hist["edges"][:-1]]
    counts = [hist["zeros"]] + list(hist["counts"])
    if sum(counts) == 0:
        return '<p class="muted">no finite elements to plot</p>'
    left, right, top, bottom = 48, 12, 18, 34
    plot_w, plot_h = width - left - right, height - top - bottom
    n = len(counts)
    bar_w = plot_w / n
    peak = max(counts)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title or "error histogram")}">',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#555"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#555"/>',
        f'<text x="{left - 4}" y="{top + 4}" text-anchor="end" font-size="10">{peak}</text>',
        f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end" font-size="10">0</text>',
        f'<text x="{left + plot_w / 2}" y="{height - 2}" text-anchor="middle" font-size="10">'
        f'|A − B| (log scale; first bar: exactly 0)</text>',
    ]
    step = max(1, math.ceil(n / 10))
    for i, (label, c) in enumerate(zip(labels, counts)):
        x = left + i * bar_w
        h = 0 if peak == 0 else plot_h * c / peak
        color = "#6a9f58" if i == 0 else "#4e79a7"
        tip = "exactly 0" if i == 0 else f"[{label}, {_exp_label(hist['edges'][i])})"
        parts.append(
            f'<rect x="{x + 1:.1f}" y="{top + plot_h - h:.1f}" width="{max(bar_w - 2, 1):.1f}" height="{h:.1f}" '
            f'fill="{color}"><title>{escape(tip)}: {c}</title></rect>'
        )
        if i % step == 0:
            parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{top + plot_h + 12}" text-anchor="middle" '
                         f'font-size="9">{escape(label)}</text>')
    edges = hist["edges"]
    if atol and edges and edges[0] <= atol <= edges[-1]:
        span = math.log10(edges[-1]) - math.log10(edges[0])
        frac = (math.log10(atol) - math.log10(edges[0])) / span if span else 0.0
        x = left + bar_w * (1 + frac * (n - 1))
        parts.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + plot_h}" stroke="#e15759" '
                     f'stroke-dasharray="4 3"/>')
        parts.append(f'<text x="{x + 3:.1f}" y="{top + 9}" font-size="9" fill="#e15759">atol</text>')
    parts.append("</svg>")
    return "".join(parts)
