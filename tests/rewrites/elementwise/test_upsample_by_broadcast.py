"""upsample-by-broadcast: an elementwise op reading a nearest Resize by whole factors reads the Resize's
input through a finer view instead.

Each rewritten model is run by ONNX Runtime's CPU provider (with onnxfuse's library for the
FusedElementwise nodes the default rules write) against the original, and must give the same bits: the
rewrite only relabels tensors. Which Resizes qualify is checked against ONNX Runtime itself: for every
coordinate transformation and rounding mode, the facts function may only name factors where ONNX Runtime's
Resize equals ``np.repeat`` (soundness), and must name them for the mappings the module proves."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import onnxfuse
from onnxfuse.custom_ops import session_options
from onnxfuse.model_io import to_graph
from onnxfuse.rewrites.facts.resize import FLOOR_MAPPINGS, nearest_upsample_factors

RULE = "upsample-by-broadcast"
RNG = np.random.default_rng(11)
MODES = ["half_pixel", "pytorch_half_pixel", "asymmetric", "tf_half_pixel_for_nn", "align_corners",
         "half_pixel_symmetric"]
ROUNDINGS = ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]


def resize_model(factors, mode="asymmetric", rounding="floor", by_sizes=False, coarse=(2, 3, 4, 5), opset=19):
    """One Resize of a [2, 3, 4, 5] tensor by ``factors`` (scales, or sizes when ``by_sizes``)."""
    out = [int(c * f) for c, f in zip(coarse, factors)]
    inits = [nh.from_array(np.array([], np.float32), "roi"),
             nh.from_array(np.array(factors, np.float32), "scales")]
    inputs = ["x", "roi", "scales"]
    if by_sizes:
        inits[1] = nh.from_array(np.array([], np.float32), "scales")
        inits.append(nh.from_array(np.array(out, np.int64), "sizes"))
        inputs.append("sizes")
    node = h.make_node("Resize", inputs, ["y"], mode="nearest", coordinate_transformation_mode=mode,
                       nearest_mode=rounding)
    g = h.make_graph([node], "g", [h.make_tensor_value_info("x", T.FLOAT, list(coarse))],
                     [h.make_tensor_value_info("y", T.FLOAT, out)], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)], ir_version=9)


@pytest.mark.parametrize("mode, rounding", list(itertools.product(MODES, ROUNDINGS)))
@pytest.mark.parametrize("factors", [(1, 1, 2, 2), (1, 1, 3, 3), (1, 2, 1, 4)])
def test_factors_are_named_exactly_where_the_resize_repeats_elements(factors, mode, rounding):
    model = resize_model(factors, mode, rounding)
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    repeated = x
    for axis, f in enumerate(factors):
        repeated = np.repeat(repeated, f, axis=axis)
    graph = to_graph(model)
    named = nearest_upsample_factors(graph, graph.nodes[0])
    if named is not None:  # sound: only where ONNX Runtime repeats the elements
        assert named == list(factors) and np.array_equal(got, repeated)
    if (mode, rounding) in FLOOR_MAPPINGS:  # and complete for the mappings the module proves
        assert named == list(factors)


def test_factors_from_sizes_and_refusals():
    graph = to_graph(resize_model((1, 1, 2, 2), by_sizes=True))
    assert nearest_upsample_factors(graph, graph.nodes[0]) == [1, 1, 2, 2]
    for model in (resize_model((1, 1, 1.5, 2)), resize_model((1, 1, 1, 1))):
        graph = to_graph(model)
        assert nearest_upsample_factors(graph, graph.nodes[0]) is None
    linear = resize_model((1, 1, 2, 2))
    linear.graph.node[0].attribute[0].s = b"linear"
    graph = to_graph(linear)
    assert nearest_upsample_factors(graph, graph.nodes[0]) is None


def fpn_model(layout="nchw", bias=True, factors=(2, 2), mode="asymmetric", rounding="floor", tail="Relu",
              batch="batch"):
    """``tail(Add(Conv(x) [+ bias], Resize(y)))``: a feature pyramid's top-down step, NCHW or NHWC (the
    Resize then scales axes 1 and 2, as a channels-last region writes it), with a dynamic batch."""
    c, h_, w_ = 8, 6 * factors[0], 4 * factors[1]
    scales = [1, 1, *factors] if layout == "nchw" else [1, *factors, 1]
    inits = [nh.from_array(RNG.standard_normal((c, 4, 1, 1)).astype(np.float32), "w"),
             nh.from_array(np.array(scales, np.float32), "scales"), nh.from_array(np.array([], np.float32), "roi")]
    conv_in = ["xc", "w"] + (["b"] if bias else [])
    if bias:
        inits.append(nh.from_array(RNG.standard_normal(c).astype(np.float32), "b"))
    nodes = [h.make_node("Conv", conv_in, ["cc"])]
    if layout == "nchw":
        x_shape, y_shape, out_shape = [batch, 4, h_, w_], [batch, c, 6, 4], [batch, c, h_, w_]
        nodes[0].input[0], nodes[0].output[0] = "x", "c"
    else:  # the Conv in NCHW between transposes: the graph a channels-last region leaves, in standard ops
        x_shape, y_shape, out_shape = [batch, 4, h_, w_], [batch, 6, 4, c], [batch, h_, w_, c]
        nodes = [h.make_node("Identity", ["x"], ["xc"]), nodes[0],
                 h.make_node("Transpose", ["cc"], ["c"], perm=[0, 2, 3, 1])]
    nodes += [h.make_node("Resize", ["y", "roi", "scales"], ["u"], mode="nearest",
                          coordinate_transformation_mode=mode, nearest_mode=rounding),
              h.make_node("Add", ["c", "u"], ["s"])]
    nodes.append(h.make_node(tail, ["s"], ["out"]) if tail else h.make_node("Identity", ["s"], ["out"]))
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, x_shape),
                                  h.make_tensor_value_info("y", T.FLOAT, y_shape)],
                     [h.make_tensor_value_info("out", T.FLOAT, out_shape)], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 14)], ir_version=8)


def optimize(model, only=None):
    """The pipeline's rewrite (shape inference first, as a user's optimize), without validation: the tests
    compare the outputs themselves."""
    result = onnxfuse.optimize(model, only=only, validate=False, bench=False, provider="cpu")
    return result.model, result.applied


def run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def feeds_for(model, batch=3):
    dims = {i.name: [d.dim_value or batch for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    return {name: RNG.standard_normal(shape).astype(np.float32) for name, shape in dims.items()}


def ops(model):
    return [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("factors", [(2, 2), (3, 2)])
@pytest.mark.parametrize("mode, rounding", [("asymmetric", "floor"), ("half_pixel", "round_prefer_floor")])
def test_the_add_reads_the_coarse_map_and_computes_the_same_bits(layout, factors, mode, rounding):
    model = fpn_model(layout, factors=factors, mode=mode, rounding=rounding)
    out, report = optimize(model)
    assert report.counts[RULE] == 1 and "Resize" not in ops(out)
    feeds = feeds_for(model)
    assert np.array_equal(run(out, feeds), run(model, feeds))


def test_the_bias_add_and_the_activation_join_the_view_in_one_kernel():
    """conv-bias-into-elementwise lifts the Conv's bias into an Add: the view takes it and the Relu after the
    Add too, so one FusedElementwise computes bias, sum and Relu, and the only Reshapes are views."""
    model = fpn_model("nchw", bias=True, tail="Relu")
    out, report = optimize(model)
    assert report.counts[RULE] == 1 and report.counts["conv-bias-into-elementwise"] == 1
    assert sorted(ops(out)) == ["Conv", "FusedElementwise", "Reshape", "Reshape", "Reshape"]
    detail = next(d for d in report.details if d.get("rule") == RULE)
    assert detail["ops"] == 3 and detail["upsampled_map_not_written"]
    feeds = feeds_for(model, batch=2)
    np.testing.assert_allclose(run(out, feeds), run(model, feeds), rtol=1e-6, atol=1e-5)  # the CPU Conv's bias


def test_a_batch_the_add_broadcasts_stays_broadcast():
    """The dimensions before the first upsampled axis are copied by the Reshapes, so an operand whose batch
    is 1 is still broadcast against the other's."""
    model = fpn_model("nchw", bias=False, tail=None)
    out, report = optimize(model)
    assert report.counts[RULE] == 1
    feeds = feeds_for(model, batch=3)
    feeds["x"] = feeds["x"][:1]
    assert np.array_equal(run(out, feeds), run(model, feeds))


