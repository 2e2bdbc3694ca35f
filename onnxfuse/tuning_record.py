"""A tuning record: the never-slower decisions measured on a GPU, for a GPU-less CI runner to apply.

Why: which rewrites pay is measured on the GPU the model is for (:mod:`onnxfuse.selection`: a model timed
slower falls back to fewer rewrites). A CI runner without that GPU cannot measure, so it would write the
rules' static default, which may be the slower graph. ``optimize --tuning-record FILE`` on the GPU writes
each decision to FILE; the same command on the runner reads it and applies the decision, so the runner
writes the graph the GPU run wrote, byte for byte (rewrites are deterministic), and the report says
which decision it applied and where it was measured (issue 32).

What a decision is keyed by: the model's fingerprint (:func:`fingerprint`: its nodes, initializers and
opsets, not its file name), the options that choose rewrites (target, device, only, skip, precision,
right-padded inputs) and the input shapes it was timed at. One key holds a decision per GPU (name and
ONNX Runtime version recorded with it): on a machine with a GPU only that GPU's decision matches, and a
missing one is measured and added; without one, the most recently measured decision for the key
applies, and the note names its GPU.

What is recorded: the rules left out (none when the optimized model was not slower; ``*`` for every
rewrite, the graph as loaded), what the kept candidate was called, the measured choices kept on top
(``added_rules``: opt-in rules a timing chose, ``selection.MEASURED``), and both medians. New measured
choices add fields, and ``version`` changes when an old reader could misapply them: version 2 added
``added_rules`` (a version-1 reader would have written the graph without them); version 1 files are
still read (they hold no added rule).

File: JSON, written atomically; a file that is not a tuning record is refused in one line (exit 1), never
overwritten.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from onnxfuse.errors import OnnxfuseError

#: the record format's version: a reader refuses a newer one (:data:`READS` lists what it reads)
VERSION = 2
READS = (1, 2)
KIND = "onnxfuse-tuning-record"


class TuningRecordError(OnnxfuseError):
    """The tuning record file cannot be read as one (exit 1, one line)."""


def fingerprint(model: onnx.ModelProto) -> str:
    """A hash of what the model computes: its opsets, graph inputs and outputs, nodes and initializers
    (each serialized deterministically; an external-data initializer by its location, as the model holds
    it). The file name, producer and doc strings are left out: a re-saved model keeps its decisions."""
    h = hashlib.sha256()
    for opset in sorted((o.domain, o.version) for o in model.opset_import):
        h.update(repr(opset).encode())
    graph = model.graph
    for part in (graph.input, graph.output, graph.node, graph.initializer, graph.sparse_initializer):
        for item in part:
            h.update(item.SerializeToString(deterministic=True))
    return h.hexdigest()


def record_key(model: onnx.ModelProto, choices: dict, shapes: dict) -> str:
    """The key of a decision: the model's :func:`fingerprint`, the rewrite ``choices`` and the timed
    ``shapes``, hashed together (a short, stable string)."""
    text = json.dumps({"model": fingerprint(model), "choices": choices, "shapes": shapes}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass
class Decision:
    """One measured decision: the rules left out (``["*"]``: every rewrite), the measured choices added, and
    where it was measured."""

    skipped_rules: list
    kept: str | None
    gpu: str | None
    onnxruntime: str | None
    device: str
    original_ms: float | None = None
    optimized_ms: float | None = None
    measured: str = ""  # UTC date
    added_rules: list = field(default_factory=list)  # version 2: measured choices kept on top

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class TuningRecord:
    path: Path
    entries: dict  # key -> {"model": fingerprint, "choices": ..., "shapes": ..., "decisions": [Decision dicts]}

    def lookup(self, key: str, gpu: str | None) -> Decision | None:
        """The decision for ``key`` measured on ``gpu``; with ``gpu`` None (no GPU here), the most
        recently measured one for the key, whatever its GPU."""
        decisions = self.entries.get(key, {}).get("decisions", [])
        if gpu is not None:
            decisions = [d for d in decisions if d.get("gpu") == gpu]
        if not decisions:
            return None
        latest = max(decisions, key=lambda d: d.get("measured", ""))
        found = Decision(**{k: latest.get(k) for k in Decision.__dataclass_fields__})
        found.added_rules = list(found.added_rules or [])  # version 1: none
        return found

    def store(self, key: str, meta: dict, decision: Decision) -> None:
        """Record ``decision`` for ``key`` (replacing the one measured on the same GPU)."""
        entry = self.entries.setdefault(key, {**meta, "decisions": []})
        entry["decisions"] = [d for d in entry["decisions"] if d.get("gpu") != decision.gpu] + [decision.to_dict()]

    def save(self) -> Path:
        from onnxfuse.atomic import write_file_atomically

        text = json.dumps({"kind": KIND, "version": VERSION, "entries": self.entries}, indent=1, sort_keys=True)
        return write_file_atomically(self.path, text + "\n", what="tuning record")


def load(path) -> TuningRecord:
    """The record at ``path`` (empty when the file does not exist yet)."""
    path = Path(path)
    if not path.exists():
        return TuningRecord(path, {})
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TuningRecordError(f"{path}: cannot read it as a tuning record ({type(exc).__name__}: {exc})") from None
    if not isinstance(doc, dict) or doc.get("kind") != KIND or not isinstance(doc.get("entries"), dict):
        raise TuningRecordError(f"{path}: not an onnxfuse tuning record (no \"kind\": \"{KIND}\"); "
                                "give a new file name to start one")
    if doc.get("version") not in READS:
        raise TuningRecordError(f"{path}: tuning record version {doc.get('version')!r}, this onnxfuse reads "
                                f"version {VERSION}; measure again into a new file")
    return TuningRecord(path, doc["entries"])


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


__all__ = ["Decision", "TuningRecord", "TuningRecordError", "fingerprint", "load", "record_key"]
