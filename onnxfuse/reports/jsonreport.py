"""The ``--json`` documents of each command, all in the one contract of :mod:`onnxfuse.reports.contract`."""

from __future__ import annotations

import os
from pathlib import Path

from onnxfuse.errors import EXIT_VALIDATION_FAILED
from onnxfuse.reports.contract import SCHEMA_VERSION, document, load_schema, schema_path  # noqa: F401
from onnxfuse.reports.files import json_text, write_text
from onnxfuse.reports.formatting import drift_failure


def diff_json(report) -> dict:
    """The ``diff`` document of a :class:`onnxfuse.drift.DiffReport`: ``ok`` when every output passed,
    else exit code 3 and the one-line failure."""
    error = drift_failure(report)
    return document("diff", report.to_dict(), exit_code=0 if error is None else EXIT_VALIDATION_FAILED, error=error)


def optimize_body(result) -> dict:
    """The ``result`` body of one model's ``optimize`` report (also each entry of the many-models report)."""
    return {**result.to_dict(), "culprit": result.culprit if result.exit_code == EXIT_VALIDATION_FAILED else None}


def optimize_json(result) -> dict:
    """The ``optimize`` document of an :class:`onnxfuse.pipeline.OptimizeResult`, also after a failed
    validation or latency check (``result.error`` set; ``culprit`` names the rule after exit 3)."""
    return document("optimize", optimize_body(result), exit_code=result.exit_code, error=result.error)


def write_json(path: str | os.PathLike, payload) -> Path:
    """Write ``payload`` (a dict, or anything with ``to_json()``) as strict, indented JSON, atomically."""
    return write_text(path, json_text(payload), what="JSON report")
