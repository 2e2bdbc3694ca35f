"""Constant per-channel Mul/Add/Sub/Div folding into Conv / ConvTranspose / Gemm."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from helpers import assert_same_outputs, load_testdata, make_model, op_types, optimize, snapshot, vi

RULE = "fold-scale-bias"
C = 4  # output channels of the test convolutions; spatial size is 5x5 so a (C,) constant is valid but wrong


def test_committed_chains_fold_completely():
    model = load_testdata("conv_scale_bias")
    out, report = optimize(model, only=RULE)
    assert report.counts[RULE] == 9
    assert op_types(out) == ["Conv", "Relu", "Conv", "GlobalAveragePool", "Flatten", "Gemm"]
    assert not report.refusals
    kinds = sorted(d["kind"] for d in report.details)
    assert kinds == sorted(["Mul", "Add", "Mul", "Sub", "Div", "Sub", "Add", "Mul", "Add"])
    assert {d["node"] for d in report.details} == {"conv0", "conv1", "fc"}
    assert out.graph.output[0].name == "output"
    onnx.checker.check_model(out, full_check=True)
    assert_same_outputs(model, out)


def _conv_then(op, const, const_first=False, producer="Conv", bias=True, extra_nodes=(), outputs=None, group=1,
               dtype=np.float32):
    """x → producer (named "prod", output "p") → op(p, k) → y, with C=4 output channels.

    Conv: 3x3 on (N,4,7,7) → (N,4,5,5); ConvTranspose: 3x3 on (N,4,3,3) → (N,4,5,5); Gemm (transB=1, alpha 0.7)
    on (N,8) → (N,4).
    """
    rng = np.random.default_rng(5)
    inits = []
    if producer == "Gemm":
        inits.append(numpy_helper.from_array(rng.standard_normal((C, 8)).astype(dtype), "W"))
        inputs = ["x", "W"] + (["bias"] if bias else [])
        prod = helper.make_node("Gemm", inputs, ["p"], name="prod", transB=1, alpha=0.7)
        x_shape, y_shape = ["N", 8], ["N", C]
    elif producer == "ConvTranspose":
        inits.append(numpy_helper.from_array(rng.standard_normal((4, C // group, 3, 3)).astype(dtype), "W"))
        inputs = ["x", "W"] + (["bias"] if bias else [])
        prod = helper.make_node("ConvTranspose", inputs, ["p"], name="prod", group=group)
        x_shape, y_shape = ["N", 4, 3, 3], ["N", C, 5, 5]
    else:
        inits.append(numpy_helper.from_array(rng.standard_normal((C, 4 // group, 3, 3)).astype(dtype), "W"))
        inputs = ["x", "W"] + (["bias"] if bias else [])
        prod = helper.make_node("Conv", inputs, ["p"], name="prod", group=group)
        x_shape, y_shape = ["N", 4, 7, 7], ["N", C, 5, 5]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(C).astype(dtype), "bias"))
    inits.append(numpy_helper.from_array(np.asarray(const, dtype=dtype), "k"))
    node = helper.make_node(op, ["k", "p"] if const_first else ["p", "k"], ["y"], name="op")
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return make_model([prod, node, *extra_nodes], [vi("x", x_shape, elem)], outputs or [vi("y", y_shape, elem)],
                      inits)


def _value(shape, rng=np.random.default_rng(9)):
    return rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)


CONV_SHAPES = [(C, 1, 1), (1, C, 1, 1), (), (1,), (1, 1, 1), (1, 1, 1, 1)]


@pytest.mark.parametrize("shape", CONV_SHAPES)
@pytest.mark.parametrize("op, const_first", [("Mul", False), ("Mul", True), ("Add", False), ("Add", True),
                                             ("Sub", False), ("Sub", True), ("Div", False)])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_per_channel_shapes(op, const_first, shape, bias):
    model = _conv_then(op, _value(shape), const_first=const_first, bias=bias)
    out, report = optimize(model, only=RULE)
    assert report.counts[RULE] == 1, report.to_dict()
    assert op_types(out) == ["Conv"]
    assert report.details[0] == {"rule": RULE, "node": "prod", "op": "Conv", "folded": "op", "kind": op}
    assert_same_outputs(model, out)


@pytest.mark.parametrize("op", ["Mul", "Add", "Sub", "Div"])
@pytest.mark.parametrize("shape", [(C, 1, 1), (1, C, 1, 1), ()])
@pytest.mark.parametrize("group", [1, 2])
def test_convtranspose(op, shape, group):
    model = _conv_then(op, _value(shape), producer="ConvTranspose", bias=(op != "Add"), group=group)
    out, report = optimize(model, only=RULE)
    assert report.counts[RULE] == 1, report.to_dict()
    assert op_types(out) == ["ConvTranspose"]
    assert_same_outputs(model, out)


@pytest.mark.parametrize("op", ["Mul", "Add", "Sub", "Div"])
@pytest.mark.parametrize("shape", [(C,), (1, C), (), (1,), (1, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_gemm(op, shape, bias):
    model = _conv_then(op, _value(shape), producer="Gemm", bias=bias)
    out, report = optimize(model, only=RULE)
    assert report.counts[RULE] == 1, report.to_dict()
    assert op_types(out) == ["Gemm"]
    assert_same_outputs(model, out)


def test_chain_folds_over_several_passes_and_keeps_the_output_name():
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((C, 4, 3, 3)).astype(np.float32), "W")
    consts = [numpy_helper.from_array(_value(s).astype(np.float32), f"k{i}")
              for i, s in enumerate([(C, 1, 1), (1, C, 1, 1), (), (1,), (C, 1, 1)])]
    nodes = [helper.make_node("Conv", ["x", "W"], ["t0"], name="conv")]
    for i, op in enumerate(["Mul", "Add", "Mul", "Sub", "Div"]):
        nodes.append(helper.make_node(op, [f"t{i}", f"k{i}"], [f"t{i + 1}" if i < 4 else "y"], name=f"op{i}"))
    nodes.append(helper.make_node("Relu", ["y"], ["z"], name="relu"))
    model = make_model(nodes, [vi("x", ["N", 4, 7, 7])], [vi("z", ["N", C, 5, 5]), vi("y", ["N", C, 5, 5])],
                       [w, *consts])
    out, report = optimize(model, only=RULE)
    assert report.counts[RULE] == 5
    assert op_types(out) == ["Conv", "Relu"]
    assert out.graph.node[0].output[0] == "y"  # the graph output keeps its name
    assert_same_outputs(model, out)


def test_constant_node_operand():
    model = _conv_then("Mul", _value((C, 1, 1)))
    k = [i for i in model.graph.initializer if i.name == "k"][0]
    model.graph.initializer.remove(k)
    model.graph.node.insert(0, helper.make_node("Constant", [], ["k"], name="kconst", value=k))
    out, report = optimize(model, only=RULE)
    assert report.counts[RULE] == 1
    assert op_types(out) == ["Conv"]
    assert_same_outputs(model, out)


def test_shared_weight_is_copied_and_the_other_reader_keeps_it():
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.standard_normal((C, 4, 3, 3)).astype(np.float32), "W"),
             numpy_helper.from_array(_value((C, 1, 1)).astype(np.float32), "k")]
    nodes = [helper.make_node("Conv", ["x", "W"], ["a"], name="conv_a"),
             helper.make_node("Conv", ["x", "W"], ["b"], name="conv_b"),
             helper.make_node("Mul", ["a", "k"], ["a2"], name="mul")]
    model = make_model(nodes, [vi("x", ["N", 4, 7, 7])], [vi("a2", ["N", C, 5, 5]), vi("b", ["N", C, 5, 5])], inits)
    out, report = optimize(model, only=RULE)
    assert report.counts[RULE] == 1
    assert report.details[0]["copied"] == ["weight"]
    conv_b = next(n for n in out.graph.node if n.name == "conv_b")
    conv_a = next(n for n in out.graph.node if n.name == "conv_a")
    assert conv_b.input[1] == "W" and conv_a.input[1] != "W"
    assert len(conv_a.input) == 2  # a pure scale adds no bias
    assert_same_outputs(model, out)


def test_fp16_conv_folds_within_fp16_precision():
    model = _conv_then("Mul", _value((C, 1, 1)), dtype=np.float16)
    out, report = optimize(model, only=RULE)
    assert report.counts[RULE] == 1
    assert {numpy_helper.to_array(i).dtype for i in out.graph.initializer} == {np.dtype(np.float16)}
    assert_same_outputs(model, out, rtol=1e-2)


# --- refusals ----------------------------------------------------------------------------------------


def _assert_refused(model, reason_part):
    out, report = optimize(model, only=RULE)
    assert report.total == 0
    assert snapshot(out) == snapshot(model)
    reasons = [r.reason for r in report.refusals]
    assert any(reason_part in r for r in reasons), reasons


@pytest.mark.parametrize(
    "shape, reason",
    [
        ((1, 1, 5, 5), "varies along output axis 2"),
        ((5,), "varies along output axis 3"),  # (C,) aligns with the width, not the channels
        ((1, 1, 1, 5), "varies along output axis 3"),
        ((2, C, 1, 1), "varies along output axis 0"),
        ((1, 1, 1, 1, 1), "would broadcast the rank-4 output to rank 5"),
    ],
)
def test_refuses_shapes_that_are_not_per_channel(shape, reason):
    model = _conv_then("Mul", _value(shape))
    for o in model.graph.output:  # keep the declared output shapes consistent with what ONNX computes
        o.type.tensor_type.ClearField("shape")
    _assert_refused(model, reason)


def test_refuses_gemm_constant_varying_along_batch():
    model = _conv_then("Add", _value((3, 1)), producer="Gemm")
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 3
    _assert_refused(model, "varies along output axis 0")


def test_refuses_division_of_a_constant_by_the_output():
    _assert_refused(_conv_then("Div", _value((C, 1, 1)), const_first=True), "c / y is not affine")


def test_refuses_division_by_zero():
    v = _value((C, 1, 1))
    v[1] = 0.0
    _assert_refused(_conv_then("Div", v), "division by zero")


def test_refuses_output_read_elsewhere():
    model = _conv_then("Mul", _value(()), extra_nodes=[helper.make_node("Relu", ["p"], ["r"], name="relu")],
                       outputs=[vi("y", ["N", C, 5, 5]), vi("r", ["N", C, 5, 5])])
    _assert_refused(model, "'p' is also read by 'relu'")


def test_refuses_output_that_is_a_graph_output():
    model = _conv_then("Add", _value(()), outputs=[vi("y", ["N", C, 5, 5]), vi("p", ["N", C, 5, 5])])
    _assert_refused(model, "'p' is also a graph output")


def test_refuses_non_constant_weight():
    model = _conv_then("Mul", _value(()))
    w = [i for i in model.graph.initializer if i.name == "W"][0]
    model.graph.initializer.remove(w)
    model.graph.input.append(vi("W", list(w.dims)))
    _assert_refused(model, "weight 'W' is not a constant")


def test_refuses_dtype_mismatch():
    model = _conv_then("Mul", _value(()))
    k = [i for i in model.graph.initializer if i.name == "k"][0]
    k.CopyFrom(numpy_helper.from_array(np.asarray(2.0, dtype=np.float64), "k"))
    _assert_refused(model, "dtype mismatch")


def test_non_constant_operand_is_not_a_candidate():
    """Add(conv, residual) is not a scale or bias: left alone without cluttering the refusals."""
    model = _conv_then("Add", _value(()))
    model.graph.node[1].input[1] = "x2"
    model.graph.input.append(vi("x2", ["N", C, 5, 5]))
    out, report = optimize(model, only=RULE)
    assert report.total == 0 and not report.refusals
    assert snapshot(out) == snapshot(model)
