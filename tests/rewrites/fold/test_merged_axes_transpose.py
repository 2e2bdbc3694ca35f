"""merged-axes-transpose: Reshape(Transpose(Reshape(x, [-1, *tail]), [0, …]), [*lead, *tail']) → Transpose(x).

The dynamo exporter's Kᵀ (targets computed from Shape(x), allowzero=1) and constant-target variants
are compared with the original on ONNX Runtime, value for value, at several sizes; the look-alikes
that do not move elements the same way are refused.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from contrib_testlib import fuse, parse, refusals, same_at

import helpers
from onnxfuse.rewrites.fold.merged_axes_transpose import MergedAxesTranspose

RULE = MergedAxesTranspose()

#: onnxscript's aten::transpose(k, -2, -1) of a rank-4 k, as torch.onnx.export(dynamo=True) writes it
DYNAMO_KT = """
g (float[batch,4,seq,16] x) => (float[batch,4,16,seq] y) {
    s = Shape <start = 0> (x)
    m1 = Constant <value = int64[1] {-1}> ()
    m2 = Constant <value = int64[1] {-2}> ()
    big = Constant <value = int64[1] {9223372036854775807}> ()
    small = Constant <value = int64[1] {-9223372036854775808}> ()
    d = Slice(s, m1, big)
    l = Slice(s, m2, m1)
    lead = Slice(s, small, m2)
    t1 = Concat <axis = 0> (m1, l, d)
    flat = Reshape <allowzero = 1> (x, t1)
    ft = Transpose <perm = [0, 2, 1]> (flat)
    t2 = Concat <axis = 0> (lead, d, l)
    y = Reshape <allowzero = 1> (ft, t2)
}
"""


def _ops(model) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def _perm(model) -> list[int]:
    node = next(n for n in model.graph.node if n.op_type == "Transpose")
    return list(next(a.ints for a in node.attribute if a.name == "perm"))


def test_dynamo_key_transpose_becomes_one_transpose():
    m = parse(DYNAMO_KT)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1
    assert _ops(out) == Counter({"Transpose": 1}) and _perm(out) == [0, 1, 3, 2]
    for dims in ({"batch": 2, "seq": 5}, {"batch": 1, "seq": 1}, {"batch": 3, "seq": 7}):
        same_at(m, out, dims)


def test_shape_read_from_a_tensor_with_the_same_names():
    # The dynamo exporter reads every layer's sizes from the first layer's tensor: the names agree.
    m = parse(DYNAMO_KT.replace("(float[batch,4,seq,16] x)", "(float[batch,4,seq,16] x, float[batch,4,seq,16] z)")
              .replace("s = Shape <start = 0> (x)", "s = Shape <start = 0> (z)"))
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1 and _perm(out) == [0, 1, 3, 2]
    same_at(m, out, {"batch": 2, "seq": 3})


def test_shape_of_an_unrelated_tensor_is_refused():
    m = parse(DYNAMO_KT.replace("(float[batch,4,seq,16] x)", "(float[batch,4,seq,16] x, float[p,4,q,16] z)")
              .replace("s = Shape <start = 0> (x)", "s = Shape <start = 0> (z)"))
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 0 and _ops(out)["Reshape"] == 2
    assert refusals(report, RULE), "expected a reason"


def test_constant_targets_and_a_three_axis_tail():
    # x [2, 3, 4, 5, 6]: the first two axes merged, the tail (4, 5, 6) rotated by perm [0, 3, 1, 2].
    m = parse("""
    g (float[2,3,4,5,6] x) => (float[2,3,6,4,5] y) {
        t1 = Constant <value = int64[4] {6, 4, 5, 6}> ()
        flat = Reshape(x, t1)
        ft = Transpose <perm = [0, 3, 1, 2]> (flat)
        t2 = Constant <value = int64[5] {2, 3, 6, 4, -1}> ()
        y = Reshape(ft, t2)
    }
    """)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1 and _perm(out) == [0, 1, 4, 2, 3]
    same_at(m, out, {})


def test_split_into_other_leading_sizes_is_refused():
    # [6, ...] split back as [3, 2] instead of x's [2, 3]: the elements land elsewhere.
    m = parse("""
    g (float[2,3,4,5] x) => (float[3,2,5,4] y) {
        t1 = Constant <value = int64[3] {-1, 4, 5}> ()
        flat = Reshape(x, t1)
        ft = Transpose <perm = [0, 2, 1]> (flat)
        t2 = Constant <value = int64[4] {3, 2, 5, 4}> ()
        y = Reshape(ft, t2)
    }
    """)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 0 and _ops(out)["Reshape"] == 2
    assert any("split the merged axis back" in r for r in refusals(report, RULE)), refusals(report, RULE)


def test_transpose_moving_the_merged_axis_is_refused():
    m = parse("""
    g (float[2,3,4,5] x) => (float[4,2,3,5] y) {
        t1 = Constant <value = int64[3] {-1, 4, 5}> ()
        flat = Reshape(x, t1)
        ft = Transpose <perm = [1, 0, 2]> (flat)
        t2 = Constant <value = int64[4] {4, 2, 3, 5}> ()
        y = Reshape(ft, t2)
    }
    """)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 0
    assert any("leading axes" in r for r in refusals(report, RULE)), refusals(report, RULE)


def test_zero_in_a_target_is_refused():
    m = parse(DYNAMO_KT.replace("t1 = Concat <axis = 0> (m1, l, d)",
                                "z0 = Constant <value = int64[1] {0}> ()\n    t1 = Concat <axis = 0> (z0, l, d)")
              .replace("flat = Reshape <allowzero = 1> (x, t1)", "flat = Reshape(x, t1)"))
    out, report = fuse(m, RULE, infer=False)
    assert report.counts[RULE.name] == 0


def test_checker_accepts_and_shapes_are_inferred():
    out, _ = fuse(parse(DYNAMO_KT), RULE)
    inferred = onnx.shape_inference.infer_shapes(out)
    y = next(o for o in inferred.graph.output if o.name == "y")
    assert [d.dim_param or d.dim_value for d in y.type.tensor_type.shape.dim] == ["batch", 4, 16, "seq"]


def _random_case(rng):
    """A random merged-axes Transpose: x of rank 3-5, k leading axes merged, a tail perm keeping axis 0,
    targets as constants (with -1) or read from Shape(x), allowzero random; a quarter of them split the
    merged axis back wrongly (leading sizes reversed), which must be refused or stay equal."""
    import onnx.helper as h

    rank = int(rng.integers(3, 6))
    shape = [int(d) for d in rng.integers(1, 4, rank)]
    k = int(rng.integers(2, rank))
    m = rank - k + 1
    tail = [0] + [int(p) + 1 for p in rng.permutation(m - 1)]
    nodes, inits = [], []

    def const(name, values):
        inits.append(onnx.numpy_helper.from_array(np.asarray(values, np.int64), name))
        return name

    allowzero = int(rng.integers(0, 2))
    if rng.random() < 0.5:
        t1 = const("t1", [-1] + shape[k:])
    else:
        nodes.append(h.make_node("Shape", ["x"], ["s"]))
        parts = [const("m1", [-1])]
        for j in range(k, rank):
            nodes.append(h.make_node("Slice", ["s", const(f"a{j}", [j]), const(f"b{j}", [j + 1])], [f"d{j}"]))
            parts.append(f"d{j}")
        nodes.append(h.make_node("Concat", parts, ["t1"], axis=0))
        t1 = "t1"
    nodes.append(h.make_node("Reshape", ["x", t1], ["flat"], allowzero=allowzero))
    nodes.append(h.make_node("Transpose", ["flat"], ["ft"], perm=tail))
    lead = shape[:k][::-1] if rng.random() < 0.25 else shape[:k]
    out_shape = lead + [shape[k - 1 + p] for p in tail[1:]]
    nodes.append(h.make_node("Reshape", ["ft", const("t2", out_shape)], ["y"], allowzero=allowzero))
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape)],
                         [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, out_shape)], inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8), shape


def test_random_merged_axes_transposes_keep_their_values():
    rng = np.random.default_rng(2026)
    rewritten = 0
    for _ in range(60):
        m, shape = _random_case(rng)
        out, report = fuse(m, RULE)
        rewritten += report.counts[RULE.name]
        feeds = {"x": rng.standard_normal(shape).astype(np.float32)}
        np.testing.assert_array_equal(helpers.run_ort(out, feeds)["y"], helpers.run_ort(m, feeds)["y"])
    assert rewritten >= 30  # most cases are the real pattern, and they are taken
