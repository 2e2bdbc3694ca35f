"""optimum's Whisper decoders (testdata ``optimum_whisper_decoder[_with_past]``) on CUDA: optimized with
validation on the CUDA provider, every attention one MultiHeadAttention (ONNX Runtime's CUDA kernels with
float32 cross-attention over the cached encoder keys), and the outputs equal to the original's on CUDA at
the first step, at decode and with several new tokens over a cache (the CPU test:
tests/rewrites/contrib/test_whisper_kv_cache.py)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import onnxfuse
from helpers import load_testdata
from onnxfuse.custom_ops import session_options
from onnxfuse.runtime.session import cuda_available

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rewrites"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rewrites" / "contrib"))
from test_whisper_kv_cache import LAYERS, MODELS, whisper_feeds  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime")]


@pytest.mark.parametrize("name", list(MODELS))
def test_whisper_decoders_fuse_validate_and_match_on_cuda(name):
    model = load_testdata(name)
    result = onnxfuse.optimize(model, provider="cuda", samples=2, bench=False)
    assert result.validation.passed and result.validation.provider == "cuda", result.validation
    ops = Counter(n.op_type for n in result.model.graph.node)
    assert ops["MultiHeadAttention"] == 2 * LAYERS and ops["Softmax"] == 0, ops
    cuda = ["CUDAExecutionProvider"]
    original = ort.InferenceSession(model.SerializeToString(), providers=cuda)
    fused = ort.InferenceSession(result.model.SerializeToString(), session_options(), providers=cuda)
    rng = np.random.default_rng(7)
    for batch, new, past, frames in MODELS[name]:
        feeds = whisper_feeds(model, rng, batch, new, past, frames)
        for out, want, got in zip([o.name for o in original.get_outputs()], original.run(None, feeds), fused.run(None, feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3, err_msg=f"{name} {out} at {batch}x{new}, past {past}")
