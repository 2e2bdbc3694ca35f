"""Every dynamic dimension is validated at a second size, each (input, dimension) on its own size
where the original allows it: a rewrite that relies on two inputs' shared symbolic name (ONNX Runtime
does not enforce it) is caught, and the rule is named."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxfuse
from onnxfuse.errors import ValidationFailed
from helpers import run_ort


def _reshape_by_other_input() -> onnx.ModelProto:
    # y2 = Reshape(y, [Shape(x)[0], -1]): x and y both declare their first dimension "N".
    nodes = [
        h.make_node("Shape", ["x"], ["s"]),
        h.make_node("Gather", ["s", "i0"], ["n"], axis=0),
        h.make_node("Unsqueeze", ["n", "ax"], ["n1"]),
        h.make_node("Concat", ["n1", "minus1"], ["target"], axis=0),
        h.make_node("Reshape", ["y", "target"], ["out"]),
    ]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "i0"), numpy_helper.from_array(np.array([0], np.int64), "ax"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus1")]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["N", 4]),
                                  h.make_tensor_value_info("y", T.FLOAT, ["N", 6])],
                     [h.make_tensor_value_info("out", T.FLOAT, ["N", None])], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_shared_symbol_assumption_is_caught_at_the_second_size():
    model = _reshape_by_other_input()
    # What a caller may do: ONNX Runtime runs the original with different sizes for the two N's.
    x, y = np.zeros((2, 4), np.float32), np.arange(18, dtype=np.float32).reshape(3, 6)
    assert run_ort(model, {"x": x, "y": y})["out"].shape == (2, 9)
    with pytest.raises(ValidationFailed) as err:
        onnxfuse.optimize(model, target="onnx")
    assert err.value.culprit == "constant-reshape-target"


def test_second_size_is_reported_and_can_be_refused_by_the_model():
    from helpers import TESTDATA

    result = onnxfuse.optimize(onnx.load(TESTDATA / "conv_bn_relu.onnx"), target="onnx")
    assert any(n.startswith("second size") for n in result.validation.notes), result.validation.notes
    # A model that only runs at one size is validated there, with a note.
    g = h.make_graph([h.make_node("Reshape", ["x", "shape"], ["y"])], "g",
                     [h.make_tensor_value_info("x", T.FLOAT, ["N", 4])], [h.make_tensor_value_info("y", T.FLOAT, [4])],
                     [numpy_helper.from_array(np.array([4], np.int64), "shape")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    result = onnxfuse.optimize(m, target="onnx")
    assert result.validation.passed
    assert any("validated at one size only" in n for n in result.validation.notes)


def test_the_original_runs_every_draw_in_one_session(monkeypatch):
    """The reference draws and the second size run on one session of the original (graph optimizations
    off): creating a session is most of validation's time on large models (docs/benchmarks.md 5.23)."""
    from helpers import TESTDATA
    from onnxfuse.runtime import session

    made = []
    real = session.make_session

    def counting(model, provider="auto", optimization="disable", **kwargs):
        made.append((len(model.graph.node), optimization))
        return real(model, provider=provider, optimization=optimization, **kwargs)

    monkeypatch.setattr(session, "make_session", counting)
    model = onnx.load(TESTDATA / "conv_bn_relu.onnx")
    result = onnxfuse.optimize(model, target="onnx", provider="cpu")
    assert any(n.startswith("second size") for n in result.validation.notes)
    assert len(result.validation.outputs) == 1 and result.validation.passed
    original = len(model.graph.node)
    assert made.count((original, "disable")) == 1, made  # was 2: the reference run, then the second size
