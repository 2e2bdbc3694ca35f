"""Attention in torch's dynamo exports (``torch.onnx.export``'s default exporter since torch 2.9).

onnxscript writes scaled-dot-product attention differently from the TorchScript exporter: every view
is ``Reshape(allowzero=1)`` with targets computed from ``Shape`` (reshape-allowzero,
constant-reshape-target), Kᵀ goes through rank 3 (merged-axes-transpose), a masked Softmax is followed
by ``Where(IsNaN(p), 0, p)`` (contrib-attention's NaN guard), and later layers read their sizes from the
first layer's tensors. Before those rules no attention of these models was fused. Each model here must
come out with every Softmax in one ``Attention``, pass validation, and match the original on ONNX Runtime
CPU and an independent float64 reference (the original graph in float64 on onnx's reference evaluator)
with right and left padding (GPT-2's left padding leaves query rows with every key masked).

Models: ``testdata/export_transformers.py --dynamo`` (BERT, RoBERTa, DistilBERT, GPT-2 without cache, ViT,
Whisper encoder; opset 18, sdpa).
"""

from __future__ import annotations

import numpy as np
import pytest

import onnxfuse
from helpers import load_testdata, run_float64, run_ort
from test_attention_exports import run_optimized

MODELS = {f"{arch}_tiny_dynamo": 2 for arch in ("bert", "roberta", "distilbert", "gpt2", "vit", "whisper_encoder")}


def _feeds(name, batch, seq, rng):
    if name.startswith("vit"):
        return {"pixel_values": rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)}
    if name.startswith("whisper"):
        return {"input_features": rng.standard_normal((batch, 16, 32)).astype(np.float32)}
    mask = np.ones((batch, seq), np.int64)
    mask[0, seq - 3:] = 0  # right padding
    if batch > 1:
        mask[1, :4] = 0  # left padding: GPT-2's first queries of this row see no key
    return {"input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64), "attention_mask": mask}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_attention_of_a_dynamo_export_is_fused(name):
    model = load_testdata(name)
    before = [n.op_type for n in model.graph.node]
    assert before.count("Softmax") == MODELS[name]
    assert any(n.op_type == "Reshape" and any(a.name == "allowzero" and a.i == 1 for a in n.attribute)
               for n in model.graph.node)  # the export's own form, which the rules must handle
    result = onnxfuse.optimize(model, provider="cpu", samples=2)
    assert result.validation.passed
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("Attention") == MODELS[name] and "Softmax" not in ops, result.applied.refusals
    assert "IsNaN" not in ops
    if name.startswith("bert"):
        # its position Slice ends at Shape(attention_mask)[1], declared with the ids' sequence name
        assert ops.count("EmbedLayerNormalization") == 1 and "LayerNormalization" not in ops
    rng = np.random.default_rng(3)
    for batch, seq in ((3, 12), (2, 7), (1, 5)):
        feeds = _feeds(name, batch, seq, rng)
        want = run_ort(model, feeds)
        got = run_optimized(result.model, feeds)
        exact = run_float64(model, feeds)
        for (out, a), b in zip(want.items(), got):
            assert np.isfinite(a).all()
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4, err_msg=f"{out} at {batch}x{seq}")
            np.testing.assert_allclose(b, exact[out], rtol=1e-4, atol=1e-4, err_msg=f"{out} at {batch}x{seq}, float64")


