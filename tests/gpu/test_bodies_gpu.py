"""Rules inside If branches on CUDA (onnxfuse/bodies.py): optimum's merged T5 decoder (testdata
``optimum_t5_decoder_merged``: the first-step and the with-past decoder as the two branches of an If)
optimized with validation on the GPU; both branches' outputs equal the original's on CUDA, and ONNX
Runtime's profile shows the fused attention inside the branches running on the CUDA provider."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

import onnxfuse
from helpers import load_testdata, op_types_within
from onnxfuse.custom_ops import session_options
from onnxfuse.runtime.session import cuda_available
from test_subgraph_names import _feeds, both_runs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime")]


def _providers_by_op(model, feeds, tmp_path) -> dict[str, set[str]]:
    """{op type: the providers ONNX Runtime's profile says ran its nodes}, subgraph nodes included."""
    options = session_options()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CUDAExecutionProvider"])
    session.run(None, feeds)
    path = session.end_profiling()
    found: dict[str, set[str]] = {}
    for event in json.load(open(path)):
        args = event.get("args", {})
        if event.get("cat") == "Node" and "op_name" in args and "provider" in args:
            found.setdefault(args["op_name"], set()).add(args["provider"])
    return found


@pytest.mark.parametrize("use_cache", [False, True])
def test_merged_decoder_fused_in_its_branches_and_equal_on_cuda(use_cache, tmp_path):
    model = load_testdata("optimum_t5_decoder_merged")
    result = onnxfuse.optimize(model, provider="cuda", bench=False)
    assert result.validation.passed and result.validation.provider == "cuda", result.validation
    assert op_types_within(result.model).count("MultiHeadAttention") == 8
    feeds = _feeds(use_cache)
    want, got = both_runs(model, result.model, feeds, "CUDAExecutionProvider")
    for a, b in zip(want, got):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-4)
    placed = _providers_by_op(result.model, feeds, tmp_path)
    assert placed.get("MultiHeadAttention") == {"CUDAExecutionProvider"}, placed