def test_a_static_batch_of_one_broadcast_against_three():
    """Static shapes: the lateral map's batch is 1, the coarse map's 3. The lateral map's view keeps its
    1 (declared so, as ONNX Runtime infers it: a declared 3 there made an invalid model)."""
    model = fpn_model("nchw", bias=True, tail="Relu", batch=3)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1
    out, report = optimize(model)
    assert report.counts[RULE] == 1
    onnx.checker.check_model(out, full_check=True)
    feeds = feeds_for(model)
    feeds["x"] = feeds["x"][:1]
    np.testing.assert_allclose(run(out, feeds), run(model, feeds), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("change, reason", [
    (dict(mode="asymmetric", rounding="round_prefer_floor"), "not a nearest Resize by whole factors"),
    (dict(mode="align_corners", rounding="floor"), "not a nearest Resize by whole factors"),
])
def test_refused_resizes(change, reason):
    model = fpn_model("nchw", **change)
    out, report = optimize(model)
    assert RULE not in report.counts or report.counts[RULE] == 0
    assert "Resize" in ops(out)
    assert any(r.rule == RULE and reason in r.reason for r in report.refusals)


def test_a_reader_outside_the_language_keeps_the_resize():
    model = fpn_model("nchw", bias=False, tail=None)
    model.graph.node[-2].op_type = "Concat"  # Concat(c, u) along channels
    model.graph.node[-2].attribute.extend([h.make_attribute("axis", 1)])
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 16
    onnx.checker.check_model(model)
    out, report = optimize(model, only=RULE)
    assert "Resize" in ops(out)
    assert any(r.rule == RULE and "Concat reads the upsampled map" in r.reason for r in report.refusals)


def test_an_operand_broadcast_along_an_upsampled_axis_is_refused():
    """A gate of shape [N, C, 1, 1] that is not a constant: its 1s sit on the upsampled axes, which the view
    would have to split; not handled (refused), so nothing changes."""
    inits = [nh.from_array(np.array([1, 1, 2, 2], np.float32), "scales"), nh.from_array(np.array([], np.float32), "roi")]
    nodes = [h.make_node("Resize", ["y", "roi", "scales"], ["u"], mode="nearest",
                         coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
             h.make_node("Mul", ["u", "gate"], ["out"])]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("y", T.FLOAT, ["batch", 8, 6, 4]),
                                  h.make_tensor_value_info("gate", T.FLOAT, ["batch", 8, 1, 1])],
                     [h.make_tensor_value_info("out", T.FLOAT, ["batch", 8, 12, 8])], inits)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 14)], ir_version=8)
    out, report = optimize(model, only=RULE)
    assert "Resize" in ops(out)
    assert any(r.rule == RULE and "operand 'gate'" in r.reason for r in report.refusals)


