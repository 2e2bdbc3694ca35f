"""Cleanup passes: Identity removal (graph outputs included), dead nodes, unused initializers."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from helpers import assert_same_outputs, make_model, op_types, run_ort, vi
from onnxfuse.model_io import to_graph, to_model
from onnxfuse.rewrites import apply_rules
from onnxfuse.rewrites.engine.cleanup import cleanup


def _clean(model):
    graph = to_graph(model)
    counts = cleanup(graph)
    out = to_model(graph, model)
    onnx.checker.check_model(out, full_check=True)
    return out, counts


def _node(op, inputs, outputs, **attrs):
    return helper.make_node(op, inputs, outputs, name=outputs[0] + "_node", **attrs)


X = vi("x", ["N", 3])


def test_identity_between_nodes_is_removed():
    model = make_model([_node("Relu", ["x"], ["r"]), _node("Identity", ["r"], ["i"]), _node("Sigmoid", ["i"], ["y"])],
                       [X], [vi("y", ["N", 3])])
    out, counts = _clean(model)
    assert op_types(out) == ["Relu", "Sigmoid"]
    assert counts["identity"] == 1
    assert list(out.graph.node[1].input) == ["r"]
    assert_same_outputs(model, out)


def test_identity_to_graph_output_keeps_the_output_name():
    model = make_model([_node("Relu", ["x"], ["r"]), _node("Identity", ["r"], ["y"])], [X], [vi("y", ["N", 3])])
    out, counts = _clean(model)
    assert op_types(out) == ["Relu"]
    assert counts["identity"] == 1
    assert [o.name for o in out.graph.output] == ["y"]
    assert list(out.graph.node[0].output) == ["y"]
    assert_same_outputs(model, out)


def test_identity_to_graph_output_with_other_readers():
    nodes = [_node("Relu", ["x"], ["r"]), _node("Identity", ["r"], ["y"]), _node("Sigmoid", ["r"], ["z"])]
    model = make_model(nodes, [X], [vi("y", ["N", 3]), vi("z", ["N", 3])])
    out, counts = _clean(model)
    assert op_types(out) == ["Relu", "Sigmoid"]
    assert [o.name for o in out.graph.output] == ["y", "z"]
    assert list(out.graph.node[1].input) == ["y"]
    assert_same_outputs(model, out)


def test_identity_chain_to_graph_output():
    nodes = [_node("Relu", ["x"], ["r"]), _node("Identity", ["r"], ["i"]), _node("Identity", ["i"], ["y"])]
    model = make_model(nodes, [X], [vi("y", ["N", 3])])
    out, counts = _clean(model)
    assert op_types(out) == ["Relu"]
    assert counts["identity"] == 2
    assert_same_outputs(model, out)


def test_identity_from_graph_input_or_initializer_to_output_is_kept():
    init = numpy_helper.from_array(np.arange(3, dtype=np.float32), "w")
    nodes = [_node("Identity", ["x"], ["y"]), _node("Identity", ["w"], ["z"])]
    model = make_model(nodes, [X], [vi("y", ["N", 3]), vi("z", [3])], [init])
    out, counts = _clean(model)
    assert op_types(out) == ["Identity", "Identity"]
    assert counts["identity"] == 0
    assert_same_outputs(model, out)


def test_identity_between_two_graph_outputs_is_kept():
    nodes = [_node("Relu", ["x"], ["r"]), _node("Identity", ["r"], ["y"])]
    model = make_model(nodes, [X], [vi("r", ["N", 3]), vi("y", ["N", 3])])
    out, counts = _clean(model)
    assert op_types(out) == ["Relu", "Identity"]
    assert_same_outputs(model, out)


def test_dead_nodes_and_unused_initializers_are_removed_unused_inputs_kept():
    inits = [numpy_helper.from_array(np.ones(3, np.float32), "used"),
             numpy_helper.from_array(np.ones(3, np.float32), "unused")]
    nodes = [_node("Add", ["x", "used"], ["y"]), _node("Relu", ["x"], ["dead1"]), _node("Neg", ["dead1"], ["dead2"])]
    model = make_model(nodes, [X, vi("spare", [2])], [vi("y", ["N", 3])], inits)
    out, counts = _clean(model)
    assert op_types(out) == ["Add"]
    assert counts["dead-node"] == 2
    assert [i.name for i in out.graph.initializer] == ["used"]
    assert [i.name for i in out.graph.input] == ["x", "spare"]


def test_identity_inside_a_subgraph_is_removed():
    then_g = helper.make_graph([_node("Relu", ["x"], ["t"]), _node("Identity", ["t"], ["then_out"])], "then", [],
                               [vi("then_out", ["N", 3])])
    else_g = helper.make_graph([_node("Neg", ["x"], ["e"]), _node("Identity", ["e"], ["else_out"])], "else", [],
                               [vi("else_out", ["N", 3])])
    nodes = [helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then_g, else_branch=else_g)]
    model = make_model(nodes, [X, vi("cond", [], TensorProto.BOOL)], [vi("y", ["N", 3])])
    out, counts = _clean(model)
    assert counts["identity"] == 2
    for attr in out.graph.node[0].attribute:
        assert [n.op_type for n in attr.g.node] in (["Relu"], ["Neg"])
    for cond in (True, False):
        feeds = {"x": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), "cond": np.array(cond)}
        np.testing.assert_array_equal(run_ort(model, feeds)["y"], run_ort(out, feeds)["y"])


def test_apply_rules_runs_cleanup_and_reports_it():
    nodes = [_node("Identity", ["x"], ["i"]), _node("Relu", ["i"], ["y"]), _node("Sigmoid", ["x"], ["dead"])]
    model = make_model(nodes, [X], [vi("y", ["N", 3])])
    graph = to_graph(model)
    report = apply_rules(graph, [])
    assert report.cleanup == {"identity": 1, "identity-reshape": 0, "duplicate": 0, "dead-node": 1}
    assert report.total == 0
    out = to_model(graph, model)
    assert op_types(out) == ["Relu"]
    assert_same_outputs(model, out)


def _reshape_model(target, allowzero=0, shape=("N", 3, 4)):
    out_shape = [None] * len(target)
    t = numpy_helper.from_array(np.asarray(target, np.int64), "t")
    nodes = [_node("Relu", ["x"], ["r"]), _node("Reshape", ["r", "t"], ["s"], allowzero=allowzero),
             _node("Sigmoid", ["s"], ["y"])]
    return make_model(nodes, [vi("x", list(shape))], [vi("y", out_shape)], inits=[t], opset=14)


def _clean_reshapes(model, infer=True):
    graph = to_graph(onnx.shape_inference.infer_shapes(model) if infer else model)
    counts = cleanup(graph)
    out = to_model(graph, model)
    onnx.checker.check_model(out)
    return out, counts


def test_identity_reshapes_are_removed():
    for target in ([0, -1, 4], [0, 3, -1], [-1, 3, 4], [0, 0, 0], [0, 3, 4]):
        model = _reshape_model(target)
        out, counts = _clean_reshapes(model)
        assert op_types(out) == ["Relu", "Sigmoid"], target
        assert counts["identity-reshape"] == 1
        assert_same_outputs(model, out)


def test_reshapes_that_change_the_shape_stay():
    for target, allowzero in (([0, 4, -1], 0), ([0, 12], 0), ([0, -1], 0), ([0, 3, 4], 1), ([-1, -1, 4], 0)):
        model = _reshape_model(target, allowzero)
        out, counts = _clean_reshapes(model)
        assert "Reshape" in op_types(out), target
        assert counts["identity-reshape"] == 0


def test_reshape_of_unknown_rank_stays():
    model = _reshape_model([0, -1, 4])
    out, counts = _clean_reshapes(model, infer=False)  # no shape inference: the Relu's output has no known rank
    assert "Reshape" in op_types(out)


# --- duplicates ---------------------------------------------------------------------------------------


def _dup_model(op2="Relu", extra_attrs=None):
    """Two copies of Shape(x) → Gather(·, 0) and two Relu/op2 of x: the same values computed twice."""
    idx0 = numpy_helper.from_array(np.array(0, np.int64), "i0")
    idx1 = numpy_helper.from_array(np.array(0, np.int64), "i1")  # equal value, another initializer
    nodes = [_node("Shape", ["x"], ["s1"]), _node("Gather", ["s1", "i0"], ["g1"]),
             _node("Shape", ["x"], ["s2"]), _node("Gather", ["s2", "i1"], ["g2"]),
             _node("Add", ["g1", "g2"], ["n"]),
             _node("Relu", ["x"], ["r1"]), _node(op2, ["x"], ["r2"], **(extra_attrs or {})),
             _node("Add", ["r1", "r2"], ["y"])]
    return make_model(nodes, [X], [vi("y", ["N", 3]), vi("n", [], TensorProto.INT64)], inits=[idx0, idx1])


def test_duplicate_nodes_are_merged():
    model = _dup_model()
    out, counts = _clean(model)
    assert counts["duplicate"] == 3  # Shape, Gather (equal constant indices), Relu
    assert sorted(op_types(out)) == ["Add", "Add", "Gather", "Relu", "Shape"]
    assert_same_outputs(model, out)
    a = run_ort(model, {"x": np.ones((5, 3), np.float32)})["n"]
    assert int(a) == 10


def test_different_attributes_or_random_ops_are_not_merged():
    out, counts = _clean(_dup_model(op2="LeakyRelu", extra_attrs={"alpha": 0.5}))
    assert op_types(out).count("Relu") + op_types(out).count("LeakyRelu") == 2
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    nodes = [_node("RandomNormalLike", ["x"], ["a"]), _node("RandomNormalLike", ["x"], ["b"]),
             _node("Sub", ["a", "b"], ["y"])]
    out, counts = _clean(make_model(nodes, [x], [vi("y", [2, 3])]))
    assert counts["duplicate"] == 0 and op_types(out).count("RandomNormalLike") == 2


def test_shapes_of_provably_equal_tensors_are_one_value():
    """Shape(a) and Shape(b) with a, b both [N, 3] (the same declared name): one Shape node."""
    nodes = [_node("Relu", ["x"], ["a"]), _node("Sigmoid", ["x"], ["b"]), _node("Shape", ["a"], ["sa"]),
             _node("Shape", ["b"], ["sb"]), _node("Add", ["sa", "sb"], ["y"])]
    model = make_model(nodes, [X], [vi("y", [2], TensorProto.INT64)])
    out, counts = _clean(onnx.shape_inference.infer_shapes(model))
    assert counts["duplicate"] == 1 and op_types(out).count("Shape") == 1
    feeds = {"x": np.ones((4, 3), np.float32)}
    assert run_ort(out, feeds)["y"].tolist() == run_ort(model, feeds)["y"].tolist() == [8, 6]


def test_shapes_equal_only_by_a_name_two_inputs_declare_stay_apart():
    """ids and mask both declared [batch, sequence]: ONNX Runtime does not check that the two agree (and
    validation feeds them unequal), so Shape(ids) and Shape(mask) are two values."""
    ids = vi("ids", ["batch", "sequence"], TensorProto.INT64)
    mask = vi("mask", ["batch", "sequence"], TensorProto.INT64)
    nodes = [_node("Shape", ["ids"], ["si"]), _node("Shape", ["mask"], ["sm"]), _node("Concat", ["si", "sm"], ["y"], axis=0)]
    model = make_model(nodes, [ids, mask], [vi("y", [4], TensorProto.INT64)])
    out, counts = _clean(onnx.shape_inference.infer_shapes(model))
    assert counts["duplicate"] == 0 and op_types(out).count("Shape") == 2
    feeds = {"ids": np.zeros((2, 3), np.int64), "mask": np.zeros((4, 5), np.int64)}
    assert run_ort(out, feeds)["y"].tolist() == run_ort(model, feeds)["y"].tolist() == [2, 3, 4, 5]


def test_one_input_concat_is_an_identity_and_goes():
    # the legacy exporter's Concat(past_key_values.0.key): a copy of the cache on every step
    model = make_model([_node("Concat", ["x"], ["c"], axis=-2), _node("Relu", ["c"], ["y"]),
                        _node("Concat", ["x", "x"], ["z"], axis=1)],
                       [X], [vi("y", ["N", 3]), vi("z", ["N", 6])])
    out, counts = _clean(model)
    assert op_types(out) == ["Relu", "Concat"], op_types(out)  # the two-input Concat stays
    assert list(out.graph.node[0].input) == ["x"]
    assert_same_outputs(model, out)


def _slicing_model(starts, ends, dims=("N", 3, 16)):
    """Relu → Slice(axis 2, starts:ends) → Concat with Slice(axis 2, 16:∞) → Sigmoid (Phi-3's rotary cut)."""
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
             (("s", starts), ("e", ends), ("a", [2]), ("rest_s", [16]), ("rest_e", [np.iinfo(np.int64).max]))]
    nodes = [_node("Relu", ["x"], ["r"]), _node("Slice", ["r", "s", "e", "a"], ["part"]),
             _node("Slice", ["r", "rest_s", "rest_e", "a"], ["rest"]),
             _node("Concat", ["part", "rest"], ["c"], axis=-1), _node("Sigmoid", ["c"], ["y"])]
    model = make_model(nodes, [vi("x", list(dims))], [vi("y", ["N", 3, "E"])], inits=inits)
    return onnx.shape_inference.infer_shapes(model)  # the sizes the pipeline's inference gives the passes


def test_a_whole_slice_and_an_empty_concat_input_go():
    for starts, ends in (([0], [16]), ([-16], [np.iinfo(np.int64).max]), ([-100], [100])):  # every clamped form
        model = _slicing_model(starts, ends)
        out, counts = _clean(model)
        assert op_types(out) == ["Relu", "Sigmoid"], (starts, ends, op_types(out))
        assert counts["identity-reshape"] == 3  # the whole Slice, the empty input, the one-input Concat
        assert_same_outputs(model, out)


def test_a_partial_slice_or_an_unknown_size_stays():
    out, _ = _clean(_slicing_model([0], [8]))  # keeps half: the empty rest still goes
    assert op_types(out) == ["Relu", "Slice", "Sigmoid"]
    assert_same_outputs(_slicing_model([0], [8]), out)
    dynamic = _slicing_model([0], [16], dims=("N", 3, "D"))  # the axis size is not known: nothing proven
    out, _ = _clean(dynamic)
    assert op_types(out).count("Slice") == 2 and "Concat" in op_types(out)
