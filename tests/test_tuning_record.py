"""Tuning records (issue 32): a decision measured where timing runs is written to the record, and a run
that cannot measure (a GPU-less CI runner) applies it, writing the same graph byte for byte. Timing is the
stand-in of tests/test_selection.py (latency a function of the graph); rewrites and validation are real."""

from __future__ import annotations

import json
from collections import Counter

import pytest

import onnxfuse
import onnxfuse.pipeline as pipeline
from helpers import load_testdata
from onnxfuse import tuning_record
from test_selection import ATTENTION, _fake_time

MODEL = "bert_tiny_sdpa_opset14"


def _measured_run(monkeypatch, path, cost):
    fake, calls = _fake_time(cost)
    monkeypatch.setattr(pipeline, "time_both", fake)
    monkeypatch.setattr(tuning_record, "measuring_device", lambda options: "Stand-in GPU")
    result = onnxfuse.optimize(load_testdata(MODEL), bench=True, samples=1, tuning_record=str(path))
    monkeypatch.undo()
    return result, calls


def test_a_gpu_decision_applied_without_a_gpu_gives_the_same_graph(monkeypatch, tmp_path):
    path = tmp_path / "tuning.json"
    measured, calls = _measured_run(monkeypatch, path, lambda ops: 1.5 if ATTENTION & set(ops) else 0.8)
    assert measured.extra["selection"]["kept"] == "fused attention" and len(calls) == 2
    info = measured.extra["tuning_record"]
    assert info["written"] and not info["matched"]
    doc = json.loads(path.read_text())
    (entry,) = doc["entries"].values()
    (decision,) = entry["decisions"]
    assert decision["gpu"] == "Stand-in GPU" and "contrib-attention" in decision["skipped_rules"]
    # the CI runner: no GPU, nothing timed; the record decides
    applied = onnxfuse.optimize(load_testdata(MODEL), bench=False, samples=1, tuning_record=str(path))
    info = applied.extra["tuning_record"]
    assert info["matched"] and info["gpu"] == "Stand-in GPU" and not info["written"]
    assert "applied the decision measured on Stand-in GPU" in info["note"]
    assert applied.validation.passed
    assert applied.model.SerializeToString() == measured.model.SerializeToString()
    assert not ATTENTION & set(Counter(n.op_type for n in applied.model.graph.node))
    # and without the record the runner writes the static default (attention fused): the record mattered
    default = onnxfuse.optimize(load_testdata(MODEL), bench=False, samples=1)
    assert ATTENTION & set(Counter(n.op_type for n in default.model.graph.node))


def test_a_not_slower_decision_keeps_every_rewrite(monkeypatch, tmp_path):
    path = tmp_path / "tuning.json"
    measured, _ = _measured_run(monkeypatch, path, lambda ops: 0.5)
    assert "selection" not in measured.extra
    (entry,) = json.loads(path.read_text())["entries"].values()
    assert entry["decisions"][0]["skipped_rules"] == [] and entry["decisions"][0]["kept"] is None
    applied = onnxfuse.optimize(load_testdata(MODEL), bench=False, samples=1, tuning_record=str(path))
    assert applied.extra["tuning_record"]["matched"]
    assert applied.model.SerializeToString() == measured.model.SerializeToString()


def test_another_model_or_other_options_do_not_match(monkeypatch, tmp_path):
    path = tmp_path / "tuning.json"
    _measured_run(monkeypatch, path, lambda ops: 1.5 if ATTENTION & set(ops) else 0.8)
    other = onnxfuse.optimize(load_testdata("roberta_tiny_sdpa_opset14"), bench=False, samples=1,
                              tuning_record=str(path))
    assert not other.extra["tuning_record"]["matched"]
    assert "static defaults apply" in other.extra["tuning_record"]["note"]
    skipped = onnxfuse.optimize(load_testdata(MODEL), bench=False, samples=1, skip=["contrib-gelu"],
                                tuning_record=str(path))
    assert not skipped.extra["tuning_record"]["matched"]