def test_nan_guard_with_a_mask_that_may_be_minus_inf_is_refused():
    """The guard zeroes rows whose every score is -inf; with an additive mask the rule cannot prove
    finite, fusing would leave NaN there: refused with the reason, the graph kept."""
    import onnx
    from contrib_testlib import fuse

    from onnxfuse.rewrites.contrib.contrib_attention import ContribAttention

    text = """
    g (float[2,3,4] x, float[2,1,3,3] m) => (float[2,3,4] y) {
        q = MatMul(x, wq)
        k = MatMul(x, wk)
        v = MatMul(x, wv)
        t4 = Constant <value = int64[4] {0, 0, 2, 2}> ()
        qh = Reshape(q, t4)
        kh = Reshape(k, t4)
        vh = Reshape(v, t4)
        qt = Transpose <perm = [0, 2, 1, 3]> (qh)
        kt = Transpose <perm = [0, 2, 3, 1]> (kh)
        vt = Transpose <perm = [0, 2, 1, 3]> (vh)
        s = MatMul(qt, kt)
        sm = Add(s, m)
        p = Softmax <axis = -1> (sm)
        n = IsNaN(p)
        z = Constant <value = float {0.0}> ()
        pg = Where(n, z, p)
        o = MatMul(pg, vt)
        ot = Transpose <perm = [0, 2, 1, 3]> (o)
        t3 = Constant <value = int64[3] {0, 0, 4}> ()
        y = Reshape(ot, t3)
    }
    """
    rng = np.random.default_rng(0)
    inits = {w: rng.standard_normal((4, 4)).astype(np.float32) for w in ("wq", "wk", "wv")}
    model = onnx.parser.parse_model('<ir_version: 8, opset_import: ["" : 17]>\n' + text)
    for name, value in inits.items():
        model.graph.initializer.append(onnx.numpy_helper.from_array(value, name))
    rule = ContribAttention()
    out, report = fuse(model, rule)
    assert report.counts[rule.name] == 0
    assert any("NaN guard" in r.reason for r in report.refusals if r.rule == rule.name), report.refusals
    # the same graph with a mask of -inf rows shows why: the original zeroes them
    feeds = {"x": rng.standard_normal((2, 3, 4)).astype(np.float32),
             "m": np.where(rng.random((2, 1, 3, 3)) < 0.5, -np.inf, 0).astype(np.float32)}
    feeds["m"][0, 0, 1] = -np.inf
    want = run_ort(model, feeds)["y"]
    assert not np.isnan(want).any() and (want[0, 1] == 0).all()


def test_gpt2_dynamo_under_precision_fp16_fuses_its_float32_islands():
    """--precision fp16 keeps each masked Softmax in float32 (finfo.min masks); the island now keeps the
    exporter's NaN guard with it, so contrib-attention sees the island's form and fuses it (before: the
    weights went down to float16 and back up to meet the guard's float32 0, and nothing was fused)."""
    model = load_testdata("gpt2_tiny_dynamo")
    result = onnxfuse.optimize(model, provider="cpu", samples=2, precision="fp16")
    assert result.validation.passed
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("Attention") == 2 and "Softmax" not in ops and "IsNaN" not in ops, result.applied.refusals
    rng = np.random.default_rng(4)
    feeds = _feeds("gpt2_tiny_dynamo", 3, 12, rng)
    want = run_ort(model, feeds)
    got = run_optimized(result.model, feeds)
    for (out, a), b in zip(want.items(), got):
        np.testing.assert_allclose(b.astype(np.float32), a, rtol=2e-2, atol=2e-2, err_msg=out)


def test_position_slice_of_an_input_declared_otherwise_is_refused():
    """The BERT export's position Slice ends at attention_mask's dimension 1; declared under another name
    than the ids' sequence, nothing says it is the ids' length: the embeddings stay unfused."""
    from onnxfuse.pipeline import rewrite_model
    from onnxfuse.rewrites import select_rules

    model = load_testdata("bert_tiny_dynamo")
    mask = next(i for i in model.graph.input if i.name == "attention_mask")
    mask.type.tensor_type.shape.dim[1].dim_param = "mask_length"
    out, report = rewrite_model(model, select_rules("cuda"))
    ops = [n.op_type for n in out.graph.node]
    assert "EmbedLayerNormalization" not in ops
    assert [r for r in report.refusals if r.rule == "contrib-embed-layernorm"]  # refused, with its reason