@pytest.mark.parametrize("second", [None, "zero"])
def test_an_op_with_nothing_of_the_full_size_is_refused(second):
    """Relu(Resize(y)) or Max(Resize(y), 0): in the view the result would keep the coarse size (found by the
    fuzzer: the Reshape back then fails), so the Resize stays."""
    inits = [nh.from_array(np.array([1, 1, 2, 2], np.float32), "scales"), nh.from_array(np.array([], np.float32), "roi"),
             nh.from_array(np.array(0, np.float32), "zero")]
    tail = h.make_node("Relu", ["u"], ["out"]) if second is None else h.make_node("Max", ["u", "zero"], ["out"])
    nodes = [h.make_node("Resize", ["y", "roi", "scales"], ["u"], mode="nearest",
                         coordinate_transformation_mode="asymmetric", nearest_mode="floor"), tail]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("y", T.FLOAT, ["batch", 8, 6, 4])],
                     [h.make_tensor_value_info("out", T.FLOAT, ["batch", 8, 12, 8])], inits)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 14)], ir_version=8)
    out, report = optimize(model, only=RULE)
    assert "Resize" in ops(out)
    assert any(r.rule == RULE and "no other operand has the upsampled size" in r.reason for r in report.refusals)


def test_a_view_above_rank_eight_is_refused():
    """A rank-7 tensor upsampled on two axes would be viewed at rank 9, beyond ONNX Runtime's broadcasting
    kernels (a lone op stays theirs)."""
    coarse, factors = [2, 2, 2, 2, 2, 3, 4], [1, 1, 1, 1, 1, 2, 2]
    full = [c * f for c, f in zip(coarse, factors)]
    inits = [nh.from_array(np.array(factors, np.float32), "scales"), nh.from_array(np.array([], np.float32), "roi")]
    nodes = [h.make_node("Resize", ["y", "roi", "scales"], ["u"], mode="nearest",
                         coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
             h.make_node("Add", ["u", "x"], ["out"])]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("y", T.FLOAT, coarse), h.make_tensor_value_info("x", T.FLOAT, full)],
                     [h.make_tensor_value_info("out", T.FLOAT, full)], inits)
    out, report = optimize(h.make_model(g, opset_imports=[h.make_opsetid("", 14)], ir_version=8), only=RULE)
    assert "Resize" in ops(out)
    assert any(r.rule == RULE and "rank 9" in r.reason for r in report.refusals)