def test_a_file_that_is_not_a_record_is_refused_in_one_line(tmp_path):
    path = tmp_path / "notes.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(tuning_record.TuningRecordError, match="not an onnxfuse tuning record"):
        onnxfuse.optimize(load_testdata(MODEL), bench=False, samples=1, tuning_record=str(path))
    assert path.read_text() == '{"hello": 1}'  # never overwritten


def test_the_fingerprint_ignores_names_outside_the_graph_and_sees_a_weight_change():
    model = load_testdata(MODEL)
    base = tuning_record.fingerprint(model)
    model.producer_name, model.doc_string = "someone else", "re-saved"
    assert tuning_record.fingerprint(model) == base
    init = model.graph.initializer[0]
    init.raw_data = bytes(len(init.raw_data)) if init.raw_data else init.raw_data
    assert tuning_record.fingerprint(model) != base


def test_the_report_with_a_record_validates_against_the_schema(monkeypatch, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    from onnxfuse.reports import load_schema

    path = tmp_path / "tuning.json"
    measured, _ = _measured_run(monkeypatch, path, lambda ops: 1.5 if ATTENTION & set(ops) else 0.8)
    applied = onnxfuse.optimize(load_testdata(MODEL), bench=False, samples=1, tuning_record=str(path))
    for result in (measured, applied):
        jsonschema.validate(result.to_json(), load_schema(), cls=jsonschema.Draft202012Validator)


def test_markdown_and_junit_say_which_decision_was_applied(monkeypatch, tmp_path):
    """Decisions go in every report format (issue 32): the applied one is in the Markdown section and in
    the JUnit suite's output, where a CI log reader finds it."""
    from onnxfuse.reports.optimize_report import optimize_junit, optimize_markdown

    path = tmp_path / "tuning.json"
    _measured_run(monkeypatch, path, lambda ops: 1.5 if ATTENTION & set(ops) else 0.8)
    applied = onnxfuse.optimize(load_testdata(MODEL), bench=False, samples=1, tuning_record=str(path))
    assert "**tuning record**: tuning record" in optimize_markdown(applied)
    assert "applied the decision measured on Stand-in GPU" in optimize_markdown(applied)
    assert "<system-out>tuning record: tuning record" in optimize_junit(applied)
    plain = onnxfuse.optimize(load_testdata(MODEL), bench=False, samples=1)
    assert "tuning record" not in optimize_markdown(plain) + optimize_junit(plain)


def test_a_measured_choice_recorded_on_the_gpu_is_applied_without_one(monkeypatch, tmp_path):
    """Channels-last chosen by timing on the "GPU" (its model faster) is recorded as an added rule; the
    GPU-less run applies it, validates it on the CPU (NhwcConv as its definition) and writes the same
    bytes; without the record it writes the static default (NCHW)."""
    path = tmp_path / "tuning.json"
    fake, _ = _fake_time(lambda ops: 0.5 if ops["NhwcConv"] else 0.8)
    monkeypatch.setattr(pipeline, "time_both", fake)
    monkeypatch.setattr(tuning_record, "measuring_device", lambda options: "Stand-in GPU")
    measured = onnxfuse.optimize(load_testdata("yolo_conv_bn_silu_opset13"), bench=True, samples=1,
                                 tuning_record=str(path))
    monkeypatch.undo()
    assert measured.extra["measured"][0]["kept"]
    doc = json.loads(path.read_text())
    assert doc["version"] == tuning_record.VERSION == 2
    (entry,) = doc["entries"].values()
    assert entry["decisions"][0]["added_rules"] == ["contrib-channels-last"]
    applied = onnxfuse.optimize(load_testdata("yolo_conv_bn_silu_opset13"), bench=False, samples=1,
                                tuning_record=str(path))
    assert applied.extra["tuning_record"]["matched"] and applied.validation.passed
    assert "with contrib-channels-last" in applied.extra["tuning_record"]["note"]
    assert applied.model.SerializeToString() == measured.model.SerializeToString()
    assert "contrib-channels-last" in applied.rules and applied.rules == measured.rules  # the report's rules too
    jsonschema = pytest.importorskip("jsonschema")
    from onnxfuse.reports import load_schema

    for result in (measured, applied):
        jsonschema.validate(result.to_json(), load_schema(), cls=jsonschema.Draft202012Validator)
    default = onnxfuse.optimize(load_testdata("yolo_conv_bn_silu_opset13"), bench=False, samples=1)
    assert "NhwcConv" not in {n.op_type for n in default.model.graph.node}


def test_a_version_1_record_is_still_read(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"kind": tuning_record.KIND, "version": 1, "entries": {"k": {"decisions": [
        {"skipped_rules": [], "kept": None, "gpu": "G", "onnxruntime": "1.31.1", "device": "cuda",
         "measured": "2026-11-26T00:00:00Z"}]}}}))
    found = tuning_record.load(path).lookup("k", "G")
    assert found is not None and found.added_rules == []
    path.write_text(json.dumps({"kind": tuning_record.KIND, "version": 3, "entries": {}}))
    with pytest.raises(tuning_record.TuningRecordError, match="version 3"):
        tuning_record.load(path)


