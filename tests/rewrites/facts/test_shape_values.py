"""``facts/shape_values.axis_length``: lengths proved from how tensors are made, a KV-cache decoder's mask
grid (``Range(0, past + S)``) against its key (``Concat(past, new)``) term by term, never from a declared
name that reads like a sum; and ``whole_slice``, the Slice that cuts a mask to a length it
already has (optimum's transformers 4.57 export: tests/rewrites/contrib/test_optimum_kv_cache.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from onnxfuse.model_io import to_graph
from onnxfuse.rewrites.facts.shape_values import whole_slice
from onnxfuse.rewrites.facts.shape_values import DimSum, axis_length, same_length


def _const(name, values):
    return h.make_node("Constant", [], [name], name=name,
                       value=onnx.numpy_helper.from_array(np.array(values, np.int64)))


def _graph(extra: int = 0, slice_from: str = "key"):
    """past [B, 2, P, 4], new [B, 2, S, 4]: key = Concat(past, new) along 2; the grid Range(0, P + S +
    ``extra``) unsqueezed to [1, 1, 1, ·], anded with a padding mask [B, 1, 1, T] (its own declared
    length T: not provably the key's), and that grid cut by Slice(·, 0, Shape(``slice_from``)[2], axis 3).
    The key is declared ``"P + S"``, a name that only reads like the sum."""
    nodes = [
        h.make_node("Concat", ["past", "new"], ["key"], axis=2, name="concat"),
        h.make_node("Shape", ["past"], ["past_shape"], name="past_shape"),
        h.make_node("Shape", ["new"], ["new_shape"], name="new_shape"),
        _const("two", 2), _const("zero", 0), _const("one", 1), _const("extra", extra), _const("axes0", [0]),
        _const("grid_axes", [0, 1, 2]), _const("slice_axes", [3]), _const("starts", [0]),
        h.make_node("Gather", ["past_shape", "two"], ["p"], axis=0, name="p"),
        h.make_node("Gather", ["new_shape", "two"], ["s"], axis=0, name="s"),
        h.make_node("Add", ["p", "s"], ["ps"], name="ps"),
        h.make_node("Add", ["ps", "extra"], ["total"], name="total"),
        h.make_node("Range", ["zero", "total", "one"], ["grid"], name="grid"),
        h.make_node("Unsqueeze", ["grid", "grid_axes"], ["grid4"], name="grid4"),
        h.make_node("Cast", ["grid4"], ["grid_bool"], to=T.BOOL, name="grid_bool"),
        h.make_node("Shape", [slice_from], ["end_shape"], name="end_shape"),
        h.make_node("Gather", ["end_shape", "two"], ["end_scalar"], axis=0, name="end_scalar"),
        h.make_node("Unsqueeze", ["end_scalar", "axes0"], ["end"], name="end"),
        h.make_node("Slice", ["grid_bool", "starts", "end", "slice_axes"], ["cut"], name="cut"),
        h.make_node("And", ["grid_bool", "padding"], ["keep"], name="keep"),
    ]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("past", T.FLOAT, ["B", 2, "P", 4]),
                                  h.make_tensor_value_info("new", T.FLOAT, ["B", 2, "S", 4]),
                                  h.make_tensor_value_info("padding", T.BOOL, ["B", 1, 1, "T"])],
                     [h.make_tensor_value_info("key", T.FLOAT, ["B", 2, "P + S", 4]),
                      h.make_tensor_value_info("cut", T.BOOL, None), h.make_tensor_value_info("keep", T.BOOL, None)])
    graph = to_graph(onnx.shape_inference.infer_shapes(h.make_model(g, opset_imports=[h.make_opsetid("", 17)])))
    return graph, graph.tensors()


def test_a_sum_is_never_a_name_that_reads_like_it():
    assert same_length(DimSum(["S", "P"]), DimSum(["P", "S"]))
    assert not same_length(DimSum(["P", "S"]), "P + S")
    assert not same_length("P + S", DimSum(["P", "S"]))
    assert same_length("B", "B") and same_length(3, 3) and not same_length(3, "B") and not same_length(None, None)


def test_the_grid_and_the_key_are_proved_the_same_length_term_by_term():
    graph, t = _graph()
    grid, key = axis_length(graph, t["grid_bool"], 3), axis_length(graph, t["key"], 2)
    assert isinstance(grid, DimSum) and isinstance(key, DimSum) and same_length(grid, key)
    assert axis_length(graph, t["grid_bool"], 0) == 1 and axis_length(graph, t["key"], 0) == "B"


@pytest.mark.parametrize("extra", [1, -1])
def test_a_grid_one_longer_or_shorter_is_not_the_key(extra):
    graph, t = _graph(extra=extra)
    assert not same_length(axis_length(graph, t["grid_bool"], 3), axis_length(graph, t["key"], 2))


def test_a_broadcast_with_an_unproved_length_is_not_proved():
    graph, t = _graph()  # padding's T is only a declared name: P + S and T may differ (or T be 1)
    assert axis_length(graph, t["keep"], 3) is None
    assert axis_length(graph, t["keep"], 0) == "B"  # B against the grid's 1


def test_a_slice_to_the_key_length_keeps_the_whole_grid():
    graph, t = _graph()
    assert whole_slice(graph, t["cut"].inputs[0])


@pytest.mark.parametrize("extra, slice_from", [(1, "key"), (0, "new"), (0, "past")])
def test_a_slice_that_may_cut_the_grid_is_not_whole(extra, slice_from):
    graph, t = _graph(extra=extra, slice_from=slice_from)
    assert not whole_slice(graph, t["cut"].inputs[0])
