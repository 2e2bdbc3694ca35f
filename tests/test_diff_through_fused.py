"""diff --intermediates compares through fused regions: optimize records which original tensors each
FusedElementwise node computes (metadata onnxfuse.fused_values), and diff exposes them, so drift
planted inside a region is found and named at the tensor where it starts."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxfuse
from onnxfuse.custom_ops import FUSED_VALUES_KEY


def _chain() -> onnx.ModelProto:
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one")]
    nodes = [h.make_node("Relu", ["x"], ["r"], name="relu"), h.make_node("Mul", ["r", "two"], ["m"], name="mul"),
             h.make_node("Add", ["m", "one"], ["a"], name="add"), h.make_node("Tanh", ["a"], ["y"], name="tanh")]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [4, 8])],
                     [h.make_tensor_value_info("y", T.FLOAT, [4, 8])], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _plant(model: onnx.ModelProto, old: str, new: str) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        for a in node.attribute:
            if a.name == "program" and old in a.s.decode():
                a.s = a.s.decode().replace(old, new).encode()
                return out
    raise AssertionError("nothing planted")


def test_optimize_records_the_tensors_inside_each_fused_node():
    result = onnxfuse.optimize(_chain())
    (fused,) = [n for n in result.model.graph.node if n.op_type == "FusedElementwise"]
    meta = json.loads(next(p.value for p in result.model.metadata_props if p.key == FUSED_VALUES_KEY))
    assert set(meta[fused.name]) == {"r", "m", "a"}


def test_drift_planted_inside_a_region_is_named_where_it_starts():
    original = _chain()
    optimized = onnxfuse.optimize(original).model
    assert onnxfuse.diff(original, optimized, intermediates=True).passed
    planted = _plant(optimized, "= 2.0", "= 2.5")  # the Mul's constant, in the middle of the region
    report = onnxfuse.diff(original, planted, intermediates=True)
    assert not report.passed
    compared = {c.name for c in report.intermediates}
    assert {"r", "m", "a"} <= compared
    assert report.first_divergence["name"] == "m"
    assert next(c for c in report.intermediates if c.name == "r").passed
