"""contrib-embed-layernorm: BERT-style embeddings, LayerNorm(Gather(words) + Gather(token types) +
Gather(positions)), become one com.microsoft EmbedLayerNormalization with the original's outputs
(ONNX Runtime CPU, the original model as the reference), and the refusals name their reason."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import helpers
from helpers import run_ort

RULE = "contrib-embed-layernorm"
B, S, H, V, P = 3, 7, 16, 50, 20


def embeddings_model(token_types="input", positions="arange", dtype=np.float32, extra_reader=False,
                     seq=S) -> onnx.ModelProto:
    """``LayerNorm(W[ids] + T[tt] + P[pos])`` as torch exports BERT's embeddings (LayerNormalization at
    opset 17). ``token_types``: "input" (a [B, S] input), "zeros" (a constant 0 per token, broadcast by
    ``Where(c, k, k)`` as expand-by-broadcast writes it) or None. ``positions``: "arange" or "offset"
    (RoBERTa's padding_idx + 1 + s) constants, or "input" (a run-time [B, S] index: not a position table)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((V, H)).astype(dtype), "W"),
             numpy_helper.from_array(rng.standard_normal((P, H)).astype(dtype), "Pt"),
             numpy_helper.from_array(rng.standard_normal((2, H)).astype(dtype), "Tt"),
             numpy_helper.from_array((1 + 0.1 * rng.standard_normal(H)).astype(dtype), "gamma"),
             numpy_helper.from_array((0.1 * rng.standard_normal(H)).astype(dtype), "beta")]
    inputs = [helpers.vi("ids", ["B", seq], T.INT64)]
    nodes = [h.make_node("Gather", ["W", "ids"], ["words"])]
    total = "words"
    if token_types == "input":
        inputs.append(helpers.vi("tt", ["B", seq], T.INT64))
        nodes.append(h.make_node("Gather", ["Tt", "tt"], ["types"]))
    elif token_types == "zeros":
        inits.append(numpy_helper.from_array(np.zeros((1, seq), np.int64), "tt_buffer"))
        nodes += [h.make_node("Equal", ["ids", "ids"], ["carrier"]),
                  h.make_node("Where", ["carrier", "tt_buffer", "tt_buffer"], ["tt"]),
                  h.make_node("Gather", ["Tt", "tt"], ["types"])]
    if token_types:
        nodes.append(h.make_node("Add", [total, "types"], ["with_types"]))
        total = "with_types"
    if positions == "input":
        inputs.append(helpers.vi("pos", ["B", seq], T.INT64))
    else:
        start = 0 if positions == "arange" else 2
        inits.append(numpy_helper.from_array(np.arange(start, start + seq, dtype=np.int64)[None], "pos"))
    nodes += [h.make_node("Gather", ["Pt", "pos"], ["positions"]),
              h.make_node("Add", [total, "positions"], ["summed"]),
              h.make_node("LayerNormalization", ["summed", "gamma", "beta"], ["out"], axis=-1, epsilon=1e-12)]
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    outputs = [helpers.vi("out", ["B", seq, H], elem)]
    if extra_reader:
        outputs.append(helpers.vi("summed", ["B", seq, H], elem))
    model = helpers.make_model(nodes, inputs, outputs, inits, opset=17)
    onnx.checker.check_model(model, full_check=True)
    return onnx.shape_inference.infer_shapes(model)  # the rule proves [B, S, H]; optimize infers first too


def feeds(model, seed=1):
    rng = np.random.default_rng(seed)
    out = {"ids": rng.integers(0, V, (B, S)).astype(np.int64)}
    names = {i.name for i in model.graph.input}
    if "tt" in names:
        out["tt"] = rng.integers(0, 2, (B, S)).astype(np.int64)
    if "pos" in names:
        out["pos"] = rng.integers(0, P, (B, S)).astype(np.int64)
    return out


@pytest.mark.parametrize("token_types,positions", [("input", "arange"), ("zeros", "arange"),
                                                   (None, "offset"), ("zeros", "offset")])
def test_embeddings_become_one_embed_layernorm_with_the_same_outputs(token_types, positions):
    model = embeddings_model(token_types, positions)
    out, report = helpers.optimize(model, only=[RULE])
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    ops = helpers.op_types(out)
    assert ops.count("EmbedLayerNormalization") == 1 and not {"Gather", "Add", "LayerNormalization"} & set(ops)
    (node,) = [n for n in out.graph.node if n.op_type == "EmbedLayerNormalization"]
    assert (node.input[1] != "") == (token_types == "input")  # segment_ids only for run-time token types
    for seed in (1, 2):
        f = feeds(model, seed)
        want, got = run_ort(model, f)["out"], run_ort(out, f)["out"]
        # the sums are reassociated (constant rows added first): float32 rounding only
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # ... which that tolerance tells from a wrong position table (positions off by two)
        other = embeddings_model(token_types, "offset" if positions == "arange" else "arange")
        assert np.max(np.abs(run_ort(other, f)["out"] - got)) > 1e-2


def test_refusals_carry_their_reason():
    cases = {
        "float16": (embeddings_model(dtype=np.float16), "float32"),
        "read elsewhere": (embeddings_model(extra_reader=True), "read elsewhere"),
        "run-time positions": (embeddings_model("input", "input"), "run-time lookups"),
    }
    for name, (model, reason) in cases.items():
        out, report = helpers.optimize(model, only=[RULE])
        assert report.counts[RULE] == 0, name
        assert any(reason in r.reason for r in report.refusals if r.rule == RULE), (name, report.refusals)
        assert "EmbedLayerNormalization" not in helpers.op_types(out)
