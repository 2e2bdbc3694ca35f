"""contrib-attention on real exports: every attention Softmax of each committed model becomes one
com.microsoft Attention (q, k, v projected from one tensor: packed) or MultiHeadAttention after the
default rules, validation passes, and the optimized model matches the original on ONNX Runtime CPU,
with real padding (attention_mask rows ending in zeros) where the model takes a mask. The ViT's float32
sequence-first attention is left unfused by measurement (refused with the reason) and fuses under
``--precision fp16``.

Models (testdata/export_transformers.py --attention, testdata/export_fusion_models.py): GPT-2 without KV
cache (causal Where mask + padding mask, packed QKV by Split), DistilBERT (masked_fill Where mask),
RoBERTa ([0, -1, H, D] head targets), the Whisper encoder (q scaled before the split, k_proj without
bias), the torchvision-style ViT (nn.MultiheadAttention: sequence-first [B·H, S, D] heads, scale split
over q and k), and the BERT export for reference.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import onnxfuse
from helpers import load_testdata, run_ort
from onnxfuse.custom_ops import session_options
from onnxfuse.rewrites import RULES

RULE = "contrib-attention"
NAMES = [r.name for r in RULES if "cuda" in r.targets and not r.opt_in]

# model → (layers, expected: layout, fused op, mask terms)
MODELS = {
    "gpt2_tiny_opset14": (2, "batch-first", "Attention", ["add", "where"]),  # q, k, v cut by Split from one Gemm
    "distilbert_tiny_opset14": (2, "batch-first", "Attention", ["where"]),
    "roberta_tiny_opset14": (2, "batch-first", "Attention", ["add"]),
    "whisper_encoder_tiny_opset14": (2, "batch-first", "Attention", []),
    "bert_tiny_opset14": (2, "batch-first", "Attention", ["add"]),
}


def feeds_for(name, model):
    rng = np.random.default_rng(7)
    if "whisper" in name:
        return {"input_features": rng.standard_normal((3, 16, 32)).astype(np.float32)}
    if "vit" in name:
        return {model.graph.input[0].name: rng.standard_normal((3, 3, 32, 32)).astype(np.float32)}
    ids = rng.integers(0, 1000, (3, 12)).astype(np.int64)
    mask = np.ones((3, 12), np.int64)
    mask[0, 7:] = 0  # trailing padding
    mask[2, 3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def run_optimized(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_attention_softmax_becomes_one_fused_attention(name):
    layers, layout, op, terms = MODELS[name]
    model = load_testdata(name)
    assert RULE in NAMES  # on by default
    assert [n.op_type for n in model.graph.node].count("Softmax") == layers
    result = onnxfuse.optimize(model, only=NAMES, provider="cpu", samples=3)
    refusals = [r.reason for r in result.applied.refusals if r.rule == RULE]
    assert result.applied.counts[RULE] == layers, refusals
    assert result.validation.passed
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count(op) == layers and "Softmax" not in ops
    details = [d for d in result.applied.details if d["rule"] == RULE]
    assert {d["layout"] for d in details} == {layout}
    assert {d["op"] for d in details} == {f"com.microsoft.{op}"}
    assert all(d["mask_terms"] == terms for d in details), details
    feeds = feeds_for(name, model)
    want = run_ort(model, feeds)
    got = run_optimized(result.model, feeds)
    for (out, a), b in zip(want.items(), got):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4, err_msg=out)


def test_vit_float32_packs_into_attention_reading_the_batch_first_input():
    """torch.nn.MultiheadAttention(batch_first=True): Transpose(x) to [S, B, E], one in_proj cut by the
    unflatten into q, k, v, heads, out_proj on [S·B, E] rows, Transpose back. The packed Attention reads
    x itself; the Transpose of its output and the one after out_proj cancel (cancel-row-transposes), so
    no Transpose is left in the blocks, and every residual LayerNorm after an attention becomes
    SkipLayerNormalization. Checked against ONNX Runtime on the original at two batch sizes."""
    model = load_testdata("vit_blocks_opset14")
    result = onnxfuse.optimize(model, provider="cpu", samples=2)
    assert result.validation.passed
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("Attention") == 2 and "Softmax" not in ops and "MultiHeadAttention" not in ops
    assert result.applied.counts["cancel-row-transposes"] == 2
    assert ops.count("Transpose") == 1  # the patch embedding's [B, E, N] → [B, N, E], not an attention's
    assert ops.count("SkipLayerNormalization") == 5  # and the first block's: patches + [1, N, E] positions
    details = [d for d in result.applied.details if d["rule"] == RULE]
    assert {d["layout"] for d in details} == {"sequence-first"} and all(d["qkv_packed"] for d in details)
    for batch in (1, 3):
        feeds = {"input": np.random.default_rng(batch).standard_normal((batch, 3, 32, 32)).astype(np.float32)}
        want = run_ort(model, feeds)
        got = run_optimized(result.model, feeds)
        for (out, a), b in zip(want.items(), got):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5, err_msg=out)


def test_vit_in_float16_every_softmax_becomes_attention_and_validates():
    """torch's nn.MultiheadAttention multiplies q and k each by sqrt(1/sqrt(D)) (computed from shapes,
    constant after fold-constants): Attention gets their product 1/sqrt(D), here in float16
    (--precision fp16), validated against the float32 original."""
    model = load_testdata("vit_blocks_opset14")
    result = onnxfuse.optimize(model, provider="cpu", samples=2, precision="fp16")
    assert result.validation.passed
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("Attention") == 2 and "Softmax" not in ops
    details = [d for d in result.applied.details if d["rule"] == RULE]
    assert [d["num_heads"] for d in details] == [4, 4] and {d["layout"] for d in details} == {"sequence-first"}
    assert all(d["scale"] == pytest.approx(16 ** -0.5, rel=1e-3) for d in details)


def test_whisper_q_scale_before_the_split_is_the_attention_scale():
    result = onnxfuse.optimize(load_testdata("whisper_encoder_tiny_opset14"), only=NAMES, provider="cpu",
                               validate=False)
    details = [d for d in result.applied.details if d["rule"] == RULE]
    assert all(d["scale"] == pytest.approx(32 ** -0.5, rel=1e-6) for d in details)
    # k_proj has no bias: its third of the packed [3E] bias is zeros
    import onnx.numpy_helper as nh

    att = [n for n in result.model.graph.node if n.op_type == "Attention"]
    inits = {i.name: nh.to_array(i) for i in result.model.graph.initializer}
    assert len(att) == 2
    for n in att:
        bias = inits[n.input[2]]
        assert bias.shape == (3 * 64,) and not bias[64:128].any() and bias[:64].any() and bias[128:].any()


#: what the LayerNorm that is not after a residual Add becomes: the encoders' embeddings LayerNorm, the
#: pre-norm decoders' final one
FIRST_OR_LAST_LAYERNORM = {
    # words + token type 0 + P[0:S] with a dynamic S (DistilBERT: no token types, S read from the words'
    # Shape): the sum is provably [B, S, H] (facts/proven_dims.py), then one EmbedLayerNormalization
    "bert_tiny_opset14": "EmbedLayerNormalization", "distilbert_tiny_opset14": "EmbedLayerNormalization",
    # positions computed at run time from the ids (two run-time lookups and a constant row): the
    # Add(words + types, positions) is of two [B, S, H] tensors, a SkipLayerNormalization
    "roberta_tiny_opset14": "SkipLayerNormalization",
    # pre-norm: the first block's LayerNorm reads the token (or conv) embeddings [B, S, H] plus the position
    # embeddings [1, S, H], a skip ONNX Runtime's kernels broadcast: a SkipLayerNormalization too
    "gpt2_tiny_opset14": "SkipLayerNormalization", "whisper_encoder_tiny_opset14": "SkipLayerNormalization",
}


@pytest.mark.parametrize("name", sorted(FIRST_OR_LAST_LAYERNORM))
def test_every_residual_layernorm_becomes_skip_layernorm(name):
    """Two residual LayerNorms per layer become SkipLayerNormalization. Post-norm encoders (BERT,
    DistilBERT, RoBERTa): the one after attention needs the residual and the attention output proven
    the same shape through the head merge's Reshape (shapes inferred again after constant-reshape-target,
    the merge Reshape dropped as an identity and its invented dims renamed); the embeddings' LayerNorm
    becomes what :data:`FIRST_OR_LAST_LAYERNORM` says. Pre-norm (GPT-2, Whisper): the residual stream is
    read again by the next block, so it is the op's fourth output; GPT-2 needs its Conv1D projections as
    MatMuls (gemm-rows-to-matmul) for the batch to be provable; the first block's LayerNorm reads the
    embeddings plus a broadcast [1, S, H] position skip."""
    layers = MODELS[name][0]
    model = load_testdata(name)
    result = onnxfuse.optimize(model, only=NAMES, provider="cpu", samples=2)
    assert result.validation.passed
    ops = [n.op_type for n in result.model.graph.node]
    extra = FIRST_OR_LAST_LAYERNORM[name]
    assert ops.count("SkipLayerNormalization") == 2 * layers + (extra == "SkipLayerNormalization")
    assert ops.count("LayerNormalization") == (extra == "LayerNormalization")
    assert ops.count("EmbedLayerNormalization") == (extra == "EmbedLayerNormalization")
    feeds = feeds_for(name, model)
    want = run_ort(model, feeds)
    got = run_optimized(result.model, feeds)
    for (out, a), b in zip(want.items(), got):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4, err_msg=out)
