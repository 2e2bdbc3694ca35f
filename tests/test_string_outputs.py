"""String outputs are compared exactly (equal or not), in optimize's validation and in diff. Was:
``internal error (ValueError: could not convert string to float)`` in both."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner
from onnx import TensorProto, helper

from onnxfuse.cli import main
from onnxfuse.runtime.compare import compare_arrays


def _model(path, shift: float = 0.0):
    """``text = Where(x + shift > 0, "positive", "negative")``, ``y = Relu(x)``: words, which no float
    parser accepts (numeric strings, such as Cast<string> makes, used to be compared as numbers)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    text = helper.make_tensor_value_info("text", TensorProto.STRING, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("Add", ["x", "shift"], ["xs"]),
             helper.make_node("Greater", ["xs", "zero"], ["positive"]),
             helper.make_node("Where", ["positive", "yes", "no"], ["text"]),
             helper.make_node("Relu", ["x"], ["y"])]
    inits = [helper.make_tensor("shift", TensorProto.FLOAT, [], [shift]),
             helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
             helper.make_tensor("yes", TensorProto.STRING, [], [b"positive"]),
             helper.make_tensor("no", TensorProto.STRING, [], [b"negative"])]
    g = helper.make_graph(nodes, "strings", [x], [text, y], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path.write_bytes(model.SerializeToString())
    return path


def test_optimize_validates_string_outputs(tmp_path):
    src = _model(tmp_path / "m.onnx")
    result = CliRunner().invoke(main, ["optimize", str(src), str(tmp_path / "o.onnx"), "--json",
                                       str(tmp_path / "r.json"), "--no-bench"])
    assert result.exit_code == 0, result.stderr
    rows = {r["name"]: r for r in json.loads((tmp_path / "r.json").read_text())["result"]["validation"]["outputs"]}
    assert rows["text"]["passed"] is True and rows["text"]["comparison"] == "exact"


def test_diff_reports_differing_strings_and_exits_3(tmp_path):
    a, b = _model(tmp_path / "a.onnx"), _model(tmp_path / "b.onnx", shift=100.0)
    result = CliRunner().invoke(main, ["diff", str(a), str(b), "--json", str(tmp_path / "d.json"), "--html",
                                       str(tmp_path / "d.html"), "--junit", str(tmp_path / "d.xml")])
    assert result.exit_code == 3, result.stderr
    assert "strings differ at" in result.stderr and "'negative' vs 'positive'" in result.stderr
    assert "internal error" not in result.stderr
    rows = {r["name"]: r for r in json.loads((tmp_path / "d.json").read_text())["result"]["outputs"]}
    assert rows["text"]["passed"] is False and 0 < rows["text"]["mismatch_fraction"] <= 1.0
    assert rows["y"]["passed"] is True


def test_diff_of_equal_strings_passes(tmp_path):
    a = _model(tmp_path / "a.onnx")
    result = CliRunner().invoke(main, ["diff", str(a), str(a), "--samples", "2", "--intermediates"])
    assert result.exit_code == 0, result.stderr


def test_compare_arrays_on_strings():
    ref = np.array([["a", "b"], ["c", "d"]], dtype=object)
    assert compare_arrays("t", ref, ref.copy()).passed
    c = compare_arrays("t", ref, np.array([["a", "b"], ["c", "x"]], dtype=object))
    assert not c.passed and c.mismatch_fraction == 0.25 and c.worst_index == [1, 1]
    assert c.error == "strings differ at 1 of 4 element(s); first at [1, 1]: 'd' vs 'x'"
    assert "shape mismatch" in compare_arrays("t", ref, ref[:1]).error
    assert "dtype mismatch" in compare_arrays("t", ref, np.zeros((2, 2), np.float32)).error
