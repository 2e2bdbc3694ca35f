"""The default output says which decomposed patterns that have a fused form stayed unfused, with the
count and the most frequent reason (issue 30, item 5)."""

from __future__ import annotations

import json

from click.testing import CliRunner

import onnxfuse
from helpers import TESTDATA
from onnxfuse.cli import main
from onnxfuse.unfused import Unfused, unfused_patterns
from onnxfuse.rewrites import Refusal


def test_rows_count_surviving_anchors_once_with_the_top_reason():
    refusals = [
        Refusal("contrib-attention", "sm0", "float32 over 'k0' is slow"),
        Refusal("contrib-attention", "sm0", "another pass, another reason"),  # counted once, first reason
        Refusal("contrib-attention", "sm1", "float32 over 'k1' is slow"),
        Refusal("contrib-attention", "sm2", "mask 'm' is not a keep mask"),
        Refusal("contrib-attention", "gone", "float32 over 'k' is slow"),  # fused later: not in the output
        Refusal("contrib-gelu", "erf0", "not GELU"),
        Refusal("contrib-gelu", "erf1", "not GELU"),  # now inside a FusedElementwise: not counted
        Refusal("fuse-elementwise", "sm1", "not elementwise"),  # a rule without a fused form of its own
    ]
    ops = {"sm0": "Softmax", "sm1": "Softmax", "sm2": "Softmax", "erf0": "Erf", "erf1": "FusedElementwise"}
    rows = unfused_patterns(refusals, ops)
    assert rows == [Unfused("contrib-attention", "Softmax", 3, "float32 over <name> is slow", 2),
                    Unfused("contrib-gelu", "Erf", 1, "not GELU", 1)]


def test_float32_llama_reports_its_softmax_left_unfused():
    # without repeat-heads-gather the float32 cache is not read as one (policy.cache_key): left, as measured
    result = onnxfuse.optimize(str(TESTDATA / "llama_kv_opset14.onnx"), validate=False, bench=False,
                               skip="repeat-heads-gather")
    softmax_left = sum(1 for n in result.model.graph.node if n.op_type == "Softmax")
    (row,) = [u for u in result.unfused if u.op == "Softmax"]
    assert row.rule == "contrib-attention" and row.count == softmax_left == 2
    assert "float32 attention over given" in row.reason and row.reason_count == 2
    assert result.to_dict()["unfused"][0]["count"] == 2


def test_fully_fused_model_reports_nothing():
    result = onnxfuse.optimize(str(TESTDATA / "bert_tiny_opset14.onnx"), validate=False, bench=False)
    assert not any(n.op_type == "Softmax" for n in result.model.graph.node)
    assert result.unfused == []


def test_cli_prints_it_by_default_and_writes_it_to_json(tmp_path):
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    res = CliRunner().invoke(main, ["optimize", str(TESTDATA / "llama_kv_opset14.onnx"), str(out), "--no-bench",
                                    "--no-validate", "--json", str(report), "--skip", "repeat-heads-gather"],
                            catch_exceptions=False)
    assert res.exit_code == 0, res.stderr
    assert "not fused: 2 Softmax left by contrib-attention" in " ".join(res.stdout.split())
    rows = json.loads(report.read_text())["result"]["unfused"]
    assert rows[0]["op"] == "Softmax" and rows[0]["count"] == 2
    quiet = CliRunner().invoke(main, ["optimize", str(TESTDATA / "llama_kv_opset14.onnx"), str(out), "--no-bench",
                                      "--no-validate", "-q"], catch_exceptions=False)
    assert quiet.exit_code == 0 and "not fused" not in quiet.stdout


def test_reason_pattern_folds_quoted_names_not_apostrophes():
    from onnxfuse.unfused import reason_pattern

    assert reason_pattern("tensor 'a/b:0' is read by 'c'") == "tensor <name> is read by <name>"
    assert reason_pattern("the Softmax's guard; the fused op's rows 'x'") == "the Softmax's guard; the fused op's rows <name>"


def test_a_lone_rmsnorm_left_unfused_is_reported_with_the_opset_reason():
    """An RMSNorm at opset 12 beside a Split with sizes (an attribute until 13, an input since): the raise
    to 23 is not exact, so the norm stays decomposed, and the report says why."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    c = lambda name, v: numpy_helper.from_array(np.array(v, np.float32), name)  # noqa: E731
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["rt"]),
             helper.make_node("Div", ["x", "rt"], ["y"]),
             helper.make_node("Split", ["x"], ["left", "right"], axis=-1, split=[3, 5])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8]),
                               helper.make_tensor_value_info("left", TensorProto.FLOAT, [2, 3]),
                               helper.make_tensor_value_info("right", TensorProto.FLOAT, [2, 5])],
                              [c("two", 2.0), c("eps", 1e-6)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    result = onnxfuse.optimize(model, validate=False, bench=False, target="contrib")
    (row,) = [u for u in result.unfused if u.rule == "contrib-rmsnorm"]
    assert row.op == "ReduceMean" and row.count == 1 and "RMSNormalization needs opset 23" in row.reason
    assert "Split" in row.reason


def test_a_node_two_rules_refused_counts_once_for_the_first_listed():
    refusals = [Refusal("contrib-rmsnorm", "var", "not the last axis only"),
                Refusal("contrib-layernorm", "var", "axes [2] are not the trailing axes")]
    rows = unfused_patterns(refusals, {"var": "ReduceMean"})
    assert rows == [Unfused("contrib-layernorm", "ReduceMean", 1, "axes [2] are not the trailing axes", 1)]
