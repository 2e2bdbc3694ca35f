"""fold-constants: static size arithmetic and constant subgraphs become initializers; dynamic sizes stay.

The reference for every numeric check is ONNX Runtime on the original model, at batch sizes other
than 1 so that a wrongly frozen dynamic dimension would show.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from contrib_testlib import parse, refusals

import helpers
from onnxfuse.rewrites import select_rules
from onnxfuse.rewrites.fold.fold_constants import FoldConstants, folded_copy

# torch MultiheadAttention's scale, as the legacy exporter writes it: head_dim comes from Shape(q),
# where q's shape went through a Reshape whose target is computed (Shape → Gather → Div → Concat),
# so plain ONNX shape inference does not know it.
ATTENTION_SCALE = """
g (float[batch,6,32] x, float[batch,4,6,8] k) => (float[batch,4,6,6] y) {
    s0 = Shape(x)
    i0 = Constant <value = int64 {0}> ()
    i1 = Constant <value = int64 {1}> ()
    i2 = Constant <value = int64 {2}> ()
    b = Gather <axis = 0> (s0, i0)
    t = Gather <axis = 0> (s0, i1)
    e = Gather <axis = 0> (s0, i2)
    heads = Constant <value = int64 {4}> ()
    hd = Div(e, heads)
    ax = Constant <value = int64[1] {0}> ()
    b1 = Unsqueeze(b, ax)
    t1 = Unsqueeze(t, ax)
    h1 = Unsqueeze(heads, ax)
    d1 = Unsqueeze(hd, ax)
    shp = Concat <axis = 0> (b1, t1, h1, d1)
    q4 = Reshape(x, shp)
    q = Transpose <perm = [0, 2, 1, 3]> (q4)
    sq = Shape(q)
    st = Constant <value = int64[1] {-1}> ()
    en = Constant <value = int64[1] {9223372036854775807}> ()
    last = Slice(sq, st, en)
    lf = Cast <to = 1> (last)
    r = Sqrt(lf)
    one = Constant <value = float {1.0}> ()
    inv = Div(one, r)
    scale = Sqrt(inv)
    qs = Mul(q, scale)
    kt = Transpose <perm = [0, 1, 3, 2]> (k)
    ks = Mul(kt, scale)
    y = MatMul(qs, ks)
}
"""


def _ops(model) -> Counter:
    return Counter((f"{n.domain}:" if n.domain not in ("", "ai.onnx") else "") + n.op_type for n in model.graph.node)


def _same(original, optimized, batch: int, rtol=1e-5, atol=1e-6):
    feeds = helpers.random_feeds(original, seed=batch, dim=batch)
    want = helpers.run_ort(original, feeds)
    got = helpers.run_ort(optimized, feeds)
    for name, a in want.items():
        np.testing.assert_allclose(got[name], a, rtol=rtol, atol=atol, err_msg=f"{name} at batch {batch}")


def test_plain_shape_inference_does_not_know_head_dim():
    # Why the rule exists: without it, q's last dimension is unknown, so nothing downstream is constant.
    m = onnx.shape_inference.infer_shapes(parse(ATTENTION_SCALE), data_prop=True)
    q = next(v for v in m.graph.value_info if v.name == "q")
    assert not q.type.tensor_type.shape.dim[3].HasField("dim_value")


def test_attention_scale_folds_then_joins_the_matmul():
    m = parse(ATTENTION_SCALE)
    out, report = helpers.optimize(m)
    assert report.counts["fold-constants"] > 0
    ops = _ops(out)
    # The scale became a constant, and contrib-fused-matmul-scale moved it into the MatMul's alpha.
    assert "Sqrt" not in ops and "Cast" not in ops and "Mul" not in ops and "Div" not in ops, ops
    assert ops["com.microsoft:FusedMatMul"] == 1
    alpha = next(a.f for n in out.graph.node if n.op_type == "FusedMatMul" for a in n.attribute if a.name == "alpha")
    assert alpha == pytest.approx(1 / np.sqrt(8), rel=1e-6)
    # The batch size stays dynamic: the Reshape copies it (0) instead of computing it from Shape.
    init = {i.name: onnx.numpy_helper.to_array(i) for i in out.graph.initializer}
    reshape = next(n for n in out.graph.node if n.op_type == "Reshape")
    assert init[reshape.input[1]].tolist() == [0, 6, 4, 8]
    assert ops["Shape"] == 0
    for batch in (1, 3):
        _same(m, out, batch)


def test_without_the_rule_the_scale_is_left_to_onnx_runtime():
    m = parse(ATTENTION_SCALE)
    out, report = helpers.optimize(m, skip="fold-constants")
    reasons = refusals(report)
    assert any(r.startswith("scalar computation") for r in reasons), reasons
    assert _ops(out)["Sqrt"] == 2  # not pulled into a FusedElementwise on the GPU
    _same(m, out, 2)


def _flatten_by_first_dim(n: str):
    """x.view(x.shape[0], -1) as exporters write it: Reshape(xr, Concat(Shape(xr)[0], [-1]))."""
    return parse(f"""
    g (float[{n},4,8] x) => (float[{n},32] y) {{
        xr = Relu(x)
        s = Shape(xr)
        i0 = Constant <value = int64 {{0}}> ()
        b = Gather <axis = 0> (s, i0)
        ax = Constant <value = int64[1] {{0}}> ()
        b1 = Unsqueeze(b, ax)
        m1 = Constant <value = int64[1] {{-1}}> ()
        shp = Concat <axis = 0> (b1, m1)
        y = Reshape(xr, shp)
    }}
    """)


def test_dynamic_dimension_is_not_frozen_by_a_stale_value_info():
    m = _flatten_by_first_dim("batch")
    # An exporter's annotation traced at batch 1: trusting it would fold the batch size to 1.
    m.graph.value_info.append(onnx.helper.make_tensor_value_info("xr", onnx.TensorProto.FLOAT, [1, 4, 8]))
    out, _ = helpers.optimize(m)
    # Folded to a copy of xr's own first dimension (0), never to the annotated 1.
    init = {i.name: onnx.numpy_helper.to_array(i) for i in out.graph.initializer}
    reshape = next(n for n in out.graph.node if n.op_type == "Reshape")
    assert init[reshape.input[1]].tolist() == [0, -1]
    out_skip, _ = helpers.optimize(m, skip="constant-reshape-target")
    assert _ops(out_skip)["Shape"] == 1  # fold-constants alone keeps the batch computed
    for batch in (1, 3, 5):
        _same(m, out_skip, batch)
    for batch in (1, 3, 5):
        _same(m, out, batch)


def test_static_reshape_target_folds_completely():
    m = _flatten_by_first_dim("2")
    out, report = helpers.optimize(m)
    assert _ops(out) == Counter({"Relu": 1, "Reshape": 1})
    assert report.counts["fold-constants"] == 4  # Shape, Gather, Unsqueeze, Concat
    _same(m, out, 2)


def test_constant_graph_output_keeps_its_name_and_value():
    m = parse("""
    g (float[batch,3] x) => (float[batch,3] y, float[3] c2) {
        c = Constant <value = float[3] {1.0, 2.0, 3.0}> ()
        c2 = Mul(c, c)
        y = Add(x, c2)
    }
    """)
    out, _ = helpers.optimize(m, only="fold-constants")
    assert [o.name for o in out.graph.output] == ["y", "c2"]
    assert "Mul" not in _ops(out)
    feeds = helpers.random_feeds(m, dim=4)
    got = helpers.run_ort(out, feeds)
    np.testing.assert_array_equal(got["c2"], np.array([1.0, 4.0, 9.0], np.float32))
    _same(m, out, 4)


def test_large_results_stay_computed():
    m = parse("""
    g (float[batch,512,1024] x) => (float[batch,512,1024] y) {
        a = ConstantOfShape <value = float[1] {0.5}> (shp)
        y = Add(x, a)
    }
    """, inits={"shp": np.array([512, 1024], np.int64)})
    out, report = helpers.optimize(m, only="fold-constants")
    assert report.counts["fold-constants"] == 0  # 2 MiB > SIZE_LIMIT
    assert "ConstantOfShape" in _ops(out)


def test_nothing_to_fold_leaves_graph_alone():
    from onnxfuse.model_io import to_graph

    m = parse("g (float[batch,3] x) => (float[batch,3] y) {\n y = Relu(x)\n}")
    assert folded_copy(to_graph(m)) is None


def test_rule_runs_first_for_every_target():
    for target in ("cuda", "contrib", "onnx"):
        names = [r.name for r in select_rules(target)]
        assert names[0] == FoldConstants.name


def test_pipeline_shape_inference_ignores_and_keeps_the_models_value_info():
    from onnxfuse.model_io import infer_shapes

    m = parse("g (float[batch,4] x) => (float[batch,4] y) {\n r = Relu(x)\n y = Neg(r)\n}")
    m.graph.value_info.append(onnx.helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, [1, 4]))
    before = m.SerializeToString()
    inferred = infer_shapes(m)
    r = next(v for v in inferred.graph.value_info if v.name == "r")
    assert r.type.tensor_type.shape.dim[0].dim_param == "batch"  # from the input, not the stale 1
    assert m.SerializeToString() == before  # the caller's model is unchanged


def test_fp16_attention_scale_folds_exactly():
    from contrib_testlib import to_dtype

    # An fp16 export casts the size to float16 (Cast to=10) before the Sqrt.
    m = to_dtype(parse(ATTENTION_SCALE.replace("Cast <to = 1>", "Cast <to = 10>")), np.float16)
    out, report = helpers.optimize(m)
    assert report.counts["fold-constants"] > 0
    ops = _ops(out)
    assert "Sqrt" not in ops and ops["com.microsoft:FusedMatMul"] == 1, ops
    for batch in (1, 3):
        _same(m, out, batch, rtol=2e-3, atol=2e-3)


def test_an_op_that_cannot_be_evaluated_does_not_stop_the_rest():
    # com.microsoft.BiasSoftmax has no CPU kernel in ONNX Runtime: evaluated with the rest, it would
    # make the whole evaluation fail. Ops outside the ONNX domain are left out of folding, so the size
    # arithmetic next to it still folds.
    m = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
    g (float[batch,4,8] x) => (float[batch,32] y, float[2,3] z) {
        a = Constant <value = float[2,3] {1, 2, 3, 4, 5, 6}> ()
        b = Constant <value = float[3] {0, 1, 2}> ()
        z = com.microsoft.BiasSoftmax <axis = 1, is_inner_broadcast = 0> (a, b)
        s = Shape(x)
        i1 = Constant <value = int64 {1}> ()
        d1 = Gather <axis = 0> (s, i1)
        i2 = Constant <value = int64 {2}> ()
        d2 = Gather <axis = 0> (s, i2)
        p = Mul(d1, d2)
        ax = Constant <value = int64[1] {0}> ()
        p1 = Unsqueeze(p, ax)
        m1 = Constant <value = int64[1] {-1}> ()
        shp = Concat <axis = 0> (m1, p1)
        y = Reshape(x, shp)
    }""")
    out, report = helpers.optimize(m, only="fold-constants")
    ops = _ops(out)
    assert ops["com.microsoft:BiasSoftmax"] == 1  # left as it was
    assert "Mul" not in ops and "Concat" not in ops and "Shape" not in ops, ops  # 4·8 folded to [-1, 32]
    assert report.counts["fold-constants"] == 6  # Shape, 2 Gathers, Mul, Unsqueeze, Concat


