"""Report builders: turn comparison results into JSON, Markdown, JUnit XML and self-contained HTML.

Library side only (no click, no rich), so every command can reuse them: ``diff`` writes all four,
``optimize`` can reuse :func:`markdown.comparisons_markdown` and :func:`junit.comparisons_junit` for
its validation results. Builders return strings; :func:`write_text` writes one atomically.

Each builder works on :class:`onnxfuse.runtime.compare.Comparison` objects (or on a
:class:`onnxfuse.drift.DiffReport` for the ``diff_*`` variants) and never recomputes a metric.
"""

from __future__ import annotations

from onnxfuse.reports.files import clean_json, write_markdown, write_text
from onnxfuse.reports.histogram import histogram_svg
from onnxfuse.runtime.histogram import error_histogram
from onnxfuse.reports.html import diff_html
from onnxfuse.reports.contract import SCHEMA_VERSION, load_schema, schema_path
from onnxfuse.reports.jsonreport import diff_json, optimize_json, write_json
from onnxfuse.reports.junit import comparisons_junit, diff_junit
from onnxfuse.reports.markdown import comparisons_markdown, diff_markdown

__all__ = [
    "SCHEMA_VERSION", "clean_json", "comparisons_junit", "comparisons_markdown", "diff_html", "diff_json",
    "diff_junit", "diff_markdown", "optimize_json", "error_histogram", "histogram_svg", "load_schema", "schema_path", "write_json",
    "write_markdown", "write_text",
]
