"""A self-contained HTML ``diff`` report: one file, inline CSS and SVG, no scripts, no external assets."""

from __future__ import annotations

from html import escape

from onnxfuse.reports import formatting
from onnxfuse.reports.histogram import histogram_svg

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1200px;color:#222;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em}h3{font-size:1em;margin-bottom:.3em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:right;white-space:nowrap}
th{background:#f4f4f4}td.l,th.l{text-align:left}
tr.fail td{background:#fdecea}.pass{color:#2e7d32;font-weight:600}.fail-t{color:#c62828;font-weight:600}
.muted{color:#777}code{background:#f4f4f4;padding:0 3px;border-radius:3px}
.card{border:1px solid #ddd;border-radius:6px;padding:.6em 1em;margin:.8em 0}
dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}dt{font-weight:600}dd{margin:0}
"""

_COLUMNS = ("", "tensor", "shape", "dtype", "max abs", "max rel", "mean abs", "RMS", "cosine", "beyond tol",
            "NaN/Inf", "worst element", "tolerance")


def _row(c, extra_cols=()) -> str:
    verdict = '<span class="pass">pass</span>' if c.passed else '<span class="fail-t">FAIL</span>'
    name = escape(c.name) + (f" → {escape(c.extra['name_b'])}" if c.extra.get("name_b") else "")
    dtype = escape(c.dtype + (f" / {c.extra['dtype_b']}" if c.extra.get("dtype_b") else ""))
    cls = "" if c.passed else ' class="fail"'
    pre = "".join(f"<td>{escape(str(v))}</td>" for v in extra_cols)
    if c.error:
        return (f"<tr{cls}>{pre}<td class=l>{verdict}</td><td class=l><code>{name}</code></td>"
                f"<td>{formatting.shape(c.shape)}</td><td>{dtype}</td><td class=l colspan=9>{escape(c.error)}</td></tr>")
    cells = [formatting.num(c.max_abs), formatting.num(c.max_rel), formatting.num(c.mean_abs), formatting.num(c.rms),
             formatting.num(c.cosine, 6), formatting.percent(c.mismatch_fraction), str(c.nonfinite_mismatches)]
    return (f"<tr{cls}>{pre}<td class=l>{verdict}</td><td class=l><code>{name}</code></td>"
            f"<td>{formatting.shape(c.shape)}</td><td>{dtype}</td>" + "".join(f"<td>{escape(x)}</td>" for x in cells)
            + f"<td class=l>{escape(formatting.worst(c))}</td><td>{escape(formatting.tolerance(c))}</td></tr>")


def _table(comparisons, extra_headers=(), extra=None) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in extra_headers)
    head += "".join(f'<th class="l">{escape(h)}</th>' if h in ("", "tensor", "worst element") else
                    f"<th>{escape(h)}</th>" for h in _COLUMNS)
    rows = "".join(_row(c, extra(c) if extra else ()) for c in comparisons)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def diff_html(report, max_intermediates: int = 5000) -> str:
    """The whole ``diff`` report as one HTML document, with an error histogram per output."""
    status = '<span class="pass">PASS</span>' if report.passed else '<span class="fail-t">FAIL</span>'
    inputs = report.inputs
    src = f"seed {inputs['seed']}" if inputs.get("seed") is not None else f"file {inputs['source']}"
    shapes = ", ".join(f"{k}: {formatting.shape(v)} ({inputs['dtypes_a'].get(k, '')} / {inputs['dtypes_b'].get(k, '')})"
                       for k, v in inputs["shapes"].items()) or "(none)"
    parts = [
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>onnxfuse diff: {'pass' if report.passed else 'FAIL'}</title><style>{_CSS}</style></head><body>",
        f"<h1>onnxfuse diff: {status}</h1><dl>",
        f"<dt>A</dt><dd><code>{escape(report.model_a)}</code> on {escape(report.provider_a.upper())}</dd>",
        f"<dt>B</dt><dd><code>{escape(report.model_b)}</code> on {escape(report.provider_b.upper())}</dd>",
        f"<dt>inputs</dt><dd>{escape(src)}, {inputs['samples']} sample(s); {escape(shapes)}</dd>",
        f"<dt>time</dt><dd>{report.seconds:.2f} s</dd>",
    ]
    fd = report.first_divergence
    if fd:
        where = f" ({escape(fd['op_type'])} node <code>{escape(fd['node'] or '')}</code>)" if fd.get("op_type") else ""
        parts.append(f"<dt>first divergence</dt><dd>{escape(fd['kind'])} <code>{escape(fd['name'])}</code>{where}, "
                     f"max abs {formatting.num(fd['max_abs'])}</dd>")
    parts.append("</dl>")
    parts.append("<h2>Outputs</h2>" + _table(report.outputs))
    for c in report.outputs:
        hist = report.histograms.get(c.name)
        parts.append(f'<div class="card"><h3><code>{escape(c.name)}</code>: |A − B| per element</h3>')
        if hist is not None:
            parts.append(f'<p class="muted">{hist["zeros"]} element(s) exactly equal'
                         + (f", {hist['nonfinite']} non-finite on either side" if hist.get("nonfinite") else "")
                         + "</p>")
        parts.append(histogram_svg(hist, atol=c.atol if not c.error else None, title=f"error histogram of {c.name}"))
        parts.append("</div>")
    if report.intermediates_checked:
        failed = sum(not c.passed for c in report.intermediates)
        shown = report.intermediates[:max_intermediates]
        parts.append(f"<h2>Intermediate tensors</h2><p>{len(report.intermediates)} compared in topological order "
                     f"of A, {failed} beyond tolerance"
                     + (f"; first {len(shown)} shown" if len(shown) < len(report.intermediates) else "") + ".</p>")
        parts.append(_table(shown, ("#", "op"), lambda c: (c.extra.get("position", ""), c.extra.get("op_type", ""))))
    if report.notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{escape(n)}</li>" for n in report.notes) + "</ul>")
    parts.append("</body></html>\n")
    return "".join(parts)
