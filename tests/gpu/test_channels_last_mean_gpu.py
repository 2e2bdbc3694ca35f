"""ChannelsLastMean on CUDA: the NVRTC-compiled kernel against the mean in float64 (rounded to the type),
over float32, float16 and bfloat16, at shapes that take each channel-group width the host picks (32, 16
and 8 lanes), a partial last group, one pixel, and the DB detector's largest squeeze-excitation input
[16, 80, 80, 72]; the same bits on every run; and a channels-last MobileNetV3 validated on CUDA with the op
in it. The kernel's index arithmetic is also checked without a GPU
(tests/custom_ops/test_channels_last_mean_emulated.py); the CPU kernel in
tests/rewrites/contrib/test_contrib_channels_last.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP

from onnxfuse.custom_ops import session_options
from onnxfuse.runtime.session import cuda_available

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "custom_ops"))
from test_channels_last_mean import model as op_model  # noqa: E402  (the CPU kernel's test's one-node model)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime")]

#: [N, H, W, C]: 32 lanes (16 x 30 groups), 16 lanes (16 x 19), 8 lanes with a partial group (2 x 9...),
#: one pixel, the DB detector's largest pool (8 lanes, 144 blocks), EfficientNet-B0's last (7 x 7 x 1152)
SHAPES = [(16, 20, 20, 960), (16, 9, 11, 300), (2, 13, 17, 70), (3, 1, 1, 40), (16, 80, 80, 72), (16, 7, 7, 1152)]
#: the largest error against the float64 mean rounded to the type: float32 sums in another order; the
#: half types may round the float32 sum's quotient the other way (one unit in the last place)
ULP = {TP.FLOAT: 2.0 ** -20, TP.FLOAT16: 2.0 ** -10, TP.BFLOAT16: 2.0 ** -7}


def sample(shape, elem, seed=0) -> np.ndarray:
    x = (np.random.default_rng(seed).standard_normal(shape) + 0.5).astype(np.float32)
    if elem == TP.FLOAT16:
        return x.astype(np.float16)
    if elem == TP.BFLOAT16:
        return (x.view(np.uint32) & 0xFFFF0000).view(np.float32)
    return x


def _session(model, provider):
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=[provider])
    assert session.get_providers()[0] == provider
    return session


@pytest.mark.parametrize("elem", [TP.FLOAT, TP.FLOAT16, TP.BFLOAT16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_cuda_kernel_is_the_mean(shape, elem):
    x = sample(shape, elem, seed=shape[3])
    session = _session(op_model(elem), "CUDAExecutionProvider")
    got = session.run(None, {"x": x})[0]
    want = x.astype(np.float64).mean(axis=(1, 2), keepdims=True)
    assert got.shape == (shape[0], 1, 1, shape[3]) and got.dtype == x.dtype
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= ULP[elem] * np.maximum(np.abs(want), 1.0) + 1e-6), float(err.max())
    again = session.run(None, {"x": x})[0]
    assert np.array_equal(got.view(np.uint8), again.view(np.uint8))  # a fixed order of additions: the same bits


def test_a_channels_last_mobilenet_validates_on_cuda():
    import onnxfuse
    from helpers import load_testdata

    result = onnxfuse.optimize(load_testdata("mobilenet_v3_small_w025_opset13"), bench=False, provider="cuda",
                               only="+contrib-channels-last")
    ops = [n.op_type for n in result.model.graph.node]
    assert result.validation.passed and "ChannelsLastMean" in ops and "ReduceMean" not in ops
