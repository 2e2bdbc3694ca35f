"""ChannelsLastMean's CPU kernel (csrc/channels_last_mean.cc) run by ONNX Runtime's CPU provider against
NumPy's mean in float64, rounded once to the type: float32 and float16 bit-equal (the kernel sums in
float64), bfloat16 behind float32 Casts; odd shapes, one pixel, and the failures it owes one line for.
The CUDA kernel: tests/custom_ops/test_channels_last_mean_emulated.py (on the CPU) and
tests/gpu/test_channels_last_mean_gpu.py."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from onnxfuse.custom_ops import DOMAIN, session_options

SHAPES = [(2, 5, 7, 11), (1, 1, 1, 3), (3, 13, 1, 64), (2, 4, 4, 1)]


def model(elem: int):
    """One ChannelsLastMean node named "mean"; a bfloat16 tensor (which numpy cannot hand to ONNX Runtime)
    behind float32 Casts, exact for values that are bfloat16 already. The GPU test runs it too."""
    nodes, x, y = [], "x", "y"
    io = T.FLOAT if elem == T.BFLOAT16 else elem
    if elem == T.BFLOAT16:
        nodes.append(h.make_node("Cast", ["x"], ["x16"], to=T.BFLOAT16))
        x, y = "x16", "y16"
    nodes.append(h.make_node("ChannelsLastMean", [x], [y], domain=DOMAIN, name="mean"))
    if elem == T.BFLOAT16:
        nodes.append(h.make_node("Cast", ["y16"], ["y"], to=T.FLOAT))
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", io, None)], [h.make_tensor_value_info("y", io, None)])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(DOMAIN, 1)], ir_version=8)


def run(m, x):
    return ort.InferenceSession(m.SerializeToString(), session_options(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_cpu_kernel_is_the_mean_rounded_once(shape, dtype):
    x = (np.random.default_rng(sum(shape)).standard_normal(shape) * 3 + 1).astype(dtype)
    got = run(model(T.FLOAT if dtype == np.float32 else T.FLOAT16), x)
    want = x.astype(np.float64).mean(axis=(1, 2), keepdims=True).astype(dtype)
    assert got.shape == (shape[0], 1, 1, shape[3]) and got.dtype == dtype
    np.testing.assert_array_equal(got, want)


def test_bfloat16_through_casts():
    x = (np.random.default_rng(1).standard_normal((2, 6, 5, 8)).astype(np.float32).view(np.uint32)
         & 0xFFFF0000).view(np.float32)  # values bfloat16 holds
    got = run(model(T.BFLOAT16), x)
    want = x.astype(np.float64).mean(axis=(1, 2), keepdims=True)
    assert np.all(np.abs(got - want) <= 2.0 ** -8 * np.abs(want) + 1e-30)  # one rounding to bfloat16


def test_a_tensor_of_another_rank_fails_in_one_line_naming_the_node():
    with pytest.raises(Exception, match=r"ChannelsLastMean node 'mean'.*expected rank 4"):
        run(model(T.FLOAT), np.zeros((2, 3, 4), np.float32))