def test_the_tuned_sizes_are_part_of_the_key(monkeypatch, tmp_path):
    """A decision measured with --tune-shape is applied only to a run that names the same sizes (it
    decided on them); such a run on a GPU-less runner writes the GPU run's graph byte for byte."""
    from test_selection import _fake_time_by_size

    path = tmp_path / "tuning.json"
    sizes = [{"input_ids": [8, 16], "attention_mask": [8, 16]}]
    fake, calls = _fake_time_by_size(lambda ops, batch: 1.4 if ATTENTION & set(ops) and batch == 8 else 0.9)
    monkeypatch.setattr(pipeline, "time_both", fake)
    monkeypatch.setattr(tuning_record, "measuring_device", lambda options: "Stand-in GPU")
    measured = onnxfuse.optimize(load_testdata(MODEL), bench=True, samples=1, tuning_record=str(path),
                                 tune_shapes=sizes)
    monkeypatch.undo()
    assert measured.extra["selection"]["kept"] == "fused attention"
    (entry,) = json.loads(path.read_text())["entries"].values()
    assert entry["choices"]["tune_shapes"] == sizes
    plain = onnxfuse.optimize(load_testdata(MODEL), bench=False, samples=1, tuning_record=str(path))
    assert not plain.extra["tuning_record"]["matched"]
    applied = onnxfuse.optimize(load_testdata(MODEL), bench=False, samples=1, tuning_record=str(path),
                                tune_shapes=sizes)
    assert applied.extra["tuning_record"]["matched"]
    assert applied.model.SerializeToString() == measured.model.SerializeToString()


def test_a_measured_removal_is_recorded_and_applied(monkeypatch, tmp_path):
    """The float32 attention measured faster unfused (a measured choice, not the ladder): the record
    leaves contrib-attention out, and the GPU-less run writes the same bytes."""
    path = tmp_path / "tuning.json"
    measured, calls = _measured_run(monkeypatch, path, lambda ops: 0.8 if ATTENTION & set(ops) else 0.6)
    assert "selection" not in measured.extra and measured.extra["measured"][0]["kept"]
    (entry,) = json.loads(path.read_text())["entries"].values()
    (decision,) = entry["decisions"]
    assert decision["skipped_rules"] == ["contrib-attention"] and decision["added_rules"] == []
    assert decision["kept"] == "contrib-attention (measured choice)"
    applied = onnxfuse.optimize(load_testdata(MODEL), bench=False, samples=1, tuning_record=str(path))
    assert applied.extra["tuning_record"]["matched"]
    assert "without contrib-attention (measured choice)" in applied.extra["tuning_record"]["note"]
    assert applied.model.SerializeToString() == measured.model.SerializeToString()
