"""contrib-grouped-attention-inputs: AttentionInputs writes the query as n rows per key/value head and the
MultiHeadAttention reads the un-repeated presents, with the out-projection's weight rows permuted.

Checked against the original model (ONNX Runtime's CPU provider running the original export, an
independent computation) at prefill, decode and a batch of several new tokens over a cache with a
left-padded row, on the float16 testdata decoders with grouped queries; the rewritten graph's shape
(grouped spec, G heads, presents read directly, one shared bias Expand, no repeated heads left); and
the refusal when the out-projection's weight is not a constant."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxfuse
from helpers import load_testdata
from onnxfuse.custom_ops import session_options

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu"))
from test_kv_cache_gpu import LAYERS, _assert_equal_at_real_tokens  # noqa: E402  (the same checks, on the CPU here)

RULE = "contrib-grouped-attention-inputs"


def _attention_nodes(model):
    inputs = [n for n in model.graph.node if n.op_type == "AttentionInputs"]
    attention = [n for n in model.graph.node if n.op_type == "MultiHeadAttention"]
    return inputs, attention


def _attr(node, name):
    return next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name)


@pytest.mark.parametrize("name", ["qwen2_kv_opset14_fp16", "mistral_kv_opset17_fp16", "llama_kv_dynamo_fp16",
                                  "optimum_llama_kv_fp16", "phi3_kv_opset17_fp16", "gemma_kv_opset17_fp16"])
def test_grouped_rows_equal_the_original_at_prefill_decode_and_chunks(name):
    model = load_testdata(name)  # without contrib-decode-attention: every step on the grouped MultiHeadAttention
    result = onnxfuse.optimize(model, samples=2, skip=["contrib-decode-attention"])
    assert result.validation.passed and result.applied.counts[RULE] == LAYERS, result.applied.refusals
    inputs, attention = _attention_nodes(result.model)
    kv_heads = next(i.type.tensor_type.shape.dim[1].dim_value for i in model.graph.input if i.name.startswith("past"))
    for node in inputs:
        assert b"grouped=1" in _attr(node, "spec") and len(node.output) == 3
    presents = {o.name for o in result.model.graph.output if o.name.startswith("present")}
    for node in attention:  # over the key/value heads, reading the presents themselves
        assert _attr(node, "num_heads") == kv_heads and {node.input[1], node.input[2]} <= presents
    expands = Counter(n.name.rsplit("/", 1)[-1] for n in result.model.graph.node if n.op_type == "Expand")
    # one bias shared by the layers, one Expand for it: dynamo's layers share it too, their keys' lengths
    # (each layer's Concat(past, new), named anew by ONNX's inference) proved past + sequence alike
    assert expands["bias_repeat"] == len({n.input[5] for n in attention}) == 1, expands
    original = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    fused = ort.InferenceSession(result.model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    _assert_equal_at_real_tokens(original, fused, ((2, 6, 0), (3, 1, 9), (2, 3, 4)), np.random.default_rng(21))


def test_the_repeated_heads_stay_without_the_rule():
    result = onnxfuse.optimize(load_testdata("qwen2_kv_opset14_fp16"), validate=False, skip=[RULE])
    inputs, attention = _attention_nodes(result.model)
    assert len(inputs) == LAYERS and all(len(n.output) == 5 and b"grouped" not in _attr(n, "spec") for n in inputs)
    assert all(_attr(n, "num_heads") == 4 for n in attention)


def test_refused_when_the_out_projection_weight_is_not_a_constant():
    """Layer 0's out-projection weight made a graph input: its rows cannot be permuted, so that layer keeps
    its repeated heads (and says why) while layer 1 is regrouped, and the whole still validates."""
    model = load_testdata("qwen2_kv_opset14_fp16")
    o_proj = next(n for n in model.graph.node if n.op_type == "MatMul" and "layers.0/self_attn/o_proj" in n.name)
    weight = next(i for i in model.graph.initializer if i.name == o_proj.input[1])
    model.graph.initializer.remove(weight)
    model.graph.input.append(onnx.helper.make_tensor_value_info(weight.name, weight.data_type, list(weight.dims)))
    result = onnxfuse.optimize(model, samples=2)
    assert result.validation.passed, result.validation
    assert result.applied.counts[RULE] == LAYERS - 1
    assert any(r.rule == RULE and "constant [H·D, E] weight" in r.reason for r in result.applied.refusals)
    inputs, _ = _attention_nodes(result.model)
    assert sorted(len(n.output) for n in inputs) == [3, 5]
