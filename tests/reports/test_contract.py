"""The one JSON contract: optimize, diff and bench write the same top level (schema version, tool,
command, environment, ok / exit_code / error) with their own body under `result`, valid against the
schema shipped in the package, to a file or to stdout (`--json -`), on success and on failure."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from helpers import BreakConvWeights, conv_bn_model
from onnxfuse.cli import main
from onnxfuse.reports import load_schema, schema_path
from onnxfuse.reports.contract import SCHEMA_VERSION, document
from onnxfuse.rewrites import RULES

jsonschema = pytest.importorskip("jsonschema")
TESTDATA = Path(__file__).resolve().parents[2] / "testdata"


def check(doc: dict, command: str, exit_code: int) -> dict:
    jsonschema.validate(doc, load_schema(), cls=jsonschema.Draft202012Validator)
    assert doc["schema_version"] == SCHEMA_VERSION and doc["command"] == command
    assert doc["tool"]["name"] == "onnxfuse" and doc["environment"]["python"]
    assert doc["exit_code"] == exit_code and doc["ok"] is (exit_code == 0)
    assert (doc["error"] is None) is (exit_code == 0)
    return doc


def run(args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_schema_is_package_data_and_a_valid_schema():
    import onnxfuse.reports

    assert Path(onnxfuse.reports.__file__).resolve().parent in schema_path().parents
    assert load_schema() == json.loads(schema_path().read_text())
    jsonschema.Draft202012Validator.check_schema(load_schema())


def test_schema_rejects_documents_that_break_the_contract():
    good = document("diff", None, exit_code=1, error="boom", environment={
        "onnxfuse": "0", "python": "3", "platform": "x", "onnxruntime": None})
    jsonschema.validate(good, load_schema(), cls=jsonschema.Draft202012Validator)
    for bad in ({**good, "ok": True},  # ok with a non-zero exit code
                {**good, "error": None},  # a failure without its line
                {**good, "command": "rules"},
                {**good, "schema_version": 1},
                {**good, "exit_code": 0, "ok": True, "error": None, "result": {"passed": True}}):  # diff body incomplete
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, load_schema(), cls=jsonschema.Draft202012Validator)


def test_optimize_json_success_validation_failure_and_bad_input(tmp_path, monkeypatch):
    model = tmp_path / "m.onnx"
    import onnx

    onnx.save(conv_bn_model(), str(model))
    r = run(["optimize", model, tmp_path / "o.onnx", "--json", tmp_path / "ok.json", "-q"])
    assert r.exit_code == 0, r.output
    doc = check(json.loads((tmp_path / "ok.json").read_text()), "optimize", 0)
    assert doc["result"]["culprit"] is None and doc["result"]["validation"]["passed"] is True

    monkeypatch.setattr("onnxfuse.rewrites.RULES", RULES + [BreakConvWeights()])
    r = run(["optimize", model, tmp_path / "o2.onnx", "--target", "onnx", "--json", tmp_path / "f.json", "-q"])
    assert r.exit_code == 3
    doc = check(json.loads((tmp_path / "f.json").read_text()), "optimize", 3)
    assert doc["result"]["culprit"] == "test-break-conv" and doc["error"] in r.stderr

    r = run(["optimize", tmp_path / "missing.onnx", tmp_path / "o3.onnx", "--json", tmp_path / "e.json"])
    assert r.exit_code == 1
    doc = check(json.loads((tmp_path / "e.json").read_text()), "optimize", 1)
    assert doc["result"] is None and doc["error"] in r.stderr


def test_json_to_stdout_carries_only_the_document(tmp_path):
    model = TESTDATA / "conv_bn_relu.onnx"
    r = run(["optimize", model, tmp_path / "o.onnx", "--json", "-"])
    assert r.exit_code == 0, r.output
    doc = check(json.loads(r.stdout), "optimize", 0)  # stdout parses as one JSON document
    assert "Nodes by op type" in r.stderr  # the tables moved to stderr
    assert doc["result"]["output"] == str(tmp_path / "o.onnx")
    assert not (Path.cwd() / "-").exists()

    r = run(["diff", model, tmp_path / "o.onnx", "--json", "-", "-q"])
    assert r.exit_code == 0, r.output
    check(json.loads(r.stdout), "diff", 0)

    r = run(["diff", model, tmp_path / "nope.onnx", "--json", "-"])
    assert r.exit_code == 1
    doc = check(json.loads(r.stdout), "diff", 1)
    assert doc["result"] is None and "nope.onnx" in doc["error"]


def test_diff_json_drift_is_exit_3_with_the_one_line(tmp_path):
    import onnx
    from onnx import numpy_helper

    a = TESTDATA / "conv_bn_relu.onnx"
    m = onnx.load(str(a))
    w = m.graph.initializer[0]
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * np.float32(1.5), w.name))
    b = tmp_path / "b.onnx"
    onnx.save(m, str(b))
    r = run(["diff", a, b, "--json", tmp_path / "d.json", "-q"])
    assert r.exit_code == 3
    doc = check(json.loads((tmp_path / "d.json").read_text()), "diff", 3)
    assert doc["result"]["passed"] is False and doc["error"] in r.stderr


def test_bench_json_on_the_cpu_and_to_stdout(tmp_path):
    model = TESTDATA / "conv_bn_relu.onnx"
    r = run(["bench", model, model, "--device", "cpu", "--iterations", "5", "--warmup", "1",
             "--json", tmp_path / "b.json", "-q"])
    assert r.exit_code == 0, r.output
    doc = check(json.loads((tmp_path / "b.json").read_text()), "bench", 0)
    assert len(doc["result"]["models"]) == 2 and doc["result"]["speedup"] > 0
    assert doc["environment"]["device"] == "cpu"

    r = run(["bench", model, "--device", "cpu", "--iterations", "5", "--warmup", "1", "--json", "-"])
    assert r.exit_code == 0, r.output
    check(json.loads(r.stdout), "bench", 0)
    assert "Latency" in r.stderr

    r = run(["bench", tmp_path / "missing.onnx", "--device", "cpu", "--json", tmp_path / "e.json"])
    assert r.exit_code == 1
    doc = check(json.loads((tmp_path / "e.json").read_text()), "bench", 1)
    assert doc["result"] is None


def test_bench_table_keeps_its_speedup_column_at_80_columns(monkeypatch):
    """Before, the bench table's last column (speed-up) was squeezed to nothing in an 80-column log."""
    from onnxfuse.cli.common import stdout

    monkeypatch.setattr(stdout, "_width", 80)
    model = TESTDATA / "conv_bn_relu.onnx"
    r = run(["bench", model, TESTDATA / "conv1d_bn.onnx", "--device", "cpu", "--iterations", "5", "--warmup", "1"])
    assert r.exit_code == 0, r.output
    assert "speed-up" in r.stdout and "1.00×" in r.stdout
    assert all(len(line) <= 80 for line in r.stdout.splitlines())
