"""Llama-style attention (rotated, repeated heads) on CUDA: testdata/llama_tiny_dynamo_fp16.onnx optimized
with validation on the GPU, every Softmax in a MultiHeadAttention reading [B, H, L, D] key and value, and
its outputs on ONNX Runtime's CUDA provider equal to the original's at every real token, with left and
right padding and a batch of one. Padding queries under left padding see no key at all; their rows are
compared too when the original's own two runs (optimizations off and on) agree there."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import onnxfuse
from helpers import load_testdata
from onnxfuse.custom_ops import session_options
from onnxfuse.runtime.session import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime")]


def _run(model, feeds, options=None):
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CUDAExecutionProvider"])
    assert session.get_providers()[0] == "CUDAExecutionProvider"
    return session.run(None, feeds)[0].astype(np.float64)


def test_llama_fp16_fused_and_equal_on_cuda():
    model = load_testdata("llama_tiny_dynamo_fp16")
    result = onnxfuse.optimize(model, provider="cuda", samples=2)
    assert result.validation.passed and result.validation.provider == "cuda", result.validation
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("MultiHeadAttention") == 2 and "Softmax" not in ops, result.applied.refusals
    rng = np.random.default_rng(5)
    for batch, seq in ((3, 12), (2, 33), (1, 7)):
        mask = np.ones((batch, seq), np.int64)
        mask[0, :3] = 0  # left padding
        if batch > 1:
            mask[1, seq - 2:] = 0  # right padding
        feeds = {"input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64), "attention_mask": mask}
        want = _run(model, feeds)
        got = _run(result.model, feeds, session_options())
        real = mask.astype(bool)
        np.testing.assert_allclose(got[real], want[real], rtol=2e-2, atol=2e-2, err_msg=f"{batch}x{seq}")


def test_precision_fp16_llama_block_with_a_raw_keep_mask_on_cuda():
    """``--precision fp16`` of a float32 Llama block (tests/rewrites/contrib/test_attention_given_heads.py): its
    float32 softmax island becomes MultiHeadAttention with the keep mask as a raw [B, S, L]
    key_padding_mask on CUDA too (validated there), and every row, those whose every key is masked
    included, matches the float64 reference (those rows average V, as in the float32 original)."""
    import sys
    from pathlib import Path

    rewrites = Path(__file__).resolve().parents[1] / "rewrites"
    sys.path[:0] = [str(rewrites), str(rewrites / "contrib")]  # contrib_testlib, test_attention_exports
    from test_attention_given_heads import _feeds, _llama_block, _reference

    model = _llama_block(np.float32, keep=True)
    result = onnxfuse.optimize(model, precision="fp16", provider="cuda", samples=2)
    assert result.validation.passed and result.validation.provider == "cuda", result.validation
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("MultiHeadAttention") == 1 and "Softmax" not in ops, result.applied.refusals
    for batch, seq in ((2, 6), (3, 40)):
        feeds = _feeds(model, batch, seq, np.float32)
        want = _reference(model, feeds, ("q", "k"))
        got = _run(result.model, feeds, session_options())
        np.testing.assert_allclose(got[0, :2], want[0, :2], atol=2e-2)  # every key masked
        np.testing.assert_allclose(got, want, atol=3e-2)
