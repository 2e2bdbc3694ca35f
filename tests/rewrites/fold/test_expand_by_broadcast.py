"""expand-by-broadcast: an Expand whose target is computed from Shape (torch's ``x.expand(n, -1, -1)``,
ViT's class token) becomes ``Where(cond, x, x)`` with no Shape chain left; outputs equal the original's
(ONNX Runtime CPU) at several batch sizes, NaN inputs included. And the symbolic shape evaluation it
rests on (:mod:`onnxfuse.rewrites.facts.shape_values`)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import helper as h
from onnx import numpy_helper

import helpers
from helpers import run_ort
from onnxfuse.rewrites.facts.shape_values import shape_value

RULE = "expand-by-broadcast"
E = 6


def class_token_model(extra_static: int | None = None, image_dims=("batch", 3, 4, 4)) -> onnx.ModelProto:
    """``cat([token.expand(n, -1, -1), patches], 1)`` as torch exports it: ``n`` read by Shape → Gather →
    Unsqueeze, the -1 entries replaced by 1 through ``Where(Equal(shape, -1), 1, shape)``.
    ``extra_static``: the target asks for a static middle size instead of -1 (the token repeated)."""
    middle = -1 if extra_static is None else extra_static
    inits = [numpy_helper.from_array(np.arange(E, dtype=np.float32).reshape(1, 1, E) - 2.5, "token"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array(0, np.int64), "zero_scalar"),
             numpy_helper.from_array(np.array([middle], np.int64), "middle"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
             numpy_helper.from_array(np.array([-1, -1, -1], np.int64), "minus_ones"),
             numpy_helper.from_array(np.array([1, 1, 1], np.int64), "ones"),
             numpy_helper.from_array(np.array([0, 16, 3], np.int64), "patch_shape")]
    nodes = [h.make_node("Shape", ["images"], ["shape"]),
             h.make_node("Gather", ["shape", "zero_scalar"], ["n"], axis=0),
             h.make_node("Unsqueeze", ["n", "zero"], ["n1"]),
             h.make_node("Concat", ["n1", "middle", "minus_one"], ["wanted"], axis=0),
             h.make_node("Equal", ["wanted", "minus_ones"], ["is_minus_one"]),
             h.make_node("Where", ["is_minus_one", "ones", "wanted"], ["target"]),
             h.make_node("Expand", ["token", "target"], ["tokens"]),
             h.make_node("Reshape", ["images", "patch_shape"], ["patches3"]),
             h.make_node("Concat", ["patches3", "patches3"], ["patches"], axis=2)]  # [n, 16, E]
    nodes.append(h.make_node("Concat", ["tokens", "patches"], ["out"], axis=1))
    tokens = 1 if extra_static is None else extra_static
    model = helpers.make_model(nodes, [helpers.vi("images", list(image_dims))],
                               [helpers.vi("out", [image_dims[0], tokens + 16, E])], inits, opset=17)
    onnx.checker.check_model(model, full_check=True)
    return model


def apply(model):
    out, report = helpers.optimize(model, only=[RULE])
    onnx.checker.check_model(out, full_check=True)
    return out, report


@pytest.mark.parametrize("extra_static", [None, 2])
def test_class_token_expand_becomes_a_where_broadcast_with_the_same_outputs(extra_static):
    model = class_token_model(extra_static)
    out, report = apply(model)
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    ops = helpers.op_types(out)
    assert "Expand" not in ops and "Shape" not in ops and "Where" in ops
    rng = np.random.default_rng(0)
    for batch in (1, 3):
        images = rng.standard_normal((batch, 3, 4, 4)).astype(np.float32)
        images[0, 0, 0, 0] = np.nan  # the carrier's element: Equal(NaN, NaN) is False, Where picks x all the same
        want, got = run_ort(model, {"images": images}), run_ort(out, {"images": images})
        assert got["out"].shape == want["out"].shape == (batch, (extra_static or 1) + 16, E)
        np.testing.assert_array_equal(got["out"], want["out"])


def test_refusals_carry_their_reason():
    # a constant target: nothing to remove
    constant = helpers.make_model([h.make_node("Expand", ["x", "target"], ["y"])], [helpers.vi("x", [1, E])],
                                  [helpers.vi("y", [4, E])],
                                  [numpy_helper.from_array(np.array([4, E], np.int64), "target")], opset=17)
    _, report = apply(constant)
    assert report.counts[RULE] == 0 and "constant" in report.refusals[0].reason
    # the batch's carrier has a dynamic second dimension: slicing it could be empty
    _, report = apply(class_token_model(image_dims=("batch", "channels", 4, 4)))
    assert report.counts[RULE] == 0
    assert any("not read from a numeric tensor whose other dimensions are static" in r.reason
               for r in report.refusals if r.rule == RULE)


def test_shape_values_follow_torch_expand_chains():
    graph = gs.import_onnx(onnx.shape_inference.infer_shapes(class_token_model()))
    tensors = graph.tensors()
    assert shape_value(graph, tensors["shape"]) == ["batch", 3, 4, 4]
    assert shape_value(graph, tensors["wanted"]) == ["batch", -1, -1]
    assert shape_value(graph, tensors["is_minus_one"]) == [False, True, True]  # a size is never -1
    assert shape_value(graph, tensors["target"]) == ["batch", 1, 1]
    assert shape_value(graph, tensors["images"]) is None  # not a shape value


def test_the_carrier_is_the_tensor_the_target_read_not_one_sharing_its_name():
    """Another input declared with the same ``batch`` name, listed first, fed a different batch: the
    broadcast must follow ``images`` (whose Shape the target read), as the original does. ONNX Runtime
    does not check shared names, and validation feeds them unequal."""
    model = class_token_model()
    model.graph.input.insert(0, helpers.vi("other", ["batch", 2]))
    model.graph.node.append(h.make_node("Relu", ["other"], ["other_out"]))
    model.graph.output.append(helpers.vi("other_out", ["batch", 2]))
    out, report = apply(model)
    assert report.counts[RULE] == 1
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    assert detail["carriers"] == ["images"]
    rng = np.random.default_rng(1)
    feeds = {"images": rng.standard_normal((3, 3, 4, 4)).astype(np.float32),
             "other": rng.standard_normal((2, 2)).astype(np.float32)}
    want, got = run_ort(model, feeds), run_ort(out, feeds)
    assert got["out"].shape == want["out"].shape == (3, 17, E)
    np.testing.assert_array_equal(got["out"], want["out"])


def test_a_chain_of_where_equal_steps_is_evaluated_once_per_step(monkeypatch):
    """Each ``Where(Equal(s, s), s, s)`` reads s four times: 5 nested steps are over 4⁵ evaluations of the
    chain below them without shape_value's per-call memo (and Shape's data input, the whole model above
    it, was evaluated too before it became lazy). Counted, not timed; the target is still [batch, 1, 1]
    and the rewrite exact."""
    import onnxfuse.rewrites.facts.shape_values as shape_values

    model = class_token_model()
    graph = model.graph
    (where,) = [n for n in graph.node if n.op_type == "Where"]
    (expand,) = [n for n in graph.node if n.op_type == "Expand"]
    previous, extra = where.output[0], []
    for i in range(5):
        extra += [h.make_node("Equal", [previous, previous], [f"same{i}"]),
                  h.make_node("Where", [f"same{i}", previous, previous], [f"step{i}"])]
        previous = f"step{i}"
    expand.input[1] = previous
    nodes = list(graph.node)
    del graph.node[:]
    at = nodes.index(expand)
    graph.node.extend(nodes[:at] + extra + nodes[at:])
    onnx.checker.check_model(model, full_check=True)
    graph_ = gs.import_onnx(onnx.shape_inference.infer_shapes(model))
    calls = []
    evaluate = shape_values._evaluate
    monkeypatch.setattr(shape_values, "_evaluate", lambda *a: calls.append(a[1].name) or evaluate(*a))
    assert shape_value(graph_, graph_.tensors()[previous]) == ["batch", 1, 1]
    assert len(calls) < 100, len(calls)  # one per (tensor, depth) reached: 4⁵ = 1024 without the memo
    assert "images" not in calls  # Shape reads the dimensions of its input, never its values
    monkeypatch.undo()
    out, report = apply(model)
    assert report.counts[RULE] == 1
    images = np.random.default_rng(3).standard_normal((2, 3, 4, 4)).astype(np.float32)
    np.testing.assert_array_equal(run_ort(out, {"images": images})["out"], run_ort(model, {"images": images})["out"])


def keep_expand_model(dtype=onnx.TensorProto.BOOL) -> onnx.ModelProto:
    """A [batch, 1, 1, L] keep mask expanded to [batch, 1, L, L] by a target read from ``Shape`` (L from x
    [1, L]), as
    contrib-attention spells out a keep mask, then cast to float for the output."""
    inits = [numpy_helper.from_array(np.array([0], np.int64), "first"),
             numpy_helper.from_array(np.array([1], np.int64), "one")]
    nodes = [h.make_node("Shape", ["keep"], ["keep_shape"]),
             h.make_node("Shape", ["x"], ["shape"]),
             h.make_node("Gather", ["keep_shape", "first"], ["b"], axis=0),
             h.make_node("Gather", ["shape", "one"], ["l"], axis=0),
             h.make_node("Concat", ["b", "one", "l", "l"], ["target"], axis=0),
             h.make_node("Expand", ["keep", "target"], ["full"]),
             h.make_node("Cast", ["full"], ["out"], to=onnx.TensorProto.FLOAT)]
    model = helpers.make_model(nodes, [helpers.vi("x", [1, "L"]),
                                       h.make_tensor_value_info("keep", dtype, ["batch", 1, 1, "L"])],
                               [helpers.vi("out", ["batch", 1, "L", "L"])], inits, opset=18)
    onnx.checker.check_model(model, full_check=True)
    return model


def test_a_bool_expand_is_broadcast_by_or_which_every_provider_runs():
    """ONNX Runtime has no bool Where kernel (the fuzzer found contrib-attention's spelled-out keep mask
    unloadable after this rule): a bool x goes through ``Or(x, And(cond, Not(cond)))``, and the model
    loads and gives the Expand's outputs, with no Shape left."""
    model = keep_expand_model()
    out, report = apply(model)
    assert report.counts[RULE] == 1
    ops = helpers.op_types(out)
    assert "Expand" not in ops and "Shape" not in ops and "Or" in ops and "Where" not in ops
    rng = np.random.default_rng(0)
    for batch, length in [(1, 3), (3, 5)]:
        feeds = {"x": rng.standard_normal((1, length)).astype(np.float32),
                 "keep": rng.random((batch, 1, 1, length)) > 0.4}
        np.testing.assert_array_equal(run_ort(out, feeds)["out"], run_ort(model, feeds)["out"])


def test_an_element_type_without_a_where_kernel_is_refused():
    """int16 has no Where kernel in ONNX Runtime's CPU provider: the Expand stays, with that reason."""
    model = keep_expand_model(onnx.TensorProto.INT16)
    out, report = apply(model)
    assert report.counts.get(RULE, 0) == 0 and "Expand" in helpers.op_types(out)
    reasons = [r.reason for r in report.refusals if r.rule == RULE]
    assert reasons and all("no Where kernel" in r for r in reasons), reasons
