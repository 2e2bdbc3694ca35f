"""Range(0, dim, 1)'s length (onnxfuse.rewrites.facts.range_dims), which ONNX shape inference leaves an invented symbol."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from onnxfuse.model_io import infer_shapes


def range_model(start=0, delta=1, cast_to=T.INT64, index=0, constant_nodes=False):
    """idx = Unsqueeze(Range(start, Cast(Gather(Shape(x), index)), delta), 1) + arange(4): transformers 5's
    batch index grid. ``constant_nodes``: start, delta and index as ``Constant(value_int=...)`` nodes."""
    inits = [numpy_helper.from_array(np.array(index, np.int64), "index"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1"),
             numpy_helper.from_array(np.arange(4, dtype=np.int64)[None, :], "cols")]
    if constant_nodes:
        consts = [h.make_node("Constant", [], ["start"], value_int=start),
                  h.make_node("Constant", [], ["delta"], value_int=delta)]
    else:
        consts = []
        inits += [numpy_helper.from_array(np.array(start, np.int64), "start"),
                  numpy_helper.from_array(np.array(delta, np.int64), "delta")]
    nodes = consts + [h.make_node("Shape", ["x"], ["shape"]),
             h.make_node("Gather", ["shape", "index"], ["n"], axis=0),
             h.make_node("Cast", ["n"], ["limit"], to=cast_to),
             h.make_node("Range", ["start", "limit", "delta"], ["rows"]),
             h.make_node("Unsqueeze", ["rows", "axis1"], ["rows2"]),
             h.make_node("Add", ["rows2", "cols"], ["grid"])]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["batch", 4])],
                         [h.make_tensor_value_info("grid", T.INT64, None)], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def dims_of(model, name):
    for vi in list(model.graph.value_info) + list(model.graph.output):
        if vi.name == name:
            return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
    return None


@pytest.mark.parametrize("constant_nodes", [False, True])
def test_a_range_over_a_dimension_has_that_length_downstream(constant_nodes):
    inferred = infer_shapes(range_model(constant_nodes=constant_nodes))
    assert dims_of(inferred, "rows") == ["batch"]
    assert dims_of(inferred, "grid") == ["batch", 4]  # reached through Unsqueeze and a broadcast Add


def test_a_range_over_a_static_dimension_gets_the_number():
    inferred = infer_shapes(range_model(index=-1))  # Gather(Shape(x), -1) = 4
    assert dims_of(inferred, "rows") == [4]


@pytest.mark.parametrize("kwargs", [dict(start=1), dict(delta=2)])
def test_other_ranges_keep_the_symbol_inference_gave(kwargs):
    """Range(1, n, 1) has n - 1 elements, Range(0, n, 2) ceil(n / 2): neither is the dimension."""
    inferred = infer_shapes(range_model(**kwargs))
    rows = dims_of(inferred, "rows")
    assert rows is not None and len(rows) == 1 and rows[0] != "batch"
