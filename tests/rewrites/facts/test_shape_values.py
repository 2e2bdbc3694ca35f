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
from onnxfuse.rewrites.facts.shape_values import (DimSum, axis_length, move_shape_reads, positions_read, proved_rank,
                                              same_length, shape_value)


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


def _undeclared(model_nodes, inputs, outputs):
    """A graph of ``model_nodes`` whose intermediate tensors carry no shapes (as a rule sees the tensors
    earlier rules made: no inference ran since)."""
    g = h.make_graph(model_nodes, "g", inputs, outputs)
    return to_graph(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))


def test_rank_and_lengths_proved_through_expand_reduce_and_broadcast():
    """An Expand to a run-time [1, 1, S, T] of a [B, 1, S, T] mask, a Where over it and a keepdims
    ReduceMax of it: rank 4 each, axis 1 one long, the reduced axis one long, without declared shapes."""
    nodes = [h.make_node("Shape", ["q"], ["qs"], name="qs"), _const("s_at", [1]), _const("t_at", [3]),
             _const("ones", [1, 1]), _const("z", [0.0]),
             h.make_node("Gather", ["qs", "s_at"], ["s"], axis=0, name="s"),
             h.make_node("Shape", ["mask"], ["ms"], name="ms"),
             h.make_node("Gather", ["ms", "t_at"], ["t"], axis=0, name="t"),
             h.make_node("Concat", ["ones", "s", "t"], ["target"], axis=0, name="target"),
             h.make_node("Expand", ["mask", "target"], ["bias"], name="expand"),
             h.make_node("Where", ["cond", "bias", "z"], ["guarded"], name="where"),
             h.make_node("ReduceMax", ["guarded"], ["row"], axes=[-1], keepdims=1, name="row")]
    graph = _undeclared(nodes, [h.make_tensor_value_info("q", T.FLOAT, ["B", "S", 8]),
                                h.make_tensor_value_info("mask", T.FLOAT, ["B", 1, "S", "T"]),
                                h.make_tensor_value_info("cond", T.BOOL, ["B", 1, "S", "T"])],
                        [h.make_tensor_value_info("row", T.FLOAT, None)])
    t = graph.tensors()
    for name in ("bias", "guarded", "row"):
        assert t[name].shape is None and proved_rank(graph, t[name]) == 4, name
        assert axis_length(graph, t[name], 1) == 1, name
    assert axis_length(graph, t["row"], 3) == 1 and axis_length(graph, t["row"], 0) == "B"
    assert axis_length(graph, t["guarded"], 3) == "T"


def test_a_shape_read_of_an_invented_dimension_is_the_length_proved_from_how_the_tensor_is_made():
    """``--precision fp16`` casts the past, so the cache ``Concat(Cast(past), new)`` has no declared shape and
    ONNX's inference invents its length (``unk__N``). ``Shape`` of it read with ``sums``: the invented axis
    is ``P + S`` proved by the Concat (and the named axes stay names); without ``sums`` nothing, as a sum
    is only for callers that prove the other side term by term."""
    nodes = [h.make_node("Cast", ["past"], ["past16"], to=T.FLOAT16, name="cast"),
             h.make_node("Concat", ["past16", "new"], ["key"], axis=2, name="concat"),
             h.make_node("Shape", ["key"], ["key_shape"], name="key_shape")]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("past", T.FLOAT, ["B", 2, "P", 4]),
                                  h.make_tensor_value_info("new", T.FLOAT16, ["B", 2, "S", 4])],
                     [h.make_tensor_value_info("key_shape", T.INT64, None)])
    graph = to_graph(onnx.shape_inference.infer_shapes(h.make_model(g, opset_imports=[h.make_opsetid("", 17)])))
    t = graph.tensors()
    assert str(t["key"].shape[2]).startswith("unk__")  # what inference leaves
    read = shape_value(graph, t["key_shape"], sums=True)
    assert read[:2] == ["B", 2] and read[3] == 4 and isinstance(read[2], DimSum) and read[2].terms == ("P", "S")
    assert shape_value(graph, t["key_shape"]) is None


def test_gather_nd_lengths_are_the_index_grids_then_the_data_past_the_indexed_axes():
    """GatherND(data [B, T], indices [B, 1, S, T, 2]) is [B, 1, S, T] (the dynamo exporter's padding-mask
    lookup); with one index per row (k = 1) the data's trailing axis follows; an index deeper than the
    data, or a dynamic k, proves nothing."""
    nodes = [h.make_node("GatherND", ["mask", "grid"], ["picked"], name="nd"),
             h.make_node("GatherND", ["rows", "one"], ["row"], name="nd1"),
             h.make_node("GatherND", ["mask", "dyn"], ["unknown"], name="nd2")]
    graph = _undeclared(nodes, [h.make_tensor_value_info("mask", T.BOOL, ["B", "T"]),
                                h.make_tensor_value_info("grid", T.INT64, ["B", 1, "S", "T", 2]),
                                h.make_tensor_value_info("rows", T.FLOAT, ["R", "D"]),
                                h.make_tensor_value_info("one", T.INT64, ["N", 1]),
                                h.make_tensor_value_info("dyn", T.INT64, ["N", "K"])],
                        [h.make_tensor_value_info(n, T.FLOAT, None) for n in ("picked", "row", "unknown")])
    t = graph.tensors()
    assert [axis_length(graph, t["picked"], a) for a in range(4)] == ["B", 1, "S", "T"]
    assert [axis_length(graph, t["row"], a) for a in range(2)] == ["N", "D"]
    assert axis_length(graph, t["unknown"], 0) is None


def test_shape_reads_move_only_where_the_axes_read_keep_their_length():
    """Shape(x [B, S, 12]) read at axes 0 and 1 moves to y [B, S, 20]; a Shape read at axis 2, or read
    whole, stays on x."""
    nodes = [_const("i0", 0), _const("s0", [0]), _const("s2", [2]), _const("e2", [2]), _const("e3", [3]),
             h.make_node("Shape", ["x"], ["sa"], name="sa"), h.make_node("Gather", ["sa", "i0"], ["b"], axis=0, name="b"),
             h.make_node("Shape", ["x"], ["sb"], name="sb"), h.make_node("Slice", ["sb", "s0", "e2"], ["bs"], name="bs"),
             h.make_node("Shape", ["x"], ["sc"], name="sc"), h.make_node("Slice", ["sc", "s2", "e3"], ["e"], name="e"),
             h.make_node("Shape", ["x"], ["sd"], name="sd"), h.make_node("Identity", ["sd"], ["whole"], name="whole")]
    graph = _undeclared(nodes, [h.make_tensor_value_info("x", T.FLOAT, ["B", "S", 12]),
                                h.make_tensor_value_info("y", T.FLOAT, ["B", "S", 20])],
                        [h.make_tensor_value_info(n, T.INT64, None) for n in ("b", "bs", "e", "whole")])
    t = graph.tensors()
    nodes = {n.name: n for n in graph.nodes}
    assert positions_read(graph, nodes["sa"]) == {0} and positions_read(graph, nodes["sb"]) == {0, 1}
    assert positions_read(graph, nodes["sc"]) == {2} and positions_read(graph, nodes["sd"]) is None
    move_shape_reads(graph, t["x"], t["y"], (0, 1))
    assert [nodes[n].inputs[0].name for n in ("sa", "sb", "sc", "sd")] == ["y", "y", "x", "x"]
    move_shape_reads(graph, t["x"], t["y"])  # same shape, proved by the caller: every Shape moves
    assert [nodes[n].inputs[0].name for n in ("sc", "sd")] == ["y", "y"]
