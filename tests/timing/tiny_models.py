"""Tiny models for the bench tests, built in code (no committed files needed)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def conv_relu_add(batch="N", channels: int = 3) -> onnx.ModelProto:
    """x[N,3,8,8] → Conv(3→4, 3x3, pad 1) → Relu → Add(bias) → y. ``batch`` may be an int (fixed)."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((4, channels, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal((1, 4, 1, 1)).astype(np.float32), "b")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Add", ["r", "b"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes, "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, channels, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4, 8, 8])],
        initializer=[w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def two_inputs(fixed_first: int | None = None) -> onnx.ModelProto:
    """ids[batch, seq] (int64) and x[batch, 4] → y = x * 2 (ids only checked for shape)."""
    first = fixed_first if fixed_first is not None else "batch"
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"]),
         helper.make_node("Shape", ["ids"], ["ids_shape"])],
        "two",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [first, "seq"]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [first, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [first, 4]),
         helper.make_tensor_value_info("ids_shape", TensorProto.INT64, [2])],
        initializer=[numpy_helper.from_array(np.array(2.0, np.float32), "two")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    return model
