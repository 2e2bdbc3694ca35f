"""The DB detector's three changes of session 39 on CUDA: upsample-by-broadcast's views (ONNX Runtime's
broadcasting Add on the rank-6 view, and a FusedElementwise kernel reading the coarse map through it)
against the original's Resize and Add, bit for bit; and a ConvTranspose's bias added in the region after
it, against cuDNN's separate bias pass (the same single float32 rounding; within a tolerance, as cuDNN
may choose another convolution algorithm in each session). The CPU
checks: tests/rewrites/elementwise/test_upsample_by_broadcast.py, test_conv_bias_into_elementwise.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import onnxfuse
from onnxfuse.custom_ops import session_options
from onnxfuse.runtime.session import cuda_available

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rewrites" / "elementwise"))
from test_upsample_by_broadcast import feeds_for, fpn_model  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime")]


def _run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CUDAExecutionProvider"])
    assert session.get_providers()[0] == "CUDAExecutionProvider"
    return session.run(None, feeds)[0]


def upsample_add(layout: str, tail: str | None) -> "onnx.ModelProto":
    """``tail(Add(x, Resize(y, ×2 nearest)))`` on graph inputs only: no convolution whose cuDNN algorithm
    could differ between two sessions, so the two models must agree bit for bit."""
    full, coarse = ([16, 64, 40, 48], [16, 64, 20, 24]) if layout == "nchw" else ([16, 40, 48, 64], [16, 20, 24, 64])
    scales = [1, 1, 2, 2] if layout == "nchw" else [1, 2, 2, 1]
    inits = [nh.from_array(np.array(scales, np.float32), "scales"), nh.from_array(np.array([], np.float32), "roi")]
    nodes = [h.make_node("Resize", ["y", "roi", "scales"], ["u"], mode="nearest",
                         coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
             h.make_node("Add", ["x", "u"], ["s" if tail else "out"])]
    if tail:
        nodes.append(h.make_node(tail, ["s"], ["out"]))
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, full), h.make_tensor_value_info("y", T.FLOAT, coarse)],
                     [h.make_tensor_value_info("out", T.FLOAT, full)], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 14)], ir_version=8)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("tail", [None, "Relu"], ids=["lone-add", "add-relu"])
def test_the_view_computes_the_original_bits_on_cuda(layout, tail):
    """The lone Add stays ONNX Runtime's (its broadcasting kernel on the view), the Add and Relu become one
    FusedElementwise reading the coarse map through the view: both bit-equal to Resize then Add."""
    model = upsample_add(layout, tail)
    result = onnxfuse.optimize(model, bench=False, provider="cuda")
    ops = [n.op_type for n in result.model.graph.node]
    assert result.validation.passed and result.applied.counts["upsample-by-broadcast"] == 1 and "Resize" not in ops
    assert ("FusedElementwise" in ops) == (tail is not None)
    feeds = feeds_for(model, batch=16)
    assert np.array_equal(_run(result.model, feeds), _run(model, feeds))


def test_the_db_like_step_validates_on_cuda():
    """With the lateral Conv's bias lifted into the view's region (cuDNN may pick another algorithm per
    session, so this one is judged by validation and a tolerance)."""
    model = fpn_model("nchw", bias=True, tail="Relu", batch=16)
    result = onnxfuse.optimize(model, bench=False, provider="cuda")
    assert result.validation.passed and result.applied.counts["upsample-by-broadcast"] == 1
    feeds = feeds_for(model, batch=16)
    np.testing.assert_allclose(_run(result.model, feeds), _run(model, feeds), rtol=1e-3, atol=1e-3)


def test_a_conv_transpose_bias_in_the_region_is_cudnns_rounding():
    rng = np.random.default_rng(5)
    inits = [nh.from_array(rng.standard_normal((32, 16, 2, 2)).astype(np.float32), "w"),
             nh.from_array(rng.standard_normal(16).astype(np.float32), "b")]
    nodes = [h.make_node("ConvTranspose", ["x", "w", "b"], ["c"], strides=[2, 2]), h.make_node("Relu", ["c"], ["y"])]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["batch", 32, 40, 40])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["batch", 16, 80, 80])], inits)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 14)], ir_version=8)
    result = onnxfuse.optimize(model, bench=False, provider="cuda")
    assert result.validation.passed and result.applied.counts["conv-bias-into-elementwise"] == 1
    x = {"x": rng.standard_normal((8, 32, 40, 40)).astype(np.float32)}
    # the same rounding as cuDNN's bias pass, but cuDNN may pick another algorithm per session: a tolerance
    np.testing.assert_allclose(_run(result.model, x), _run(model, x), rtol=1e-3, atol=1e-3)
