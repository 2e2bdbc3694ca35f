"""FusedConcat on CUDA: the placed kernels against NumPy (np.concatenate of each program evaluated by
expr.evaluate), over the CPU test's layouts (tests/custom_ops/test_fused_concat.py), large channels-last
and channels-first segments (launch tuning times kernels of 1M elements and more), rows that are not a
multiple of the vector width (scalar kernels), a segment on either side of an odd offset, and the
YOLO-style detector's blocks optimized with the rule and validated on CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from onnxfuse.runtime.session import cuda_available

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "custom_ops"))
from test_fused_concat import ADD_BIAS, CASES, COPY, NP_TYPE, RELU, SILU, concat_model, feeds_for, reference, run_concat  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime")]

#: (programs, shapes, axis): YOLO-like C2f concatenations at batch 16 (NCHW and NHWC, 1.6M-6.5M elements
#: per segment), odd channel counts (rows of 3 x 5 x 5 = 75 elements: scalar kernels; offsets not multiples
#: of 4), and a per-channel bias through the broadcast kernels.
LARGE = [
    ([SILU, SILU], [[[16, 64, 40, 40]], [[16, 32, 40, 40]]], 1),
    ([SILU, COPY, SILU], [[[16, 40, 40, 64]], [[16, 40, 40, 64]], [[16, 40, 40, 32]]], 3),
    ([RELU, SILU, RELU], [[[3, 3, 5, 5]], [[3, 1, 5, 5]], [[3, 7, 5, 5]]], 1),
    ([ADD_BIAS, RELU], [[[16, 24, 20, 20], [24, 1, 1]], [[16, 8, 20, 20]]], 1),
    ([ADD_BIAS, COPY], [[[8, 20, 20, 24], [24]], [[8, 20, 20, 3]]], 3),
]


def _check(programs, shapes, axis, dtype, seed):
    programs = [t.format(t=dtype) for t in programs]
    model = concat_model(programs, shapes, axis, dtype)
    feeds = feeds_for(model, seed=seed)
    got = run_concat(model, feeds, provider="CUDAExecutionProvider")
    want = reference(programs, feeds, axis)
    tol = 1e-5 if dtype == "float32" else 2e-3
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == NP_TYPE[dtype]
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_small_layouts_match_numpy_on_cuda(case, dtype):
    _check(*CASES[case], dtype, seed=case)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", range(len(LARGE)))
def test_large_and_odd_layouts_match_numpy_on_cuda(case, dtype):
    _check(*LARGE[case], dtype, seed=100 + case)


def test_copy_segments_are_bit_exact_on_cuda():
    programs = [COPY.format(t="float16")] * 3
    model = concat_model(programs, [[[4, 8, 9, 3]], [[4, 8, 9, 5]], [[4, 8, 9, 8]]], 3, "float16")
    feeds = feeds_for(model)
    (got,) = run_concat(model, feeds, provider="CUDAExecutionProvider")
    assert np.array_equal(got.view(np.uint16), np.concatenate(list(feeds.values()), axis=3).view(np.uint16))


def test_cuda_equals_cpu_for_the_same_node():
    programs = [t.format(t="float32") for t in (SILU, ADD_BIAS, RELU)]
    model = concat_model(programs, [[[2, 6, 7, 9]], [[2, 5, 7, 9], [5, 1, 1]], [[2, 3, 7, 9]]], 1)
    feeds = feeds_for(model, seed=7)
    cpu = run_concat(model, feeds)
    cuda = run_concat(model, feeds, provider="CUDAExecutionProvider")
    for a, b in zip(cpu, cuda):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_graph_capture_and_replay(dtype):
    """FusedConcat's launches (one per segment, on ONNX Runtime's stream, no synchronisation) are captured in
    a CUDA graph and replayed with new inputs: each replay's outputs are the reference's for those inputs.
    The large segment (1.2M elements) would be launch-tuned outside a capture; under one it takes the
    default shape."""
    import onnxruntime as ort

    from onnxfuse.custom_ops import session_options

    programs = [t.format(t=dtype) for t in (SILU, ADD_BIAS, COPY)]
    shapes = [[[4, 24, 40, 32]], [[4, 8, 40, 32], [32]], [[4, 3, 40, 32]]]
    model = concat_model(programs, shapes, 1, dtype)
    so = session_options()
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CUDAExecutionProvider"],
                                provider_options=[{"enable_cuda_graph": "1"}])
    feeds0 = feeds_for(model, seed=1)
    values = {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for k, v in feeds0.items()}
    first = reference(programs, feeds0, 1)
    outs = [ort.OrtValue.ortvalue_from_numpy(np.zeros(w.shape, NP_TYPE[dtype]), "cuda", 0) for w in first]
    io = sess.io_binding()
    for k, v in values.items():
        io.bind_ortvalue_input(k, v)
    for o, name in zip(outs, [x.name for x in sess.get_outputs()]):
        io.bind_ortvalue_output(name, o)
    tol = 1e-5 if dtype == "float32" else 2e-3
    for step in range(4):  # the first runs capture the graph, later ones replay it
        feeds = feeds_for(model, seed=10 + step)
        for k, v in feeds.items():
            values[k].update_inplace(v)
        sess.run_with_iobinding(io)
        for o, w in zip(outs, reference(programs, feeds, 1)):
            np.testing.assert_allclose(o.numpy().astype(np.float64), w.astype(np.float64), rtol=tol, atol=tol,
                                       err_msg=f"step {step}")
