"""contrib-channels-last on CUDA (issue 34): the testdata conv nets optimized with the rule, validated on the
GPU, every Conv a com.microsoft NhwcConv that ONNX Runtime's CUDA provider runs, and the outputs equal the
original's on CUDA at batch 4, in float32 and in float16 (``--precision fp16``)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import onnxfuse
from helpers import load_testdata, op_types
from onnxfuse.custom_ops import session_options
from onnxfuse.runtime.session import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime")]

CNNS = [("mobilenet_v2_w035", 96), ("mobilenet_v3_small_w025_opset13", 64), ("efficientnet_blocks_opset13", 64),
        ("convnext_blocks_opset13", 32), ("yolo_conv_bn_silu_opset13", 64)]


def _cuda_run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CUDAExecutionProvider"])
    assert session.get_providers()[0] == "CUDAExecutionProvider"
    return session.run(None, feeds)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("name,size", CNNS)
def test_channels_last_validates_on_cuda_and_matches(name, size, precision):
    model = load_testdata(name)
    result = onnxfuse.optimize(model, only="+contrib-channels-last", provider="cuda", bench=False,
                               precision=precision)
    assert result.validation.passed
    assert op_types(result.model).count("NhwcConv") == op_types(model).count("Conv")
    x = np.random.default_rng(7).standard_normal((4, 3, size, size)).astype(np.float32)
    feeds = {model.graph.input[0].name: x}
    want, got = _cuda_run(model, feeds), _cuda_run(result.model, feeds)
    tol = 2e-2 if precision == "fp16" else 1e-3
    for a, b in zip(want, got):
        scale = max(1.0, float(np.abs(a).max()))
        np.testing.assert_allclose(b.astype(np.float32), a, rtol=tol, atol=tol * scale)
