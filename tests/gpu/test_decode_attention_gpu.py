"""DecodeAttention on CUDA: the NVRTC-compiled flash-decoding kernel against the same float64 softmax
attention as the CPU kernel's test (tests/rewrites/contrib/test_contrib_decode_attention.py), over
float32, float16 and bfloat16, with one block per head and with the keys split over many blocks (the
combine kernel), the row limits of head sizes 64, 128 and 256, masked keys and a fully masked row; and
the CPU kernel on the same inputs (both are references for each other's indexing). On a GPU of compute
capability 8.0 or newer the float16 and bfloat16 cases of head sizes 32, 64, 96 and 128 with vector loads
run the tensor-core kernels (``_m``), the others the CUDA-core ones."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP

from onnxfuse.custom_ops import session_options
from onnxfuse.rewrites.contrib.contrib_decode_attention import MAX_ROWS
from onnxfuse.runtime.session import cuda_available

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rewrites"))  # contrib_testlib, which it imports
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rewrites" / "contrib"))
from test_contrib_decode_attention import CASES, op_feeds, op_model, reference, types  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime")]

#: (batch, tokens, n, kv_heads, head size, keys, bias): the CPU cases (head sizes 8 to 32), then splits
#: over 4097 keys at batch 1 and 8, 280 heads of one block each, the largest row count (16) at head
#: sizes 64, 128 and 256 (16 bias rows at 64), head size 100 (200-byte float16 rows: the element-load
#: kernels) and 30 (element loads in float32 too), 96 (Phi-3: vector loads, a quarter of the lanes
#: idle), with tiles cut short at the split's end.
GPU_CASES = CASES + [(1, 1, 7, 2, 64, 4097, "tokens"), (8, 1, 7, 2, 64, 4097, "keys"), (140, 1, 1, 2, 16, 50, "none"),
                     (1, 2, 8, 1, 64, 700, "tokens"), (1, 16, 1, 1, 128, 700, "tokens"), (2, 2, 8, 1, 256, 300, "keys"),
                     (3, 2, 3, 2, 100, 600, "tokens"), (2, 1, 4, 2, 96, 1000, "keys"), (1, 1, 8, 1, 256, 2000, "tokens"),
                     (1, 16, 1, 1, 64, 300, "tokens"), (2, 1, 3, 2, 30, 300, "keys")]


def _session(elem, case, provider, max_rows=None):
    batch, tokens, n, kv_heads, size, keys, bias = case
    model = op_model(elem, n * kv_heads, kv_heads, size, bias, 1 / np.sqrt(size),
                     MAX_ROWS if max_rows is None else max_rows)
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=[provider])
    assert session.get_providers()[0] == provider
    return session


@pytest.mark.parametrize("elem,dtype,tol", types(), ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "B{}S{}n{}G{}D{}T{}-{}".format(*c))
def test_the_cuda_kernel_equals_softmax_attention(elem, dtype, tol, case):
    batch, tokens, n, kv_heads, size, keys, bias = case
    feeds = op_feeds(dtype, batch, tokens, n, kv_heads, size, keys, bias, seed=keys)
    (got,) = _session(elem, case, "CUDAExecutionProvider").run(None, feeds)
    (on_cpu,) = _session(elem, case, "CPUExecutionProvider").run(None, feeds)
    want = reference(feeds, n, kv_heads, size, 1 / np.sqrt(size))
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(got.astype(np.float64), on_cpu.astype(np.float64), rtol=tol, atol=tol)


def test_more_rows_than_the_kernel_takes_is_one_clear_error():
    case = (1, 17, 1, 1, 64, 10, "none")
    feeds = op_feeds(np.float16, *case)
    with pytest.raises(Exception, match="DecodeAttention node.*17 query rows per key/value head.*at most 16"):
        _session(TP.FLOAT16, case, "CUDAExecutionProvider", max_rows=64).run(None, feeds)  # a spec above the kernel's
