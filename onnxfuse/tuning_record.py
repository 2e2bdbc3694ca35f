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
from typing import Callable

import onnx

from onnxfuse.errors import OnnxfuseError
from onnxfuse.atomic import write_file_atomically
from onnxfuse.runtime.env import environment, gpu_names
from onnxfuse.selection import ALL

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


# --- a record in an optimize run: the decision applied before timing, the one recorded after -------------
# ``result`` is the run's OptimizeResult (its ``extra``, ``timing`` and ``model`` read and set here);
# ``fewer`` is the pipeline's candidate maker (the never-slower ladder's), ``adopt`` makes ``result``
# describe a candidate: both passed in, so this module never imports the pipeline above it.


def key_for(model, options, sample) -> tuple[str, dict]:
    """The tuning record's key for ``model`` under ``options`` (the run's OptimizeOptions) at ``sample``'s
    shapes, and what it hashes."""
    choices = {"target": options.target, "device": options.device, "only": options.only or [],
               "skip": options.skip or [], "precision": options.precision, "right_padded": list(options.right_padded)}
    if options.tune_shapes:  # only when given: records made without them keep their keys
        choices["tune_shapes"] = [{k: list(v) for k, v in size.items()} for size in options.tune_shapes]
    if options.tune_dims:
        choices["tune_dims"] = {k: list(v) for k, v in options.tune_dims.items()}
    shapes = {k: list(v) for k, v in sample.shapes().items()}
    return record_key(model, choices, shapes), {"model": fingerprint(model), "choices": choices, "shapes": shapes}


def measuring_device(options) -> str | None:
    """What a decision measured here is keyed by: ``cpu`` for ``--device cpu``, else the GPU's name; None
    where nothing can be measured (``--device cuda`` without a usable GPU)."""
    if options.device == "cpu":
        return "cpu"
    # start-up: it loads graphsurgeon, which importing this module does not
    from onnxfuse.timing import gpu_unavailable_reason

    if gpu_unavailable_reason():
        return None
    names = gpu_names()
    return names[0].split(",")[0].strip() if names else "CUDA GPU"


def apply_decision(result, model, samples, options, fewer: Callable, adopt: Callable):
    """``--tuning-record``: read the record; where it holds a decision for this model, options and shapes
    (measured on this GPU, or on any when none is usable here), apply it: the rules it left out are left
    out again (``fewer(skipped, added=...)``: the candidate validated as the first model was, or why it
    cannot be kept), the rules it added are added, and ``adopt(model, applied, validation, added)`` makes
    ``result`` describe that candidate. Returns ((record, key, what the key hashes, the device measuring
    here), the decision applied or None); the report's ``tuning_record`` says which."""
    record = load(options.tuning_record)
    key, meta = key_for(model, options, samples[0])
    here = measuring_device(options)
    decision = record.lookup(key, here)
    info = {"path": str(record.path), "key": key, "matched": decision is not None, "written": False}
    result.extra["tuning_record"] = info
    pending = (record, key, meta, here)
    if decision is None:
        where = "on this device" if here else "anywhere (no decision for this model, options and shapes)"
        info["note"] = (f"tuning record {record.path}: nothing measured {where}" +
                        ("; measured now and recorded" if here and options.bench else
                         "; the rules' static defaults apply"))
        return pending, None
    info.update({"gpu": decision.gpu, "onnxruntime": decision.onnxruntime, "skipped_rules": decision.skipped_rules,
                 "kept": decision.kept, "measured": decision.measured, "added_rules": decision.added_rules})

    skipped = ALL if decision.skipped_rules == sorted(ALL) else frozenset(decision.skipped_rules)
    added = tuple(decision.added_rules)
    where = decision.gpu or "an unnamed device"
    if skipped or added:
        made = fewer(skipped, added=added)
        if isinstance(made, str):
            what = ", ".join([f"leave out {', '.join(sorted(skipped))}"] * bool(skipped) +
                             [f"add {', '.join(added)}"] * bool(added))
            info["note"] = (f"tuning record {record.path}: its decision (measured on {where}) to {what} "
                            f"was not applied: {made}")
            return pending, decision
        adopt(*made, added)
    info["note"] = (f"tuning record {record.path}: applied the decision measured on {where} "
                    f"(ONNX Runtime {decision.onnxruntime or '?'}, {decision.measured or '?'}): "
                    + (f"without {decision.kept}" if skipped else "every rewrite kept")
                    + (f", with {', '.join(added)}" if added else ""))
    return pending, decision


def record_decision(result, record: TuningRecord, key: str, meta: dict, here: str | None) -> None:
    """After timing without a matching decision: what was kept (the never-slower ladder's choice, or every
    rewrite) becomes the record's decision for this model on this device; nothing when timing did not
    measure."""
    timing = result.timing
    if here is None or timing is None or timing.status != "ok":
        return
    selection = result.extra.get("selection")
    skipped = sorted(next((set(t["skipped_rules"]) for t in selection["tried"] if t["candidate"] == selection["kept"]),
                          set())) if selection else []
    trials = result.extra.get("measured", [])
    removed = [t["rule"] for t in trials if t["kept"] and t.get("change") == "remove"]
    kept = selection["kept"] if selection else None
    if removed:  # a measured choice took rules away (the ladder did not run: it runs first, and only when slower)
        skipped = sorted(set(skipped) | set(removed))
        kept = ", ".join(removed) + " (measured choice)"
    decision = Decision(
        skipped_rules=skipped, kept=kept, gpu=here,
        onnxruntime=environment(timing.device).get("onnxruntime"), device=timing.device,
        original_ms=round(timing.original.stats.median_ms, 6), optimized_ms=round(timing.optimized.stats.median_ms, 6),
        measured=today(),
        added_rules=[t["rule"] for t in trials if t["kept"] and t.get("change", "add") == "add"])
    record.store(key, meta, decision)
    record.save()
    result.extra["tuning_record"]["written"] = True


__all__ = ["Decision", "TuningRecord", "TuningRecordError", "apply_decision", "fingerprint", "key_for", "load",
           "measuring_device", "record_decision", "record_key"]