def random_upsample_graph(seed: int):
    """A random graph around one nearest upsample: a chain of elementwise ops above the op that reads it
    (on a full-size input, with constants of the full, per-channel or one-element shape), the reading op
    (Add, Mul, Sub, Max or Where, the upsampled map on either side), and unary or binary ops below it;
    NCHW or NHWC, factors 2 or 3 on one or both spatial axes, any mapping the facts module proves."""
    rng = np.random.default_rng(seed)
    nhwc = bool(rng.integers(2))
    fh, fw = (int(v) for v in rng.choice([1, 2, 3], 2))
    if fh == fw == 1:
        fh = 2
    c, hc, wc = int(rng.integers(2, 5)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
    coarse = [2, hc, wc, c] if nhwc else [2, c, hc, wc]
    full = [2, hc * fh, wc * fw, c] if nhwc else [2, c, hc * fh, wc * fw]
    scales = [1, fh, fw, 1] if nhwc else [1, 1, fh, fw]
    mode, rounding = sorted(FLOOR_MAPPINGS)[int(rng.integers(len(FLOOR_MAPPINGS)))]
    per_channel = [c] if nhwc else [c, 1, 1]
    inits = [nh.from_array(np.array(scales, np.float32), "scales"), nh.from_array(np.array([], np.float32), "roi")]
    nodes, k = [h.make_node("Resize", ["y", "roi", "scales"], ["u"], mode="nearest",
                            coordinate_transformation_mode=mode, nearest_mode=rounding)], 0

    def const(shape):
        nonlocal k
        k += 1
        inits.append(nh.from_array(rng.standard_normal(shape).astype(np.float32), f"k{k}"))
        return f"k{k}"

    def operand():
        kind = int(rng.integers(3))
        return const(full if kind == 0 else per_channel if kind == 1 else [])

    a = "x"
    for i in range(int(rng.integers(0, 3))):  # above: elementwise ops on the full-size input
        op = ["Add", "Mul", "Relu", "Sigmoid"][int(rng.integers(4))]
        nodes.append(h.make_node(op, [a] if op in ("Relu", "Sigmoid") else [a, operand()], [f"a{i}"]))
        a = f"a{i}"
    op = ["Add", "Mul", "Sub", "Max", "Where"][int(rng.integers(5))]
    pair = [a, "u"] if rng.integers(2) else ["u", a]
    if op == "Where":
        nodes.append(h.make_node("Greater", [a, const([])], ["cond"]))
        pair = ["cond", *pair]
    nodes.append(h.make_node(op, pair, ["e"]))
    e = "e"
    for i in range(int(rng.integers(0, 3))):  # below
        op = ["Relu", "Tanh", "Add", "Mul"][int(rng.integers(4))]
        nodes.append(h.make_node(op, [e] if op in ("Relu", "Tanh") else [e, operand()], [f"b{i}"]))
        e = f"b{i}"
    nodes.append(h.make_node("Identity", [e], ["out"]))
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["batch", *full[1:]]),
                                  h.make_tensor_value_info("y", T.FLOAT, ["batch", *coarse[1:]])],
                     [h.make_tensor_value_info("out", T.FLOAT, ["batch", *full[1:]])], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 14)], ir_version=8)


