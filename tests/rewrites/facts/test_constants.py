"""``facts.constants.constant_node_value``: one reader of a ``Constant`` node's value for protobuf and
graphsurgeon nodes (issue 36 item 2), every value attribute, the same array from both formats."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.rewrites.facts.constants import constant_node_value

CASES = [
    ("value", numpy_helper.from_array(np.array([[1.5, -2.0]], np.float32)), np.array([[1.5, -2.0]], np.float32)),
    ("value", numpy_helper.from_array(np.array([3, 4, 5], np.int32)), np.array([3, 4, 5], np.int32)),
    ("value_int", 5, np.array(5, np.int64)),
    ("value_ints", [2, -1, 7], np.array([2, -1, 7], np.int64)),
    ("value_float", 0.25, np.array(0.25, np.float32)),
    ("value_floats", [1.0, 0.5], np.array([1.0, 0.5], np.float32)),
]


def _graph_node(node: onnx.NodeProto):
    """The same node read by graphsurgeon, as the rewrites see it."""
    out = helper.make_tensor_value_info(node.output[0], TensorProto.UNDEFINED, None)
    model = helper.make_model(helper.make_graph([node], "g", [], [out]), opset_imports=[helper.make_opsetid("", 17)])
    return gs.import_onnx(model).nodes[0]


@pytest.mark.parametrize("attr, value, expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_both_formats_read_the_same_value(attr, value, expected):
    node = helper.make_node("Constant", [], ["c"], **{attr: value})
    from_proto, from_graph = constant_node_value(node), constant_node_value(_graph_node(node))
    for got in (from_proto, from_graph):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)


def test_strings_are_no_value_in_either_format():
    node = helper.make_node("Constant", [], ["c"], value_string="text")
    assert constant_node_value(node) is None
    assert constant_node_value(_graph_node(node)) is None


def test_a_protobuf_node_of_another_op_or_domain_is_no_constant():
    assert constant_node_value(helper.make_node("Identity", ["x"], ["y"])) is None
    other = helper.make_node("Constant", [], ["c"], domain="com.example", value_int=1)
    assert constant_node_value(other) is None
    assert constant_node_value(helper.make_node("Constant", [], ["c"], domain="ai.onnx", value_int=1)) == 1
