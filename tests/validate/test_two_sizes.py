"""Every dynamic dimension is validated at a second size, each dimension name on a size of its own where
the original allows it (a rewrite that confuses two names is caught, and the rule is named), and
dimensions that share a name, which the model declares equal, on one size."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxfuse
from helpers import run_ort
from onnxfuse.runtime.inputs import make_samples, second_size_candidates


def _reshape_by_other_input(x_dim="N", y_dim="N") -> onnx.ModelProto:
    # y2 = Reshape(y, [Shape(x)[0], -1]): x and y declare their first dimensions x_dim and y_dim.
    nodes = [
        h.make_node("Shape", ["x"], ["s"]),
        h.make_node("Gather", ["s", "i0"], ["n"], axis=0),
        h.make_node("Unsqueeze", ["n", "ax"], ["n1"]),
        h.make_node("Concat", ["n1", "minus1"], ["target"], axis=0),
        h.make_node("Reshape", ["y", "target"], ["out"]),
    ]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "i0"), numpy_helper.from_array(np.array([0], np.int64), "ax"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus1")]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [x_dim, 4]),
                                  h.make_tensor_value_info("y", T.FLOAT, [y_dim, 6])],
                     [h.make_tensor_value_info("out", T.FLOAT, [x_dim, None])], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_a_copy_by_a_shared_name_holds_within_the_declaration():
    """x and y both declare N: constant-reshape-target copies y's first dimension instead of reading x's
    (the same size by the model's declaration), validation keeps the two N equal at the second size
    too, and the output equals the original's on inputs that keep the declaration."""
    model = _reshape_by_other_input()
    result = onnxfuse.optimize(model, target="onnx")
    assert result.validation.passed and result.applied.counts["constant-reshape-target"] == 1
    assert any("each dimension name on its own size" in n for n in result.validation.notes), result.validation.notes
    x, y = np.zeros((3, 4), np.float32), np.arange(18, dtype=np.float32).reshape(3, 6)
    np.testing.assert_array_equal(run_ort(result.model, {"x": x, "y": y})["out"], run_ort(model, {"x": x, "y": y})["out"])


def test_distinct_names_get_distinct_sizes_and_shared_names_one():
    g = h.make_graph([h.make_node("Identity", [n], [f"{n}_out"]) for n in "xyzw"], "g",
                     [h.make_tensor_value_info("x", T.FLOAT, ["N", 4]), h.make_tensor_value_info("y", T.FLOAT, ["N", "M"]),
                      h.make_tensor_value_info("z", T.FLOAT, ["M", 3]), h.make_tensor_value_info("w", T.FLOAT, [None, None])],
                     [h.make_tensor_value_info(f"{n}_out", T.FLOAT, None) for n in "xyzw"])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    first = make_samples(model, None, 0, None, None, 1, 1)[0]
    own, larger = second_size_candidates(model, first)
    shapes = {k: v.shape for k, v in own.feeds.items()}
    n, m = shapes["x"][0], shapes["z"][0]
    assert shapes["y"] == (n, m) and n != m  # a name keeps its size across inputs; two names differ
    assert len({n, m, *shapes["w"]}) == 4  # and every unnamed dimension has a size of its own
    assert all(d == 2 for k, v in larger.feeds.items() for d, s in zip(v.shape, model.graph.input[
        "xyzw".index(k)].type.tensor_type.shape.dim) if not s.dim_value)


def test_a_copy_across_two_names_is_not_made():
    """x's N and y's M are different names: constant-reshape-target leaves the Shape read (and the original
    and optimized models agree at the second size, where N and M differ)."""
    model = _reshape_by_other_input("N", "M")
    result = onnxfuse.optimize(model, target="onnx")
    assert result.validation.passed and result.applied.counts.get("constant-reshape-target", 0) == 0


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
