"""The one JSON contract of ``optimize``, ``diff`` and ``bench`` (``--json FILE`` or ``--json -``, and
``.to_json()`` in the Python API).

Every document has the same top level, then the command's own body under ``result``::

    {"schema_version": 2, "tool": {"name": "onnxfuse", "version": ...}, "command": "optimize",
     "environment": {...}, "ok": true, "exit_code": 0, "error": null, "result": {...}}

* ``ok`` is true exactly when ``exit_code`` is 0; ``error`` is then null, else the one line the CLI
  printed on stderr. A run that ended before it had anything to report (a bad file, a usage error)
  has ``result: null``; one that got as far as a report (validation failed, slower than allowed,
  drift) carries it.
* ``environment`` says what the numbers were measured on (versions, GPU), because timings and
  drift from different machines differ.

The schema, ``schemas/report.schema.json``, ships in the package (:func:`schema_path`,
:func:`load_schema`); its ``$defs`` hold each command's body. Fields may be added in a later version;
none is removed or renamed without bumping :data:`SCHEMA_VERSION` (1 was the diff-only layout).
NaN and Infinity are never written (they become null).
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

from onnxfuse.reports.files import clean_json
from onnxfuse import __version__

SCHEMA_VERSION = 2
COMMANDS = ("optimize", "diff", "bench")
#: File name of the report schema, in this package's ``schemas/`` folder.
SCHEMA_FILE = "report.schema.json"


def schema_path() -> Path:
    """Path of the report's JSON Schema, a data file of this package (``schemas/``)."""
    return Path(__file__).resolve().parent / "schemas" / SCHEMA_FILE


def load_schema() -> dict:
    """The report's JSON Schema as a dict (read through :mod:`importlib.resources`)."""
    return json.loads(files("onnxfuse.reports").joinpath("schemas", SCHEMA_FILE).read_text(encoding="utf-8"))


def _environment() -> dict:
    # start-up: the command line starts (and --help runs) without onnxfuse.runtime.env
    from onnxfuse.runtime.env import environment

    return environment()


def document(command: str, result: dict | None, *, exit_code: int = 0, error: str | None = None,
             environment: dict | None = None) -> dict:
    """The JSON-ready report of one run of ``command`` (strict JSON values: NaN/Inf → ``None``)."""
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}")

    return clean_json({
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "onnxfuse", "version": __version__},
        "command": command,
        "environment": environment if environment is not None else _environment(),
        "ok": exit_code == 0,
        "exit_code": int(exit_code),
        "error": error,
        "result": result,
    })


def failure_document(command: str, exc: BaseException, exit_code: int) -> dict:
    """The report of a run that ended before it had a result (the CLI's one-line error)."""
    return document(command, None, exit_code=exit_code, error=str(exc))