def test_a_branch_output_folded_to_a_constant_is_written_by_a_node():
    """graphsurgeon folds inside If branches too; a branch output it folds to a constant must still be
    written by a node (ONNX's rule for bodies), else the model fails the checker and the pipeline drops the
    whole pass (fuzz seed 120249: a second optimize then folded what the first had not)."""
    from onnx import TensorProto as T
    from onnx import helper as h

    import onnxfuse

    two = onnx.numpy_helper.from_array(np.full((2, 3), 2.0, np.float32), "two")
    # the branch passes on a value the main graph computes from constants: folded, the branch's Identity
    # of it becomes a constant output
    then_branch = h.make_graph([h.make_node("Identity", ["outer"], ["then_out"])], "then", [],
                               [h.make_tensor_value_info("then_out", T.FLOAT, [2, 3])])
    else_branch = h.make_graph([h.make_node("Abs", ["x"], ["else_out"])], "else", [],
                               [h.make_tensor_value_info("else_out", T.FLOAT, [2, 3])])
    graph = h.make_graph([h.make_node("Mul", ["two", "two"], ["outer"]),
                          h.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch)], "g",
                         [h.make_tensor_value_info("cond", T.BOOL, []), h.make_tensor_value_info("x", T.FLOAT, [2, 3])],
                         [h.make_tensor_value_info("y", T.FLOAT, [2, 3])], [two])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    result = onnxfuse.optimize(model, target="onnx")
    assert result.validation.passed and not result.applied.dropped, result.applied.dropped
    assert result.applied.counts["fold-constants"] == 1
    onnx.checker.check_model(result.model, full_check=True)
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 3
    for cond in (True, False):
        feeds = {"cond": np.array(cond), "x": x}
        np.testing.assert_array_equal(helpers.run_ort(result.model, feeds)["y"], helpers.run_ort(model, feeds)["y"])
