"""transformers' default attention (sdpa) through torch's legacy exporter (issue 30): every Softmax of
the six tiny architectures, opset 14 and 17, becomes one fused attention op and the optimized model
matches the original on ONNX Runtime CPU and an independent float64 reference (the original graph in
float64 on onnx's reference evaluator), with padded rows and a row whose every key is masked.

The encoders' export adds ``Where(keep, 0, -inf)`` and guards the Softmax with ``Where(IsNaN(p), 0, p)``:
a row with no key kept is NaN, then 0, in the original. The fused op takes the keep mask raw (fill
finfo(float32).min) and its output is multiplied by ``max(keep over the keys)``; before this, the guard
was a refusal and all 12 Softmax stayed (testdata/export_transformers.py --sdpa)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import onnxfuse
from helpers import load_testdata, run_float64, run_ort
from onnxfuse.custom_ops import session_options

ARCHS = ["bert", "roberta", "distilbert", "gpt2", "vit", "whisper_encoder"]
MODELS = [f"{a}_tiny_sdpa_opset{o}" for o in (14, 17) for a in ARCHS]
FUSED = ("Attention", "MultiHeadAttention")


def feeds_for(name, model, rng):
    if "whisper" in name:
        return {"input_features": rng.standard_normal((3, 16, 32)).astype(np.float32)}
    if "vit" in name:
        return {model.graph.input[0].name: rng.standard_normal((3, 3, 32, 32)).astype(np.float32)}
    ids = rng.integers(0, 1000, (4, 12)).astype(np.int64)
    mask = np.ones((4, 12), np.int64)
    mask[0, 7:] = 0  # right padding
    mask[1, :5] = 0  # left padding
    mask[3, :] = 0  # no key kept at all: the guard's row
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("name", MODELS)
def test_every_softmax_fuses_and_matches_with_padding_and_empty_rows(name):
    model = load_testdata(name)
    assert [n.op_type for n in model.graph.node].count("Softmax") == 2
    result = onnxfuse.optimize(model, provider="cpu", samples=2, target="contrib")
    assert result.validation.passed
    ops = [n.op_type for n in result.model.graph.node]
    assert "Softmax" not in ops and sum(ops.count(op) for op in FUSED) == 2, result.unfused
    assert result.unfused == []
    feeds = feeds_for(name, model, np.random.default_rng(3))
    want = run_ort(model, feeds)
    sess = ort.InferenceSession(result.model.SerializeToString(), session_options(),
                                providers=["CPUExecutionProvider"])
    got = sess.run(None, feeds)
    exact = run_float64(model, feeds)
    for (out, a), b in zip(want.items(), got):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4, err_msg=out)
        np.testing.assert_allclose(b, exact[out], rtol=1e-4, atol=1e-4, err_msg=f"{out} against float64")


@pytest.mark.parametrize("name", ["bert_tiny_sdpa_opset14", "distilbert_tiny_sdpa_opset17"])
def test_the_guard_is_emulated_by_zeroing_rows_with_no_key(name):
    """The fused op's rows that keep no key are multiplied by 0: the row the original guards to 0 is the
    one that differs when the factor is taken out (it then averages V)."""
    model = load_testdata(name)
    result = onnxfuse.optimize(model, provider="cpu", validate=False, target="contrib")
    details = [d for d in result.applied.details if d["rule"] == "contrib-attention"]
    assert details and all(d["empty_rows_zeroed"] and d["mask_form"] == "mask_index" for d in details)
    unguarded = result.model.__class__()
    unguarded.CopyFrom(result.model)
    for node in unguarded.graph.node:  # the factor's Mul reads the op's output: make it read 1
        if node.op_type == "Mul" and node.name.endswith("empty_rows_to_zero"):
            node.op_type, node.input[:] = "Identity", [node.input[0]]
    feeds = feeds_for(name, model, np.random.default_rng(5))
    want = run_ort(model, feeds)["last_hidden_state"]
    opts = session_options()
    got = ort.InferenceSession(result.model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    loose = ort.InferenceSession(unguarded.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(loose[:3], want[:3], rtol=1e-4, atol=1e-4)  # rows that keep a key
    assert np.abs(loose[3] - want[3]).max() > 1e-2  # the empty row: only the factor makes it right


@pytest.mark.parametrize("name", ["bert_tiny_sdpa_opset17", "roberta_tiny_sdpa_opset14", "distilbert_tiny_sdpa_opset14"])
def test_float16_sdpa_takes_the_keep_mask_as_a_bias_and_stays_exact(name):
    """Under --precision fp16 the guarded sdpa attention gets ``Where(keep, 0, -65504)`` as a float16
    ``attention_bias`` (the raw mask took ONNX Runtime's slower unfused float16 kernel), rows with no key
    zeroed after the op: against the float32 original in float64, padded rows and a fully masked row
    included, within float16's rounding."""
    model = load_testdata(name)
    result = onnxfuse.optimize(model, provider="cpu", samples=2, target="contrib", precision="fp16")
    assert result.validation.passed
    details = [d for d in result.applied.details if d["rule"] == "contrib-attention"]
    assert len(details) == 2 and all(d["mask_form"] == "keep attention_bias" for d in details), details
    fused = [n for n in result.model.graph.node if n.op_type in FUSED]
    biases = {n.input[5] for n in fused}  # attention_bias in both ops
    assert len(fused) == 2 and len(biases) == 1, biases  # both layers read one bias, built once
    feeds = feeds_for(name, model, np.random.default_rng(11))
    sess = ort.InferenceSession(result.model.SerializeToString(), session_options(),
                                providers=["CPUExecutionProvider"])
    got = sess.run(None, feeds)[0]
    exact = run_float64(model, feeds)["last_hidden_state"]
    # float16's rounding gives ~5e-3 here; a bias that masked nothing would give ~2.7e-2 on the padded rows
    assert float(np.abs(got - exact).max()) < 1e-2
