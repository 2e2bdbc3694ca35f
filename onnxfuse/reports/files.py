"""Writing report files: atomic replace (or append, for CI summary files) with one-line errors.

Reports written together with a model go through one :class:`onnxfuse.atomic.OutputSet`
(:func:`stage_report`), so the model, its data and the reports land together or not at all;
:func:`check_report_paths` refuses unwritable report paths before any long work starts.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from onnxfuse.errors import ModelSaveError
from onnxfuse.atomic import OutputSet, check_file_name, destination


def write_text(path: str | os.PathLike, text: str, what: str = "report", append: bool = False) -> Path:
    """Write ``text`` to ``path``: atomically (a uniquely named temporary file in the same folder, then a
    rename), or appended when ``append``.

    Raises :class:`ModelSaveError` (exit code 1) with one line when the file cannot be written.
    """
    p = Path(path)
    _check_one(p, what)
    with OutputSet() as out:
        if append:
            out.append_text(p, text, what)
        else:
            out.write_text(p, text, what)
        out.commit()
    return p


def _check_one(p, what: str) -> None:
    check_file_name(p, what)
    p = Path(p)
    if p.is_dir():
        raise ModelSaveError(f"{p}: is a directory, cannot write the {what}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ModelSaveError(f"{p}: directory {parent} does not exist, cannot write the {what}")
    if not os.access(parent, os.W_OK):
        raise ModelSaveError(f"{p}: directory {parent} is not writable, cannot write the {what}")
    destination(p, what)


def check_report_paths(reports: dict, taken: dict | None = None) -> None:
    """Fail before any work when a report cannot be written: ``reports`` maps a path (or None) to what
    it is (``"JSON report"``); ``taken`` maps paths the run writes or reads (the model, its data, the
    input) to what they are. Two outputs on one path, or a report over the model or an input, are
    refused: one of them would silently replace the other."""
    seen: dict[str, str] = {}
    for path, what in (taken or {}).items():
        if path is not None:
            seen[os.path.realpath(path)] = what
    for path, what in reports.items():
        if not path:
            continue
        _check_one(path, what)
        p = Path(path)
        real = os.path.realpath(p)
        if real in seen and not is_step_summary(p):
            raise ModelSaveError(f"{p}: the {what} would overwrite the {seen[real]}; choose another path")
        seen[real] = what


def is_step_summary(path) -> bool:
    """True when ``path`` is GitHub's ``$GITHUB_STEP_SUMMARY`` (reports are appended there)."""
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    return bool(summary) and Path(summary).resolve() == Path(path).resolve()


def json_text(payload) -> str:
    """``payload`` (a dict, or a result with ``to_json()``: the contract document) as strict, indented JSON."""
    if hasattr(payload, "to_json"):
        payload = payload.to_json()
    return json.dumps(clean_json(payload), indent=2, allow_nan=False) + "\n"


def stage_report(outputs, path, text: str, what: str) -> None:
    """Stage a report in an :class:`~onnxfuse.atomic.OutputSet`: replaced at commit, or appended when
    ``path`` is ``$GITHUB_STEP_SUMMARY`` and ``what`` is the Markdown report."""
    if what == "Markdown report" and is_step_summary(path):
        outputs.append_text(path, text, what)
    else:
        outputs.write_text(path, text, what)


def stage_reports(outputs, reports) -> None:
    """Stage each ``(path, make_text, what)`` of ``reports`` whose path is given (:func:`stage_report`);
    ``make_text()`` runs only for those, so a report nobody asked for is never rendered."""
    for path, make_text, what in reports:
        if path:
            stage_report(outputs, path, make_text(), what)


def write_markdown(path: str | os.PathLike, text: str) -> Path:
    """Write a Markdown report; append instead when ``path`` is ``$GITHUB_STEP_SUMMARY``.

    A job summary collects every step's output, so replacing it would erase earlier steps' reports.
    """
    return write_text(path, text, what="Markdown report", append=is_step_summary(path))


def clean_json(value):
    """``value`` with NaN/Inf floats turned into ``None`` and numpy scalars into Python ones.

    JSON has no NaN or Infinity; strict parsers (and the schema) reject them.
    """
    if isinstance(value, dict):
        return {str(k): clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy scalar
        try:
            value = value.item()
        except (TypeError, ValueError):
            return str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return value
