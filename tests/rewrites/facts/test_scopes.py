"""Values that come from an enclosing scope: If branches and Loop bodies read outer values, and no
rule or cleanup may rewire an outer node for them or keep phantom readers of them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxfuse
from helpers import run_ort


def _if_identity_of_outer_value() -> onnx.ModelProto:
    # r = Relu(x); y = If(c){then: Neg(r)}{else: Identity(r)}: what exporters write for y = f(x) if c else x
    then_g = h.make_graph([h.make_node("Neg", ["r"], ["t_out"])], "then", [], [h.make_tensor_value_info("t_out", T.FLOAT, [2])])
    else_g = h.make_graph([h.make_node("Identity", ["r"], ["e_out"])], "else", [],
                          [h.make_tensor_value_info("e_out", T.FLOAT, [2])])
    g = h.make_graph([h.make_node("Relu", ["x"], ["r"]),
                      h.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)], "g",
                     [h.make_tensor_value_info("x", T.FLOAT, [2]), h.make_tensor_value_info("c", T.BOOL, [])],
                     [h.make_tensor_value_info("y", T.FLOAT, [2])])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("target", ["cuda", "contrib", "onnx"])
@pytest.mark.parametrize("only", [None, "fold-constants"])
def test_else_branch_identity_of_outer_value_stays_valid(target, only):
    model = _if_identity_of_outer_value()
    result = onnxfuse.optimize(model, target=target, only=only)
    onnx.checker.check_model(result.model, full_check=True)
    x = np.array([-1.5, 2.0], np.float32)
    for c in (True, False):
        feeds = {"x": x, "c": np.array(c)}
        want = -np.maximum(x, 0) if c else np.maximum(x, 0)
        np.testing.assert_array_equal(run_ort(result.model, feeds)["y"], want)


def test_dead_branch_reading_a_conv_does_not_block_batchnorm_folding():
    # A dead If whose branch reads the Conv output: once cleanup removes the If, the branch's nodes
    # must not stay registered as readers of the Conv output (they blocked the BatchNorm fold, which a
    # second optimize then made: not idempotent).
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((2, 2, 1, 1)).astype(np.float32), "w")]
    for name, v in (("g", 1.5), ("b", 0.1), ("m", 0.2), ("v", 0.9)):
        inits.append(numpy_helper.from_array(np.full(2, v, np.float32), name))
    branch = h.make_graph([h.make_node("Identity", ["conv"], ["o"])], "br", [], [h.make_tensor_value_info("o", T.FLOAT, None)])
    nodes = [h.make_node("Conv", ["x", "w"], ["conv"]),
             h.make_node("BatchNormalization", ["conv", "g", "b", "m", "v"], ["y"]),
             h.make_node("If", ["c"], ["dead"], then_branch=branch, else_branch=branch)]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [1, 2, 2, 2]),
                                  h.make_tensor_value_info("c", T.BOOL, [])],
                     [h.make_tensor_value_info("y", T.FLOAT, [1, 2, 2, 2])], inits)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    first = onnxfuse.optimize(model, target="onnx")
    assert first.applied.counts["fold-batchnorm-conv"] == 1
    again = onnxfuse.optimize(first.model, target="onnx")
    assert not any(again.applied.counts.values())


def test_scope_holder_maps_body_nodes_to_the_node_holding_the_body():
    from onnxfuse.model_io import to_graph
    from onnxfuse.rewrites.facts.scopes import Scope

    graph = to_graph(_if_identity_of_outer_value())
    relu, if_node = graph.nodes
    inner = [n for sub in if_node.attrs.values() for n in sub.nodes]
    scope = Scope(graph)
    assert scope.holder(relu) is relu
    assert all(scope.holder(n) is if_node for n in inner)
    then_scope = Scope(if_node.attrs["then_branch"])
    assert then_scope.holder(relu) is None  # a node of the enclosing graph
