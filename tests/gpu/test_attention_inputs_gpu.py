"""AttentionInputs on CUDA: the NVRTC-compiled kernel against the same float64 model of rotate / concat /
repeat as the CPU kernel's test (float32, float16 and bfloat16; halves, pairs, partial and no rotation;
with and without the repeated heads and the projection's bias; both the 16-byte and the element-wise paths), and a float32 T5
decoder with a cache (no rotation, no repeats: three outputs) optimized and validated on CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import onnxfuse
from helpers import load_testdata
from onnxfuse.custom_ops import session_options
from onnxfuse.runtime.session import cuda_available

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rewrites" / "contrib"))
from test_contrib_attention_inputs import FORMS, D, _op_feeds, _op_model, _reference, _types  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime")]


@pytest.mark.parametrize("elem,dtype,tol", _types(), ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("rotary_dim,interleaved", [(D, 0), (D, 1), (6, 0), (0, 0)])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_cuda_kernel_equals_rotate_concat_repeat(elem, dtype, tol, rotary_dim, interleaved, form, bias):
    feeds = _op_feeds(elem, dtype, rotary_dim, interleaved, form, bias)
    model = _op_model(elem, rotary_dim, interleaved, form, bias).SerializeToString()
    session = ort.InferenceSession(model, session_options(), providers=["CUDAExecutionProvider"])
    assert session.get_providers()[0] == "CUDAExecutionProvider"
    cpu = ort.InferenceSession(model, session_options(), providers=["CPUExecutionProvider"])
    got, on_cpu = session.run(None, feeds), cpu.run(None, feeds)
    for name, a, c, want in zip(["query", "present_key", "present_value", "key_heads", "value_heads"], got, on_cpu,
                                _reference(feeds, rotary_dim, interleaved, form, elem)):
        np.testing.assert_allclose(a.astype(np.float64), want, rtol=tol, atol=tol * 4, err_msg=name)
        if "value" in name or not rotary_dim:  # copies: bit for bit (a rotation may round differently: FMA)
            np.testing.assert_array_equal(a, c, err_msg=f"{name}: CUDA and CPU kernels differ")


def test_a_float32_t5_decoder_with_a_cache_validates_on_cuda():
    result = onnxfuse.optimize(load_testdata("optimum_t5_decoder_with_past"), provider="cuda", bench=False)
    assert result.validation.passed and result.validation.provider == "cuda", result.validation
    assert "AttentionInputs" in {n.op_type for n in result.model.graph.node}, result.applied.refusals
