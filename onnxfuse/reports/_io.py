"""Writing report files: atomic replace (or append, for CI summary files) with one-line errors."""

from __future__ import annotations

import math
import os
from pathlib import Path

from onnxfuse.errors import ModelSaveError


def write_text(path: str | os.PathLike, text: str, what: str = "report", append: bool = False) -> Path:
    """Write ``text`` to ``path``: atomically (temporary file, then rename), or appended when ``append``.

    Raises :class:`ModelSaveError` (exit code 1) with one line when the file cannot be written.
    """
    p = Path(path)
    if p.is_dir():
        raise ModelSaveError(f"{p}: is a directory, cannot write the {what}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ModelSaveError(f"{p}: directory {parent} does not exist, cannot write the {what}")
    try:
        if append:
            with open(p, "a", encoding="utf-8") as f:
                f.write(text)
            return p
        tmp = p.with_name(f".{p.name}.tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(p)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise ModelSaveError(f"{p}: cannot write the {what} ({exc.strerror or exc})") from None
    return p


def write_markdown(path: str | os.PathLike, text: str) -> Path:
    """Write a Markdown report; append instead when ``path`` is ``$GITHUB_STEP_SUMMARY``.

    A job summary collects every step's output, so replacing it would erase earlier steps' reports.
    """
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    append = bool(summary) and Path(summary).resolve() == Path(path).resolve()
    return write_text(path, text, what="Markdown report", append=append)


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
