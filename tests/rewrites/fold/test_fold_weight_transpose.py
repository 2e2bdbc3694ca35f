"""fold-weight-transpose: MatMul(x, Transpose(W)) (transformers 5's nn.Linear) keeps the original's layout."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import helpers

RULE = "fold-weight-transpose"
K, N = 512, 768  # 1.5 MiB of float32: over fold-constants' 1 MiB limit, as every BERT projection is


def linear_model(shared=False, n=N):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n, K)) / np.sqrt(K)).astype(np.float32)  # [N, K] as torch stores it
    nodes = [h.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), h.make_node("MatMul", ["x", "Wt"], ["y"])]
    outputs = [helpers.vi("y", ["B", 3, n])]
    if shared:  # the same weight also read directly (tied embeddings read W, the head reads Wᵀ)
        nodes.append(h.make_node("Gather", ["W", "ids"], ["emb"]))
        outputs.append(helpers.vi("emb", ["B", K]))
    inputs = [helpers.vi("x", ["B", 3, K])] + ([helpers.vi("ids", ["B"], T.INT64)] if shared else [])
    return helpers.make_model(nodes, inputs, outputs, [numpy_helper.from_array(w, "W")], opset=17), w


def test_the_weight_is_stored_transposed_and_the_matmul_stays_a_matmul():
    model, w = linear_model()
    out, report = helpers.optimize(model)  # every default rule: the FusedMatMul rule must not see a Transpose
    assert report.counts[RULE] == 1
    assert helpers.op_types(out) == ["MatMul"]
    (weight,) = [numpy_helper.to_array(i) for i in out.graph.initializer]
    np.testing.assert_array_equal(weight, w.T)  # the bytes, not only the product
    helpers.assert_same_outputs(model, out)


def test_a_large_weight_read_elsewhere_too_is_not_stored_twice():
    model, _ = linear_model(shared=True)
    out, report = helpers.optimize(model, only=[RULE])
    assert report.counts[RULE] == 0
    assert any("store it twice" in r.reason for r in report.refusals)


def test_a_small_shared_weight_is_folded():
    model, w = linear_model(shared=True, n=8)
    out, report = helpers.optimize(model, only=[RULE])
    assert report.counts[RULE] == 1
    assert "Transpose" not in helpers.op_types(out)
    helpers.assert_same_outputs(model, out)
