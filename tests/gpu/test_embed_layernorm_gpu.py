"""contrib-embed-layernorm on CUDA: ONNX Runtime's CUDA EmbedLayerNormalization kernel gives the
original's outputs (with run-time token types, and with the constant rows folded into the position
table), at batch sizes that differ from validation's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import helpers
from onnxfuse.runtime.session import cuda_available, run_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime")]

_spec = importlib.util.spec_from_file_location(
    "embed_cases", Path(__file__).resolve().parents[1] / "rewrites" / "contrib" / "test_contrib_embed_layernorm.py")
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


@pytest.mark.parametrize("token_types,positions", [("input", "arange"), ("zeros", "offset")])
def test_embed_layernorm_matches_the_original_on_cuda(token_types, positions):
    model = cases.embeddings_model(token_types, positions)
    out, report = helpers.optimize(model, only=[cases.RULE])
    assert report.counts[cases.RULE] == 1
    feeds = cases.feeds(model, seed=4)
    want = run_model(model, feeds, "cuda")["out"]
    got = run_model(out, feeds, "cuda")["out"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_float16_embed_layernorm_on_cuda_is_within_float16_rounding():
    """ONNX Runtime's CUDA kernel sums the LayerNorm statistics in float16 (the original's LayerNormalization
    in float32): a few float16 ulps of values near 1, and still far from a wrong position table."""
    model = cases.embeddings_model("zeros", "folded", dtype=np.float16)
    out, report = helpers.optimize(model, only=[cases.RULE])
    assert report.counts[cases.RULE] == 1
    feeds = cases.feeds(model, seed=5)
    want = run_model(model, feeds, "cuda")["out"].astype(np.float32)
    got = run_model(out, feeds, "cuda")["out"].astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    other = cases.embeddings_model("zeros", "offset", dtype=np.float16)
    assert np.max(np.abs(run_model(other, feeds, "cuda")["out"].astype(np.float32) - got)) > 0.1
