"""fold-size-sentinel, and the shape inference it (and constant-reshape-target) triggers.

torch exports ``buf.expand(batch, seq)`` as ``Expand(buf, Where(Equal(sizes, -1), ones, sizes))``. With the
sizes read from ``Shape`` the Where can only pick ``sizes``; the rule removes it, and shapes are inferred
again so that the Expand's output has the model's own ``batch`` instead of an invented dimension. Each
rewrite is checked against ONNX Runtime on the original at two batch sizes; each refusal keeps the Where.
"""

from __future__ import annotations

import numpy as np
from contrib_testlib import fuse, ops, parse, refusals

import helpers
from onnxfuse.model_io import to_graph
from onnxfuse.rewrites import apply_rules
from onnxfuse.rewrites.facts.graph import provably_nonnegative
from onnxfuse.rewrites.fold.constant_reshape_target import ConstantReshapeTarget
from onnxfuse.rewrites.fold.fold_size_sentinel import FoldSizeSentinel

RULE = FoldSizeSentinel()


def _expand_model(sentinel: str = "-1, -1", sizes_from: str = "x", fill: str = "1, 1") -> object:
    """y = x + Expand(buf[1, 4], Where(Equal(sizes, sentinel), fill, sizes)), sizes = [dim 0 of
    ``sizes_from``, 4] (BERT's token_type_ids buffer expanded to [batch, seq])."""
    return parse(f"""
    g (float[batch,4] x, int64[2] other) => (float[batch,4] y) {{
        s = Shape(x)
        i0 = Constant <value = int64 {{0}}> ()
        b = Gather <axis = 0> (s, i0)
        ax = Constant <value = int64[1] {{0}}> ()
        b1 = Unsqueeze(b, ax)
        four = Constant <value = int64[1] {{4}}> ()
        shp = Concat <axis = 0> (b1, four)
        sizes = Identity({"shp" if sizes_from == "x" else "other"})
        minus = Constant <value = int64[2] {{ {sentinel} }}> ()
        eq = Equal(sizes, minus)
        ones = Constant <value = int64[2] {{{fill}}}> ()
        target = Where(eq, ones, sizes)
        buf = Constant <value = float[1,4] {{1.0, 2.0, 3.0, 4.0}}> ()
        e = Expand(buf, target)
        y = Add(x, e)
    }}
    """)


def _run(model, batch: int):
    rng = np.random.default_rng(batch)
    feeds = {"x": rng.standard_normal((batch, 4)).astype(np.float32)}
    if any(i.name == "other" for i in model.graph.input):
        feeds["other"] = np.array([batch, 4], np.int64)
    return helpers.run_ort(model, feeds)


def test_sentinel_check_on_shape_sizes_is_removed_and_batch_is_inferred():
    model = _expand_model()
    out, report = fuse(model, RULE)
    assert report.counts[RULE.name] == 1
    assert "Where" not in ops(out) and "Equal" not in ops(out)
    for batch in (1, 3):
        np.testing.assert_array_equal(_run(out, batch)["y"], _run(model, batch)["y"])
    # The shapes were inferred again: the Expand's output now carries the input's own symbol.
    shapes = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in out.graph.value_info}
    assert shapes["e"] == ["batch", 4]


def test_without_the_rule_the_expand_gets_an_invented_dimension():
    """The reason for the rule: ONNX does not propagate values through Equal/Where."""
    out, _ = fuse(_expand_model())
    shapes = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in out.graph.value_info}
    assert shapes["e"][0] != "batch"


def test_sizes_from_an_input_are_refused():
    model = _expand_model(sizes_from="other")
    out, report = fuse(model, RULE)
    assert "Where" in ops(out)
    assert any("not provably non-negative" in r for r in refusals(report, RULE))
    for batch in (1, 3):
        np.testing.assert_array_equal(_run(out, batch)["y"], _run(model, batch)["y"])


def test_a_sentinel_that_is_not_negative_everywhere_is_refused():
    model = _expand_model(sentinel="-1, 4", fill="1, 7")  # 4 == 4: the Where picks the 7, changing the shape
    out, report = fuse(model, RULE)
    assert "Where" in ops(out)
    assert any("every element is negative" in r for r in refusals(report, RULE))


def test_provably_nonnegative():
    model = parse("""
    g (float[batch,4] x, int64[2] v) => (int64[2] a, int64[2] b, int64[2] c, int32[2] d, int64[2] e) {
        s = Shape(x)
        a = Mul(s, s)
        b = Add(s, v)
        n = Constant <value = int64[2] {-1, 2}> ()
        c = Mul(s, n)
        d = Cast <to = 6> (s)
        e = Neg(s)
    }
    """)
    graph = to_graph(model)
    t = graph.tensors()
    assert provably_nonnegative(graph, t["s"]) and provably_nonnegative(graph, t["a"])
    assert not provably_nonnegative(graph, t["b"])  # v is an input
    assert not provably_nonnegative(graph, t["c"])  # a negative constant
    assert not provably_nonnegative(graph, t["d"])  # int64 → int32 could wrap
    assert not provably_nonnegative(graph, t["e"])


