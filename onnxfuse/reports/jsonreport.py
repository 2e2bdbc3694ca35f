"""The ``diff`` JSON report: a stable schema (``onnxfuse/reports/schemas/diff-report.schema.json``,
version :data:`SCHEMA_VERSION`), installed with the package: :func:`schema_path` and :func:`load_schema`.

Strict JSON: NaN and Infinity are written as ``null``. Fields may be added in later versions; none
is removed or renamed without bumping ``schema_version``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from onnxfuse.reports._io import clean_json, write_text

SCHEMA_VERSION = 1


#: File name of the diff report's JSON Schema, in this package's ``schemas/`` folder.
SCHEMA_FILE = "diff-report.schema.json"


def schema_path() -> Path:
    """Path of the diff report's JSON Schema, a data file of this package (``schemas/``)."""
    return Path(__file__).resolve().parent / "schemas" / SCHEMA_FILE


def load_schema() -> dict:
    """The diff report's JSON Schema as a dict (read through :mod:`importlib.resources`)."""
    from importlib.resources import files

    return json.loads(files("onnxfuse.reports").joinpath("schemas", SCHEMA_FILE).read_text(encoding="utf-8"))


def diff_json(report) -> dict:
    """The JSON-ready dict of a :class:`onnxfuse.drift.DiffReport` (non-finite floats → ``None``)."""
    return clean_json(report.to_dict())


def write_json(path: str | os.PathLike, payload) -> Path:
    """Write ``payload`` (a dict, or anything with ``to_dict()``) as strict, indented JSON, atomically."""
    if hasattr(payload, "to_dict"):
        payload = payload.to_dict()
    text = json.dumps(clean_json(payload), indent=2, allow_nan=False) + "\n"
    return write_text(path, text, what="JSON report")
