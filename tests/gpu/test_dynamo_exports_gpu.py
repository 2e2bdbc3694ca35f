"""torch's dynamo exports (testdata/*_tiny_dynamo.onnx) on CUDA: optimized with validation on the GPU,
every attention fused, and the optimized model's outputs on ONNX Runtime's CUDA provider equal to the
original's with right padding, left padding (GPT-2: query rows that see no key) and a batch of one."""

from __future__ import annotations

import numpy as np
import pytest

import onnxfuse
from helpers import load_testdata
from onnxfuse.custom_ops import session_options
from onnxfuse.runtime.session import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime")]


def _run(model, feeds, options=None):
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CUDAExecutionProvider"])
    assert session.get_providers()[0] == "CUDAExecutionProvider"
    return session.run(None, feeds)[0]


def _feeds(name, batch, seq, rng):
    if name.startswith("vit"):
        return {"pixel_values": rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)}
    mask = np.ones((batch, seq), np.int64)
    mask[0, seq - 3:] = 0
    if batch > 1:
        mask[1, :4] = 0
    return {"input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64), "attention_mask": mask}


@pytest.mark.parametrize("name", ["bert_tiny_dynamo", "gpt2_tiny_dynamo", "vit_tiny_dynamo"])
def test_dynamo_export_fused_and_equal_on_cuda(name):
    model = load_testdata(name)
    result = onnxfuse.optimize(model, provider="cuda", samples=2)
    assert result.validation.passed and result.validation.provider == "cuda"
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("Attention") == 2 and "Softmax" not in ops
    rng = np.random.default_rng(5)
    for batch, seq in ((3, 12), (1, 7)):
        feeds = _feeds(name, batch, seq, rng)
        want = _run(model, feeds)
        got = _run(result.model, feeds, session_options())
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3, err_msg=f"{name} at {batch}x{seq}")
