"""KV-cache decoders of the other Llama-family architectures (issue 31), float16 and float32, legacy
exporter, opset 17 (testdata ``*_kv_opset17_fp16`` and ``*_kv_opset17``, made by ``export_transformers.py
--kv-families [--float32]``, the same weights): Mistral, Phi-3 (q, k, v in one ``qkv_proj`` cut by Slice;
full and partial rotation), Gemma (one key/value head, RMSNorm weight 1 + w) and Qwen3 (per-head q and k
RMSNorm before the rotary). Every attention, rotary embedding and RMSNorm fuses, validated against the
original on ONNX Runtime's CPU provider at prefill and decode sizes; the float32 ones also against the
export evaluated in float64 at prefill (both branches of the decode If) and decode."""

from __future__ import annotations

from collections import Counter

import pytest

import onnxfuse
from helpers import load_testdata, op_types_within

LAYERS = 2
#: name → (RMSNorms without a residual Add, per-layer q/k/v MatMuls packed by pack-sibling-matmuls)
FAMILIES = {
    "mistral_kv_opset17_fp16": (1, True),
    "phi3_kv_opset17_fp16": (1, False),  # already one qkv_proj: its Slices are the attention's input
    "phi3_partial_kv_opset17_fp16": (1, False),
    "gemma_kv_opset17_fp16": (1, True),
    "qwen3_kv_opset17_fp16": (1 + 2 * LAYERS, True),  # the first layer norm, and q_norm, k_norm per layer
}
FAMILIES.update({name.removesuffix("_fp16"): v for name, v in list(FAMILIES.items())})  # the float32 twins
#: Families whose attention inputs contrib-attention-inputs does not take, and why.
NO_ATTENTION_INPUTS = {name: "q and k are RMS-normalised per head before the rotation"
                       for name in ("qwen3_kv_opset17_fp16", "qwen3_kv_opset17")}


def _ops(model) -> Counter:
    """Op counts, If branches included (contrib-decode-attention puts the MultiHeadAttention in one)."""
    return Counter(op_types_within(model))


@pytest.mark.parametrize("name", FAMILIES)
def test_family_decoder_attention_rotary_norms_and_repeats_fused(name):
    standalone, packed = FAMILIES[name]
    result = onnxfuse.optimize(load_testdata(name), samples=2)
    assert result.validation.passed, result.validation
    ops = _ops(result.model)
    refusals = [(r.rule, r.reason) for r in result.applied.refusals]
    assert ops["MultiHeadAttention"] == LAYERS and ops["Softmax"] == 0, refusals
    # each layer rotates q and k: two RotaryEmbedding, or inside its AttentionInputs (float16 on CUDA)
    assert ops["RotaryEmbedding"] + 2 * ops["AttentionInputs"] == 2 * LAYERS and ops["Neg"] == 0, refusals
    # every RMSNorm: the residual ones (two per layer, minus the first layer's input norm, plus the final
    # norm) with their Add, the rest alone
    assert ops["ReduceMean"] == 0 and ops["Pow"] == 0, refusals
    assert ops["SkipSimplifiedLayerNormalization"] == 2 * LAYERS, ops
    assert ops["RMSNormalization"] == standalone, ops
    taken = name not in NO_ATTENTION_INPUTS
    assert ops["AttentionInputs"] == (LAYERS if taken else 0), ops
    # each layer's q/k/v cut: the Split the packing made, Phi-3's Slices of its qkv_proj, or inside AttentionInputs
    assert ops["Split"] == (LAYERS if packed and not taken else 0), ops
    repeats = [n for n in result.model.graph.node if n.op_type == "Gather"
               and any(a.name == "axis" and a.i == 1 for a in n.attribute)]
    assert len(repeats) + 2 * ops["AttentionInputs"] == 2 * LAYERS, ops
    names = {o.name for o in result.model.graph.output}
    assert {f"present.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")} <= names


def test_partial_rotary_rotates_the_sliced_part_and_passes_the_rest_through():
    # Phi-3 with partial_rotary_factor 0.5: rotate_half over the first 8 of 16 head dimensions, the other 8
    # concatenated back as they are: one RotaryEmbedding over the whole head with rotary_embedding_dim 8
    # (the Slices and the Concat go with it).
    result = onnxfuse.optimize(load_testdata("phi3_partial_kv_opset17_fp16"), samples=2)
    assert result.validation.passed, result.validation
    details = [d for d in result.applied.details if d["rule"] == "contrib-rotary-embedding"]
    assert len(details) == 2 * LAYERS and {d.get("rotary_embedding_dim") for d in details} == {8}, details


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_decoders_match_a_float64_reference(name):
    """Every family decoder, fused (AttentionInputs, DecodeAttention and the If where the family takes them),
    against its float32 export (the same weights) evaluated in float64 by onnx's reference evaluator: a
    prefill long enough for the If's MultiHeadAttention branch, a short one for DecodeAttention, and
    decode, with left padding; float16 within 2e-2 or twice the float16 export's own error, float32 within
    1e-4."""
    import numpy as np

    from test_kv_cache_float64 import assert_matches_float64

    model = load_testdata(name)
    result = onnxfuse.optimize(model, samples=1)
    assert result.validation.passed, result.validation
    past = next(i for i in model.graph.input if i.name.startswith("past_key_values"))
    kv_heads, head = (d.dim_value for d in past.type.tensor_type.shape.dim[1::2])
    assert_matches_float64(result.model, load_testdata(name.removesuffix("_fp16")), ((2, 12, 0), (2, 5, 0), (3, 1, 6)),
                           name.endswith("_fp16"), np.random.default_rng(43), original=model if name.endswith("_fp16") else None,
                           kv_heads=kv_heads, head=head)
