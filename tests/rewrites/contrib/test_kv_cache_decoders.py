"""KV-cache decoders as exported (issue 31), float16 and float32, legacy opset 14 and 17, transformers 5.24
and 5.17: what fuses (attention as MultiHeadAttention over the cache, the rotary embeddings, repeat_kv,
the packed projections), validated against the original on ONNX Runtime's CPU provider at prefill and
decode sizes; float32 as float16 (a cache's rotated heads fuse in float32: docs/benchmarks.md 5.34)."""

from __future__ import annotations

from collections import Counter

import pytest

import onnxfuse
from helpers import load_testdata, op_types_within

LAYERS = 2
FP16 = ["llama_kv_opset14_fp16", "llama_kv_opset17_fp16", "qwen2_kv_opset14_fp16", "qwen2_kv_opset17_fp16",
        "qwen2_kv_opset17_fp16_tx517"]
FP32 = ["llama_kv_opset17", "qwen2_kv_opset14"]


def _ops(model) -> Counter:
    """Op counts, If branches included (contrib-decode-attention puts the MultiHeadAttention in one)."""
    return Counter(op_types_within(model))


@pytest.mark.parametrize("name", FP16 + FP32)
def test_decoder_attention_rotary_and_repeats_fused(name):
    # without contrib-attention-inputs, to see the rules before it: each one's own fusion
    result = onnxfuse.optimize(load_testdata(name), samples=2, skip=["contrib-attention-inputs"])
    assert result.validation.passed, result.validation
    ops = _ops(result.model)
    assert ops["MultiHeadAttention"] == LAYERS and ops["Softmax"] == 0, result.applied.refusals
    assert ops["RotaryEmbedding"] == 2 * LAYERS and ops["Neg"] == 0, ops
    assert ops["Split"] == LAYERS, ops  # q, k, v: one packed MatMul per layer
    repeats = [n for n in result.model.graph.node if n.op_type == "Gather"  # repeat_kv along the heads axis
               and any(a.name == "axis" and a.i == 1 for a in n.attribute)]
    assert len(repeats) == 2 * LAYERS, ops
    names = {o.name for o in result.model.graph.output}
    assert {f"present.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")} <= names
    # the default: all of that data movement in front of each attention is one AttentionInputs node
    default = onnxfuse.optimize(load_testdata(name), samples=2)
    assert default.validation.passed, default.validation
    ops = _ops(default.model)
    assert ops["AttentionInputs"] == LAYERS and ops["MultiHeadAttention"] == LAYERS, default.applied.refusals
    assert ops["RotaryEmbedding"] == ops["Split"] == 0, ops
    produced = {o: n.op_type for n in default.model.graph.node for o in n.output}
    assert {produced[f"present.{i}.{kv}"] for i in range(LAYERS) for kv in ("key", "value")} == {"AttentionInputs"}

