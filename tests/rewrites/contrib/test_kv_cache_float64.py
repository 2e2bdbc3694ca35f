"""KV-cache decoders against an independent float64 reference (issue 31): the legacy exports
(``llama_kv_opset{14,17}``, ``qwen2_kv_opset{14,17}``, float32 and float16) and a decoder through torch's
dynamo exporter (issue 31's dynamo row): testdata
``llama_kv_dynamo[_fp16]`` (``export_transformers.py --kv-dynamo``: tiny Llama, 4 query heads sharing 2
key/value heads, 2 layers, sdpa, opset 18, dynamic batch, sequence and past). The exporter computes
repeat_kv's Expand target as ``Shape(past)[2] + Shape(input_ids)[1]``: repeat-heads-gather proves that
sum equal to the length of ``Concat(past, new)`` term by term (``shape_values.concat_length``), so each
repeat becomes one Gather. Every attention is fused, float32 (a cache's rotated heads: policy.cache_key)
as float16, each layer AttentionInputs, DecodeAttention for decode steps and MultiHeadAttention for
prefill (docs/benchmarks.md 5.34 measured the float32 decoder faster so in every cell). Both validate with no ``--shape`` and match the float32 export evaluated in float64 (onnx's
reference evaluator) at prefill (empty cache) and decode (one new token) with left padding."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import onnxfuse
from helpers import kv_cache_feeds, load_testdata, op_types_within, run_float64
from test_attention_exports import run_optimized

LAYERS = 2


@pytest.mark.parametrize("name", ["llama_kv_dynamo_fp16", "llama_kv_dynamo"])
def test_dynamo_kv_cache_decoder_fuses_and_matches_a_float64_reference(name):
    half = name.endswith("fp16")
    result = onnxfuse.optimize(load_testdata(name), samples=2)
    assert result.validation.passed, result.validation
    ops = Counter(op_types_within(result.model))
    assert result.applied.counts.get("repeat-heads-gather") == 2 * LAYERS, result.applied.refusals
    assert ops["ReduceMean"] == 0 and ops["SkipSimplifiedLayerNormalization"] == 2 * LAYERS, ops
    assert ops["RotaryEmbedding"] + 2 * ops["AttentionInputs"] == 2 * LAYERS, ops  # or inside AttentionInputs
    assert ops["MultiHeadAttention"] == ops["DecodeAttention"] == LAYERS and ops["Softmax"] == 0, result.unfused
    reference = load_testdata("llama_kv_dynamo")  # the float32 export: the weights of both, unrounded
    rng = np.random.default_rng(31)
    tol = 2e-2 if half else 1e-4
    for batch, new, past in ((2, 5, 0), (3, 1, 6)):  # prefill, decode
        feeds = kv_cache_feeds(batch, new, past, np.float16 if half else np.float32, rng)
        exact = run_float64(reference, {k: v.astype(np.float32) if v.dtype == np.float16 else v
                                        for k, v in feeds.items()})
        got = dict(zip([o.name for o in result.model.graph.output], run_optimized(result.model, feeds)))
        for out, want in exact.items():
            scale = max(1.0, float(np.abs(want).max()))
            err = float(np.abs(got[out].astype(np.float64) - want).max()) / scale
            assert err <= tol, f"{out} at batch {batch}, {new} new, {past} cached: {err:.2e}"


@pytest.mark.parametrize("name", [f"{arch}_kv_opset{opset}{suffix}" for arch in ("llama", "qwen2")
                                  for opset in (14, 17) for suffix in ("", "_fp16")])
def test_legacy_kv_cache_decoders_match_a_float64_reference(name):
    """The legacy exports (``export_transformers.py --kv-cache``) on the same prefill and decode inputs:
    each float16 model against its float32 twin (same seed, same weights) evaluated in float64."""
    half = name.endswith("_fp16")
    result = onnxfuse.optimize(load_testdata(name), samples=2)
    assert result.validation.passed, result.validation
    ops = Counter(op_types_within(result.model))
    assert ops["MultiHeadAttention"] == ops["DecodeAttention"] == LAYERS and ops["Softmax"] == 0, result.unfused
    reference = load_testdata(name.removesuffix("_fp16"))
    rng = np.random.default_rng(17)
    tol = 2e-2 if half else 1e-4
    for batch, new, past in ((2, 5, 0), (3, 1, 6)):
        feeds = kv_cache_feeds(batch, new, past, np.float16 if half else np.float32, rng)
        exact = run_float64(reference, {k: v.astype(np.float32) if v.dtype == np.float16 else v
                                        for k, v in feeds.items()})
        got = dict(zip([o.name for o in result.model.graph.output], run_optimized(result.model, feeds)))
        for out, want in exact.items():
            err = float(np.abs(got[out].astype(np.float64) - want).max()) / max(1.0, float(np.abs(want).max()))
            assert err <= tol, f"{out} at batch {batch}, {new} new, {past} cached: {err:.2e}"