def test_reshape_target_refresh_proves_the_merge_output_equal_to_the_residual():
    """A head merge: Reshape(ctx [batch,8,2,4], Reshape(Concat(Shape(ctx)[:2], [8]), [-1])). ONNX does not
    propagate values through a Reshape, so inference alone gives the merge invented dims; once cleanup
    has dropped the identity Reshape([-1]), constant-reshape-target writes [0, -1, 8] and shapes are
    inferred again, it is provably [batch, 8, 8], the residual's shape."""
    model = parse("""
    g (float[batch,8,8] r) => (float[batch,8,8] y) {
        four = Constant <value = int64[4] {0, 0, 2, 4}> ()
        ctx = Reshape(r, four)
        s = Shape(ctx)
        st = Constant <value = int64[1] {0}> ()
        en = Constant <value = int64[1] {2}> ()
        lead = Slice(s, st, en)
        e = Constant <value = int64[1] {8}> ()
        t0 = Concat <axis = 0> (lead, e)
        flat = Constant <value = int64[1] {-1}> ()
        t = Reshape(t0, flat)
        merged = Reshape(ctx, t)
        y = Add(merged, r)
    }
    """)
    before, _ = fuse(model)
    after, report = fuse(model, ConstantReshapeTarget())
    assert report.counts["constant-reshape-target"] == 1

    def shape(m, name):
        vi = next(v for v in list(m.graph.value_info) + list(m.graph.output) if v.name == name)
        return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]

    assert shape(before, "merged")[0] != "batch"
    assert shape(after, "merged") == ["batch", 8, 8]
    assert ops(before)["Reshape"] == ops(after)["Reshape"] == 2  # cleanup dropped the identity Reshape([-1])
    for batch in (1, 3):
        rng = np.random.default_rng(batch)
        feeds = {"r": rng.standard_normal((batch, 8, 8)).astype(np.float32)}
        np.testing.assert_array_equal(helpers.run_ort(after, feeds)["y"], helpers.run_ort(model, feeds)["y"])


def test_refresh_keeps_declared_symbols_and_forgets_invented_ones_it_cannot_infer_again():
    from onnxfuse.rewrites.facts.shapes import refresh_shapes

    model = parse("""
    g (float[batch,4] x) => (float[batch,4] y) {
        a = Relu(x)
        y = Sigmoid(a)
    }
    """)
    graph = to_graph(model)
    t = graph.tensors()
    t["a"].shape = ["unk__9", 4]  # as if an earlier inference run had invented it
    graph.nodes[0].op, graph.nodes[0].domain = "Unknown", "custom.domain"  # ONNX cannot infer it now
    refresh_shapes(graph)
    assert t["a"].shape == [None, 4]
    apply_rules(graph, [])


def test_refresh_infers_through_same_shape_contrib_ops_and_cuts_others_at_their_declared_shapes():
    """ONNX has no schema for contrib ops: the inference skeleton reads SkipLayerNormalization as Identity
    (its output 0 has its input 0's shape), so the MatMul after it gets the batch name; a custom op it
    cannot read enters at the shape a rule declared for it, with sizes and declared names only."""
    import onnx_graphsurgeon as gs

    from onnxfuse.rewrites.facts.shapes import refresh_shapes

    model = parse("""
    g (float[batch,4] x, float[batch,4] r, float[4] gamma, float[4] beta, float[4,3] w) => (float[batch,3] y, float[batch,4] z, float[batch,4] v) {
        y = MatMul(x, w)
        z = Relu(x)
        v = Relu(x)
    }
    """)
    graph = to_graph(model)
    t = graph.tensors()
    skip_out, custom_out, custom_invented = (gs.Variable(n, dtype=np.float32) for n in ("s", "c", "u"))
    custom_out.shape, custom_invented.shape = ["batch", 4], ["unk__1", 4]
    graph.nodes += [
        gs.Node("SkipLayerNormalization", "skip", inputs=[t["x"], t["r"], t["gamma"], t["beta"]],
                outputs=[skip_out], domain="com.microsoft"),
        gs.Node("Custom", "custom", inputs=[t["x"]], outputs=[custom_out], domain="custom.domain"),
        gs.Node("Custom", "custom2", inputs=[t["x"]], outputs=[custom_invented], domain="custom.domain"),
    ]
    for node, source in zip(graph.nodes[:3], (skip_out, custom_out, custom_invented)):
        node.inputs[0] = source
    for name in ("y", "z", "v"):
        t[name].shape = None
    graph.toposort()
    refresh_shapes(graph)
    assert skip_out.shape == ["batch", 4] and t["y"].shape == ["batch", 3]
    assert t["z"].shape == ["batch", 4]
    # never the old run's invented "unk__1" (this run invents its own name, or none), never "batch"
    assert t["v"].shape[1] == 4 and t["v"].shape[0] not in ("unk__1", "batch")
    assert custom_invented.shape == [None, 4]
