"""contrib-attention on ONNX's own ``Attention`` (opset 23: torch's dynamo exporter at ``opset_version=23``):
unmasked self-attention over [B, H, S, D] heads becomes the packed com.microsoft ``Attention``, equal to
the original on ONNX Runtime; a masked one is refused, and why is checked against ONNX Runtime itself."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import helpers
from contrib_testlib import fuse, refusals
from onnxfuse.rewrites.contrib.contrib_attention import ContribAttention

RULE = ContribAttention()
H, D = 2, 8
E = H * D


def _model(mask: bool = False, scale: float | None = None) -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    inits, nodes = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    for p in "qkv":
        nodes += [h.make_node("MatMul", ["x", const(f"W{p}", (rng.standard_normal((E, E)) / 4).astype(np.float32))], [f"{p}0"]),
                  h.make_node("Add", [f"{p}0", const(f"b{p}", (rng.standard_normal(E) * 0.1).astype(np.float32))], [f"{p}1"]),
                  h.make_node("Reshape", [f"{p}1", const(f"s{p}", np.array([0, 0, H, D], np.int64))], [f"{p}2"]),
                  h.make_node("Transpose", [f"{p}2"], [f"{p}h"], perm=[0, 2, 1, 3])]
    attrs = {} if scale is None else {"scale": scale}
    nodes += [h.make_node("Attention", ["qh", "kh", "vh"] + (["m"] if mask else []), ["ctx"], **attrs),
              h.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
              h.make_node("Reshape", ["ctx_t", const("merge", np.array([0, 0, E], np.int64))], ["y"])]
    inputs = [h.make_tensor_value_info("x", T.FLOAT, ["B", "S", E])]
    if mask:
        inputs.append(h.make_tensor_value_info("m", T.FLOAT, ["B", 1, "S", "S"]))
    graph = h.make_graph(nodes, "g", inputs, [h.make_tensor_value_info("y", T.FLOAT, ["B", "S", E])], inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 23)], ir_version=10)


@pytest.mark.parametrize("scale", [None, 0.3])
def test_unmasked_onnx_attention_becomes_the_packed_contrib_op(scale):
    m = _model(scale=scale)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1, refusals(report, RULE)
    ops = [(n.domain, n.op_type) for n in out.graph.node]
    assert ("com.microsoft", "Attention") in ops and ("", "Attention") not in ops and ("", "MatMul") not in ops
    detail = next(d for d in report.details if d["rule"] == RULE.name)
    assert detail["scale"] == pytest.approx(D ** -0.5 if scale is None else scale)
    for batch, seq in ((2, 5), (1, 1), (3, 7)):
        x = np.random.default_rng(batch * seq).standard_normal((batch, seq, E)).astype(np.float32)
        np.testing.assert_allclose(helpers.run_ort(out, {"x": x})["y"], helpers.run_ort(m, {"x": x})["y"],
                                   rtol=1e-5, atol=1e-5)


def test_masked_onnx_attention_is_refused_and_why():
    m = _model(mask=True)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 0
    assert any("every key is masked" in r for r in refusals(report, RULE)), refusals(report, RULE)
    # The reason, on ONNX Runtime: a row whose every key carries finfo.min comes out 0 from the ONNX op,
    # while the spec's arithmetic (and com.microsoft Attention) average the values of that row.
    x = np.random.default_rng(0).standard_normal((1, 3, E)).astype(np.float32)
    mask = np.zeros((1, 1, 3, 3), np.float32)
    mask[0, 0, 0, :] = np.finfo(np.float32).min
    y = helpers.run_ort(m, {"x": x, "m": mask})["y"]
    assert np.all(y[0, 0] == 0) and np.any(y[0, 1] != 0)


def test_scaled_key_of_onnx_attention_beside_given_query_heads_counts_its_scale_once():
    """q given as heads (a graph input, as rotated heads are) and k = c·(split heads): k is re-read as given
    heads, and that must be the tensor under the scalar Mul, whose factor already went into the op's
    scale; reading the Mul's output as well would scale the scores twice."""
    rng = np.random.default_rng(4)
    f16 = T.FLOAT16
    nodes = [h.make_node("MatMul", ["x", "Wk"], ["k0"]),
             h.make_node("Reshape", ["k0", "split"], ["k1"]),
             h.make_node("Transpose", ["k1"], ["kh"], perm=[0, 2, 1, 3]),
             h.make_node("Mul", ["kh", "half"], ["ks"]),
             h.make_node("MatMul", ["x", "Wv"], ["v0"]),
             h.make_node("Reshape", ["v0", "split"], ["v1"]),
             h.make_node("Transpose", ["v1"], ["vh"], perm=[0, 2, 1, 3]),
             h.make_node("Attention", ["q", "ks", "vh"], ["ctx"]),
             h.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
             h.make_node("Reshape", ["ctx_t", "merge"], ["y"])]
    inits = [numpy_helper.from_array((rng.standard_normal((E, E)) / 4).astype(np.float16), "Wk"),
             numpy_helper.from_array((rng.standard_normal((E, E)) / 4).astype(np.float16), "Wv"),
             numpy_helper.from_array(np.array([0, 0, H, D], np.int64), "split"),
             numpy_helper.from_array(np.array(0.5, np.float16), "half"),
             numpy_helper.from_array(np.array([0, 0, E], np.int64), "merge")]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", f16, ["B", "S", E]),
                                      h.make_tensor_value_info("q", f16, ["B", H, "S", D])],
                         [h.make_tensor_value_info("y", f16, ["B", "S", E])], inits)
    m = h.make_model(graph, opset_imports=[h.make_opsetid("", 23)], ir_version=10)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1, refusals(report, RULE)
    detail = next(d for d in report.details if d["rule"] == RULE.name)
    assert detail["kv_layout"] == "BNSH" and detail["scale"] == pytest.approx(0.5 * D ** -0.5)
    feeds = {"x": rng.standard_normal((2, 5, E)).astype(np.float16),
             "q": rng.standard_normal((2, H, 5, D)).astype(np.float16)}
    np.testing.assert_allclose(helpers.run_ort(out, feeds)["y"].astype(np.float64),
                               helpers.run_ort(m, feeds)["y"].astype(np.float64), atol=1e-2)
