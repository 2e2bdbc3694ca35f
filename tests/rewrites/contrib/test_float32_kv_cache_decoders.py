"""Float32 KV-cache decoders take the decoder kernels as float16 ones do: contrib-attention fuses a
cache's rotated heads in float32 too (``attention/policy.cache_key``; the whole float32 decoder measured
faster so in every cell, docs/benchmarks.md 5.34), and the decoder rules after it make each layer
AttentionInputs, DecodeAttention and an If whose else branch is the MultiHeadAttention. Against the
float32 export evaluated in float64 (onnx's reference evaluator) at a prefill on each branch of the If
and at decode, with left padding. The same attention without a cache (prefill-only Llama blocks) keeps
its measured float32 refusal: tests/rewrites/contrib/test_attention_given_heads.py."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import onnxfuse
from helpers import load_testdata, op_types_within
from test_kv_cache_float64 import assert_matches_float64

LAYERS = 2


@pytest.mark.parametrize("name", ["llama_kv_opset14", "qwen2_kv_opset17", "llama_kv_dynamo"])
def test_float32_decoders_take_the_decoder_kernels(name):
    """Prefill long enough for the If's else branch (12 tokens: 24 rows per key/value head), a short
    prefill and decode (DecodeAttention) match the float64 reference at float32's tolerance."""
    model = load_testdata(name)
    result = onnxfuse.optimize(model, samples=2)
    assert result.validation.passed, result.validation
    assert result.applied.counts["contrib-attention"] == LAYERS, result.applied.refusals
    ops = Counter(op_types_within(result.model))
    assert ops["Softmax"] == 0 and ops["MultiHeadAttention"] == LAYERS, ops  # inside the Ifs
    assert ops["AttentionInputs"] == ops["DecodeAttention"] == ops["If"] == LAYERS, ops
    assert_matches_float64(result.model, model, ((2, 12, 0), (2, 5, 0), (3, 1, 6)), False, np.random.default_rng(41))
