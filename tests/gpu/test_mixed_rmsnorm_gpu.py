"""MixedRMSNorm on CUDA: the NVRTC-compiled kernel (one block per row) against the contract the CPU kernel's
test checks (tests/rewrites/contrib/test_contrib_mixed_rmsnorm.py: float32 sum and statistics, the result
rounded to γ's type before γ multiplies), over every x and γ type pair, with and without skip and sum, at
hidden sizes below, at and far above the block's 256 threads, one row and many; and the CPU kernel on the
same inputs (each a reference for the other's indexing)."""

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
from test_contrib_mixed_rmsnorm import TYPES, contract, op_feeds, op_model, type_id  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime")]

#: (rows shape, hidden size): one row (a decode step), a prefill's rows, sizes of Qwen2-0.5B (896),
#: Llama (4096), an odd one (33) and one below a warp (7).
SHAPES = [((1, 1), 896), ((4, 512), 896), ((2, 3), 4096), ((5,), 33), ((3, 2), 7)]


def _run(model, feeds, provider):
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=[provider])
    assert session.get_providers()[0] == provider
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


@pytest.mark.parametrize("types", TYPES, ids=[type_id(t) for t in TYPES])
@pytest.mark.parametrize("skip", [True, False], ids=["skip", "no-skip"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_cuda_kernel_computes_the_contract(types, skip, shape):
    x_type, gamma_type = types
    lead, d = shape
    feeds = op_feeds(x_type, gamma_type, skip, (*lead, d), seed=d, scale=3.0)
    model = op_model(x_type, gamma_type, skip, with_sum=True)
    got = _run(model, feeds, "CUDAExecutionProvider")
    cpu = _run(model, feeds, "CPUExecutionProvider")
    y, s = contract(feeds, gamma_type)
    np.testing.assert_array_equal(got["sum"], s)
    np.testing.assert_array_equal(cpu["sum"], s)
    # The CUDA kernel sums the float32 squares over its threads (the contract and the CPU kernel: in double),
    # so r can move by a few float32 units (a ReduceMean's own order does the same): float32 y within 1e-5
    # relative; a half-precision y within two of its units (round(s·r) moved by one, then times γ < 2),
    # and equal nearly everywhere.
    if gamma_type == TP.FLOAT:
        np.testing.assert_allclose(got["y"], y, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(cpu["y"], y, rtol=1e-6, atol=1e-7)
        return
    ulp = (np.spacing(np.abs(y).astype(np.float16)).astype(np.float32) if gamma_type == TP.FLOAT16
           else np.abs(y) * 2.0 ** -7)
    for name, out, units in (("cuda", got["y"], 2), ("cpu", cpu["y"], 1)):
        diff = np.abs(out.astype(np.float32) - y)
        assert np.all(diff <= units * ulp), f"{name}: {diff.max()}"
    assert np.mean(got["y"].astype(np.float32) != y) < 0.01
