"""A real T5 export (testdata/t5_tiny_opset17.onnx: ``export_transformers.py --t5``, encoder and decoder,
float32, legacy exporter): issue 30's T5-style RMSNorm item on the exporter's own graph, not a
hand-written form. Every one of its 12 T5LayerNorms becomes SkipSimplifiedLayerNormalization (after a
residual Add) or RMSNormalization (the first of each stack, which reads the embeddings), its 6
attentions (encoder self, decoder causal self, cross) are fused, and the outputs match the original on
ONNX Runtime CPU and an independent float64 reference, with padded encoder rows."""

from __future__ import annotations

import numpy as np

import onnxfuse
from helpers import load_testdata, run_float64, run_ort
from test_attention_exports import run_optimized

NORMS = ("SkipSimplifiedLayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization")


def _feeds(rng, batch, source, target):
    mask = np.ones((batch, source), np.int64)
    mask[0, source - 2:] = 0  # right padding of the source
    return {"input_ids": rng.integers(0, 128, (batch, source)).astype(np.int64), "attention_mask": mask,
            "decoder_input_ids": rng.integers(0, 128, (batch, target)).astype(np.int64)}


def test_every_t5_layernorm_and_attention_of_the_export_is_fused():
    model = load_testdata("t5_tiny_opset17")
    before = [n.op_type for n in model.graph.node]
    assert before.count("ReduceMean") == 12 and before.count("Softmax") == 6  # the export's own T5LayerNorms
    result = onnxfuse.optimize(model, provider="cpu", samples=2)
    assert result.validation.passed
    ops = [n.op_type for n in result.model.graph.node]
    assert sum(ops.count(op) for op in NORMS) == 12 and "ReduceMean" not in ops and "Pow" not in ops
    assert ops.count("SkipSimplifiedLayerNormalization") == 10  # every norm after a residual Add
    assert "Softmax" not in ops and ops.count("Attention") + ops.count("MultiHeadAttention") == 6
    rng = np.random.default_rng(7)
    for batch, source, target in ((2, 9, 4), (3, 5, 6), (1, 1, 1)):
        feeds = _feeds(rng, batch, source, target)
        want, exact = run_ort(model, feeds), run_float64(model, feeds)
        got = run_optimized(result.model, feeds)
        for (out, a), b in zip(want.items(), got):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4, err_msg=f"{out} at {batch}x{source}x{target}")
            np.testing.assert_allclose(b, exact[out], rtol=1e-4, atol=1e-4, err_msg=f"{out}, float64")
