"""ChannelTranspose on CUDA: the NVRTC-compiled tile kernels against NumPy's transpose, bit for bit, over
float32, float16 and bfloat16, both directions, channel counts from 1 to the op's 64, pixel counts below,
at and far above one tile (a partial last tile included), and the YOLO-style block under
contrib-channels-last and contrib-channel-transpose validated on CUDA. The CPU kernel's cases:
tests/rewrites/contrib/test_contrib_channel_transpose.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP

from onnxfuse.custom_ops import session_options
from onnxfuse.runtime.session import cuda_available

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rewrites"))  # contrib_testlib, which it imports
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rewrites" / "contrib"))
from test_contrib_channel_transpose import PERMS, op_model, sample  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime")]

#: (channels, (H, W)): an RGB image larger than one tile (2,720 pixels) with a partial last tile, one
#: channel, the most the rule writes (31), the op's limit (64), a single pixel, and 16 × 3 × 160 × 160.
CASES = [(3, (67, 91)), (1, (50, 50)), (31, (9, 13)), (64, (5, 7)), (8, (1, 1)), (3, (160, 160))]


def _run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CUDAExecutionProvider"])
    assert session.get_providers()[0] == "CUDAExecutionProvider"
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("elem", [TP.FLOAT, TP.FLOAT16, TP.BFLOAT16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("direction", ["nhwc", "nchw"])
@pytest.mark.parametrize("c,hw", CASES, ids=lambda v: str(v))
def test_the_cuda_kernel_is_numpy_transpose_bit_for_bit(c, hw, direction, elem):
    batch = 16 if hw == (160, 160) else 2
    shape = (batch, c, *hw) if direction == "nhwc" else (batch, *hw, c)
    x = sample(shape, elem, seed=c)
    got = _run(op_model(direction, elem), {"x": x})
    want = np.ascontiguousarray(x.transpose(PERMS[direction]))
    assert got.shape == want.shape and np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_the_yolo_block_with_channel_transposes_validates_on_cuda():
    import onnxfuse
    from helpers import load_testdata

    result = onnxfuse.optimize(load_testdata("yolo_conv_bn_silu_opset13"), bench=False, provider="cuda",
                               only="+contrib-channels-last,+contrib-channel-transpose")
    assert result.validation.passed and result.applied.counts["contrib-channel-transpose"] == 2
