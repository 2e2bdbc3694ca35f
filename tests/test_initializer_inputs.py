"""Initializers listed among the graph inputs: overridable defaults from IR version 4 on (never
folded: a caller may feed another value), required constants below it (every initializer, new ones
included, must stay listed)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxfuse
from helpers import run_ort


def _conv_bn(ir_version: int, list_inits: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal((3, 2, 3, 3)).astype(np.float32), "w")]
    for name, lo in (("gamma", 0.5), ("beta", -1), ("mean", -1), ("var", 0.5)):
        inits.append(numpy_helper.from_array((rng.random(3) + lo).astype(np.float32), name))
    nodes = [h.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),  # no bias: the fold must add one
             h.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["y"])]
    inputs = [h.make_tensor_value_info("x", T.FLOAT, [1, 2, 5, 5])]
    if list_inits:
        inputs += [h.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    g = h.make_graph(nodes, "g", inputs, [h.make_tensor_value_info("y", T.FLOAT, [1, 3, 5, 5])], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 9 if ir_version < 4 else 13)])
    m.ir_version = ir_version
    return m


def test_ir3_fold_into_biasless_conv_lists_the_new_bias_as_input():
    model = _conv_bn(3, list_inits=True)
    result = onnxfuse.optimize(model, target="onnx")
    assert result.applied.counts["fold-batchnorm-conv"] == 1
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    listed = {vi.name for vi in out.graph.input}
    assert {t.name for t in out.graph.initializer} <= listed
    x = np.random.default_rng(0).standard_normal((1, 2, 5, 5)).astype(np.float32)
    np.testing.assert_allclose(run_ort(out, {"x": x})["y"], run_ort(model, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_overridable_initializers_are_not_folded_and_keep_their_meaning():
    model = _conv_bn(8, list_inits=True)
    result = onnxfuse.optimize(model, target="onnx")
    out = result.model
    assert result.applied.counts["fold-batchnorm-conv"] == 0
    assert [vi.name for vi in out.graph.input] == [vi.name for vi in model.graph.input]  # no input vanished
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 2, 5, 5)).astype(np.float32)
    override = {"w": rng.standard_normal((3, 2, 3, 3)).astype(np.float32), "var": np.full(3, 2.0, np.float32)}
    for feeds in ({"x": x}, {"x": x, **override}):
        np.testing.assert_allclose(run_ort(out, feeds)["y"], run_ort(model, feeds)["y"], rtol=1e-5, atol=1e-5)


def test_plain_initializers_still_fold():
    result = onnxfuse.optimize(_conv_bn(8, list_inits=False), target="onnx")
    assert result.applied.counts["fold-batchnorm-conv"] == 1