@pytest.mark.parametrize("seed", range(40))
def test_random_graphs_around_an_upsample_keep_their_bits(seed):
    """The rule alone on random graphs around one upsample: ONNX Runtime's own ops on the view give the
    same bits as the original. Then the default rules (fuse-elementwise after the view): within a float32
    ulp or so, as FusedElementwise's Sigmoid and Tanh are not ONNX Runtime's CPU approximations."""
    model = random_upsample_graph(seed)
    onnx.checker.check_model(model, full_check=True)
    feeds = feeds_for(model, batch=2)
    want = run(model, feeds)
    out, _ = optimize(model, only=RULE)
    onnx.checker.check_model(out, full_check=True)
    np.testing.assert_array_equal(run(out, feeds), want)
    out, _ = optimize(model)
    onnx.checker.check_model(out, full_check=True)
    np.testing.assert_allclose(run(out, feeds), want, rtol=1e-6, atol=1e-6)


def test_the_random_graphs_reach_the_rule():
    applied = sum(optimize(random_upsample_graph(seed), only=RULE)[1].counts.get(RULE, 0) for seed in range(40))
    assert applied >= 30


def interpolate_by_size_model(own_shape: bool = True):
    """``Add(x, Resize(y, sizes=Concat(Slice(Shape(y), 0, 2), [h, w])))``: torchvision's feature pyramid
    (``F.interpolate(y, size=x.shape[-2:])``) exported with a dynamic batch. ``own_shape=False`` reads the
    leading sizes from ``x`` instead, which carries the same dimension names but is not the Resize's input."""
    inits = [nh.from_array(np.array([0], np.int64), "zero"), nh.from_array(np.array([2], np.int64), "two"),
             nh.from_array(np.array([12, 8], np.int64), "hw"), nh.from_array(np.array([], np.float32), "roi"),
             nh.from_array(np.array([], np.float32), "no_scales")]
    nodes = [h.make_node("Shape", ["y" if own_shape else "x"], ["shape"]),
             h.make_node("Slice", ["shape", "zero", "two", "zero"], ["lead"]),
             h.make_node("Concat", ["lead", "hw"], ["sizes"], axis=0),
             h.make_node("Resize", ["y", "roi", "no_scales", "sizes"], ["u"], mode="nearest",
                         coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
             h.make_node("Add", ["x", "u"], ["s"]), h.make_node("Relu", ["s"], ["out"])]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["batch", 8, 12, 8]),
                                  h.make_tensor_value_info("y", T.FLOAT, ["batch", 8, 6, 4])],
                     [h.make_tensor_value_info("out", T.FLOAT, ["batch", 8, 12, 8])], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 14)], ir_version=8)


def test_sizes_read_from_the_resizes_own_shape_give_factors_and_the_same_bits():
    model = interpolate_by_size_model()
    graph = to_graph(model)
    resize = next(n for n in graph.nodes if n.op == "Resize")
    assert nearest_upsample_factors(graph, resize) == [1, 1, 2, 2]
    out, report = optimize(model, only=RULE)
    assert report.counts[RULE] == 1 and "Resize" not in ops(out) and "Shape" not in ops(out)
    feeds = feeds_for(model, batch=3)
    assert np.array_equal(run(out, feeds), run(model, feeds))


def test_sizes_read_from_another_tensor_are_not_proof():
    """x shares y's dimension names but is another tensor: ONNX Runtime does not check declared names,
    so its leading sizes are not proven to be y's (the Resize could change y's batch); refused."""
    graph = to_graph(interpolate_by_size_model(own_shape=False))
    resize = next(n for n in graph.nodes if n.op == "Resize")
    assert nearest_upsample_factors(graph, resize) is None
