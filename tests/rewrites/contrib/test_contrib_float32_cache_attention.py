"""contrib-float32-cache-attention (opt-in): a float32 KV-cache decoder's attention over rotated heads,
which contrib-attention leaves unfused in float32 (a measured refusal, tests/rewrites/contrib/
test_kv_cache_float64.py), becomes MultiHeadAttention, and the decoder rules after it make each layer
AttentionInputs, DecodeAttention and an If as in float16. Against the float32 export evaluated in float64
(onnx's reference evaluator) at a prefill on each branch of the If and at decode, with left padding."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import onnxfuse
from helpers import kv_cache_feeds, load_testdata, op_types_within, run_float64
from test_attention_exports import run_optimized

LAYERS = 2


@pytest.mark.parametrize("name", ["llama_kv_opset14", "qwen2_kv_opset17", "llama_kv_dynamo"])
def test_float32_decoders_with_the_opt_in_rule_take_the_decoder_kernels(name):
    """``+contrib-float32-cache-attention`` lifts the float32 refusal above for rotated heads over a KV cache:
    each layer becomes AttentionInputs, DecodeAttention and the If whose else branch is the
    MultiHeadAttention, as in float16; prefill long enough for that branch (12 tokens: 24 rows per
    key/value head), a short prefill and decode (DecodeAttention) match the float64 reference at float32's
    tolerance."""
    model = load_testdata(name)
    result = onnxfuse.optimize(model, only=["+contrib-float32-cache-attention"], samples=2)
    assert result.validation.passed, result.validation
    assert result.applied.counts["contrib-float32-cache-attention"] == LAYERS, result.applied.refusals
    ops = Counter(op_types_within(result.model))
    assert ops["Softmax"] == 0 and ops["MultiHeadAttention"] == LAYERS, ops  # inside the Ifs
    assert ops["AttentionInputs"] == ops["DecodeAttention"] == ops["If"] == LAYERS, ops
    rng = np.random.default_rng(41)
    for batch, new, past in ((2, 12, 0), (2, 5, 0), (3, 1, 6)):
        feeds = kv_cache_feeds(batch, new, past, np.float32, rng)
        exact = run_float64(model, feeds)
        got = dict(zip([o.name for o in result.model.graph.output], run_optimized(result.model, feeds)))
        for out, want in exact.items():
            err = float(np.abs(got[out].astype(np.float64) - want).max()) / max(1.0, float(np.abs(want).max()))
            assert err <= 1e-4, f"{out} at batch {batch}, {new} new, {past} cached: {err:.2e}"


def test_the_opt_in_rule_adds_no_other_case():
    """On a float16 decoder contrib-attention fused every layer already; alone (contrib-attention skipped)
    the opt-in rule takes only float32 cache attention, so nothing here."""
    result = onnxfuse.optimize(load_testdata("llama_kv_opset17_fp16"), validate=False,
                               only=["+contrib-float32-cache-attention"], skip=["contrib-attention"])
    assert result.applied.counts.get("contrib-float32-cache-attention", 0) == 0
    assert any(r.rule == "contrib-float32-cache-attention" and "not a float32 attention" in r.reason
               for r in result.applied.refusals)
