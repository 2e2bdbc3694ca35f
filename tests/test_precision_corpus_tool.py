"""tools/precision_corpus_check.py, the check behind docs/benchmarks.md 5.53: each model's outcome under a
precision change, counted, and a finding (a crash, an ill-typed output, onnxfuse's internal error) failing it."""

from __future__ import annotations

import importlib.util

import onnx
from onnx import TensorProto as T
from onnx import helper as h

from helpers import ROOT

spec = importlib.util.spec_from_file_location("precision_corpus_check", ROOT / "tools" / "precision_corpus_check.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def _model(opset: int) -> onnx.ModelProto:
    graph = h.make_graph([h.make_node("Relu", ["x"], ["y"]), h.make_node("Neg", ["y"], ["z"])], "g",
                         [h.make_tensor_value_info("x", T.FLOAT, [2, 3])], [h.make_tensor_value_info("z", T.FLOAT, [2, 3])])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)], ir_version=7)


def test_each_model_is_counted_by_outcome_and_a_clean_run_passes(tmp_path, capsys):
    onnx.save(_model(17), str(tmp_path / "new.onnx"))
    onnx.save(_model(12), str(tmp_path / "old.onnx"))  # bf16 below opset 13: refused in one line
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    assert tool.main([str(tmp_path), "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "| ok | 1 |" in out and "| refused (PrecisionError) | 1 |" in out and "| not loadable | 1 |" in out
    assert tool.main([str(tmp_path), "--precision", "fp16"]) == 0
    assert "| ok | 2 |" in capsys.readouterr().out


def test_a_crash_is_a_finding_that_fails_the_check(tmp_path, capsys, monkeypatch):
    import onnxfuse

    onnx.save(_model(17), str(tmp_path / "m.onnx"))

    def crash(*args, **kwargs):
        raise ValueError("planted")

    monkeypatch.setattr(onnxfuse, "optimize", crash)
    assert tool.main([str(tmp_path), "--precision", "fp16"]) == 1
    out = capsys.readouterr().out
    assert "crash" in out and "m.onnx: ValueError: planted" in out and "| crash | 1 |" in out
